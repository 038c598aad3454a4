"""Arguments several subcommands share."""

from __future__ import annotations

import argparse
import os

from perseus.devices.gpu import GPU
from perseus.devices.select import ENV_VAR, get_gpus, parse_gpu_spec
from perseus.exceptions import ConfigError


def add_gpu_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu",
        metavar="SPEC",
        default=None,
        help="GPU backend: 'nvml' (NVIDIA), 'amd' (AMD, through amdsmi), 'auto' (NVIDIA, else AMD) or "
        "'sim:PRESET[:COUNT]' (default: $PERSEUS_GPU, else auto)",
    )
    parser.add_argument(
        "--gpu-indices",
        metavar="I,J",
        default=None,
        help="comma-separated indices of the selected GPUs to use (default: all)",
    )


def parse_gpu_indices(text: str | None, available: list[int]) -> list[int] | None:
    """`--gpu-indices` as a list (None: all), each checked against the indices `available`."""
    if text is None:
        return None
    indices = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ConfigError(f"--gpu-indices {text!r}: {part!r} is not a GPU index (use e.g. 0,2)")
        index = int(part)
        if index not in available:
            raise ConfigError(
                f"--gpu-indices {text!r}: there is no GPU {index} (GPUs: {', '.join(map(str, available))})"
            )
        if index in indices:
            raise ConfigError(f"--gpu-indices {text!r}: GPU {index} is listed twice")
        indices.append(index)
    return indices


def select_gpus(args: argparse.Namespace) -> list[GPU]:
    """The GPUs chosen by --gpu (or $PERSEUS_GPU) and narrowed by --gpu-indices."""
    gpus = get_gpus(args.gpu)
    indices = parse_gpu_indices(args.gpu_indices, [gpu.index for gpu in gpus])
    if indices is None:
        return gpus
    by_index = {gpu.index: gpu for gpu in gpus}
    return [by_index[i] for i in indices]


def backend_name(args: argparse.Namespace) -> str:
    """'auto', 'nvml', 'amd' or 'sim', as chosen by --gpu, else $PERSEUS_GPU, else auto-detection."""
    return parse_gpu_spec(args.gpu or os.environ.get(ENV_VAR) or "auto").backend
