"""Hooks into training frameworks and experiment trackers.

`perseus.integrations.huggingface.PowerLimitCallback` wires the global power-limit optimizer
into the Hugging Face Trainer and puts energy, power, the limit and emissions into its logs, so
every `report_to` backend records them (the `huggingface` extra).
`perseus.integrations.tensorboard.TensorBoardReporter` writes a `perseus.instrument` job's
iterations, or a plain loop's Monitor windows, as TensorBoard scalars (the `tensorboard` extra).
"""
