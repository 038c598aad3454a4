"""Probe results kept per GPU model, so the runtime and planner read them without probing again.

One JSON file per model in the cache folder: $PERSEUS_PROBE_DIR, else $XDG_CACHE_HOME/perseus/probe,
else ~/.cache/perseus/probe. Written atomically. A simulated GPU's model includes how realistic it
is (an ideal and a realistic simulated A100 are different models to probe).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, replace
from pathlib import Path

from perseus.atomic import write_json_atomic
from perseus.devices.gpu import GPU
from perseus.devices.sim import SimGPU
from perseus.exceptions import ConfigError
from perseus.probe.result import ProbeResult

CACHE_ENV = "PERSEUS_PROBE_DIR"
#: Figures a probe may leave unmeasured (None) that a new probe keeps from the one before.
UNMEASURED_KEEPS = ("energy_counter_update_s", "power_update_s", "power_average_window_s", "idle_power_w")


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "perseus" / "probe"


def model_key(gpu: GPU) -> str:
    """The cache key of `gpu`'s model: its name, made file-safe; plus its realism if simulated."""
    key = re.sub(r"[^A-Za-z0-9._-]+", "_", gpu.name()).strip("_") or "gpu"
    if isinstance(gpu, SimGPU):
        realism = json.dumps(asdict(gpu.realism), sort_keys=True)
        key += "-" + hashlib.sha256(realism.encode()).hexdigest()[:10]
    return key


def path_for(gpu: GPU) -> Path:
    return cache_dir() / f"{model_key(gpu)}.json"


def load(gpu: GPU) -> ProbeResult | None:
    """What a probe found for `gpu`'s model; None if it was never probed (here, with this cache folder)."""
    path = path_for(gpu)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"cannot read the probe cache {path} ({e}); set {CACHE_ENV} to a readable folder") from e
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{path}: not JSON ({e}); delete it or run `perseus probe` again") from e
    return ProbeResult.from_dict(doc, str(path))


def energy_counter_period_s(gpu: GPU) -> float:
    """How often `gpu`'s energy counter steps: as probed for its model, else what the backend
    says (`GPU.energy_counter_period_s`). A window a few periods long reads counter steps, not energy."""
    try:
        probed = load(gpu)
    except ConfigError:
        probed = None  # an unreadable cache: the backend's figure
    if probed is not None and probed.energy_counter_update_s is not None:
        return probed.energy_counter_update_s
    return gpu.energy_counter_period_s()


def save(result: ProbeResult) -> Path:
    """Keep `result` for its model. What it did not measure (switch latencies without clock
    changes; a figure a watch too short could not tell) stays as measured before."""
    path = cache_dir() / f"{result.key}.json"
    try:
        old_doc = json.loads(path.read_text(encoding="utf-8"))
        old = ProbeResult.from_dict(old_doc, str(path))
    except (OSError, ValueError):
        old = None  # none yet, or unreadable: replaced
    if old is not None:
        kept = {name: getattr(old, name) for name in UNMEASURED_KEEPS if getattr(result, name) is None}
        if not result.clock_switch_latency_s:
            kept["clock_switch_latency_s"] = old.clock_switch_latency_s
        result = replace(result, **kept)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, result.to_dict())
    except OSError as e:
        raise ConfigError(f"cannot write the probe cache {path} ({e}); set {CACHE_ENV} to a writable folder") from e
    return path
