"""`perseus demo`: Perseus end to end on simulated GPUs (launcher, per-rank worker, results).

Only `model`, `emulation` and `worker` import torch; the launcher and the command line do not.
"""
