"""Perseus: measure and cut the energy of deep-learning training on GPUs."""

__version__ = "0.2.0"

__all__ = ["instrument"]


def __getattr__(name: str):
    # Lazy: `import perseus` stays light (no torch, no controller threads' modules).
    if name == "instrument":
        from perseus.runtime.torch_stage import instrument

        return instrument
    raise AttributeError(f"module 'perseus' has no attribute {name!r}")
