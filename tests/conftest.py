"""Makes this folder importable by every test (pytest puts a rootdir conftest's folder on sys.path),
for the helpers beside it (benchmark_scripts).

Simulated GPUs made from PERSEUS_GPU=sim:... or `sim_gpus` behave like real ones by default
(perseus.devices.sim_realism): counters that step every 100 ms, clock changes that take effect
late. Tests compare exact values, so they run them ideal unless they ask for realism themselves
(PERSEUS_SIM_MODE, or `SimGPU(..., realism=...)`); the setting reaches the processes they start.
"""

import os

from perseus.devices.sim_realism import IDEAL_MODE, MODE_ENV

os.environ.setdefault(MODE_ENV, IDEAL_MODE)
