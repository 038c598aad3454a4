"""Perseus: measure and cut the energy of deep-learning training on GPUs."""

__version__ = "0.1.0"
