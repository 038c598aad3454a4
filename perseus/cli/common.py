"""Arguments several subcommands share."""

from __future__ import annotations

import argparse


def add_gpu_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu",
        metavar="SPEC",
        default=None,
        help="GPU backend: 'nvml' or 'sim:PRESET[:COUNT]' (default: $PERSEUS_GPU, else nvml)",
    )
    parser.add_argument(
        "--gpu-indices",
        metavar="I,J",
        default=None,
        help="comma-separated indices of the selected GPUs to use (default: all)",
    )
