"""Hooks into training frameworks. `perseus.integrations.huggingface.PowerLimitCallback`
wires the global power-limit optimizer into the Hugging Face Trainer (needs the
`huggingface` extra: pip install 'perseus[huggingface]')."""
