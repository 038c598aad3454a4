"""One line for the user about what Perseus did (a chosen power limit, an epoch's energy),
whatever the program's logging set-up.

Python's logging shows only warnings until a program configures it, and a chosen limit is news,
not a problem: as a warning it would be mislabelled, and at INFO nobody would see it. So
`notice` prints the line to stderr, prefixed "perseus: ", unless logging would show it at INFO
(INFO enabled for the logger and a handler to take it); then the line goes to the log instead,
followed by `detail` (a table, say) that only INFO shows, and never appears twice. stderr
reaches the terminal under torchrun (which forwards every rank's output) and leaves stdout to
the program. In a distributed job only rank 0 speaks (the other ranks log at DEBUG): the
ranks share one choice. `verbose=False` on the objects that call this silences the line.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

PREFIX = "perseus: "


def _dist() -> Any | None:
    """torch.distributed when a process group is initialised (torch is never imported here)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def rank() -> int:
    """This process's torch.distributed rank, 0 without a process group."""
    dist = _dist()
    return 0 if dist is None else int(dist.get_rank())


def world_size() -> int:
    """The number of torch.distributed ranks, 1 without a process group."""
    dist = _dist()
    return 1 if dist is None else int(dist.get_world_size())


def logs_info(logger: logging.Logger) -> bool:
    """Whether logging would show an INFO record of `logger` (not just Python's last-resort
    handler, which shows warnings only)."""
    return logger.isEnabledFor(logging.INFO) and logger.hasHandlers()


def notice(logger: logging.Logger, line: str, detail: str | None = None) -> None:
    """Tell the user `line`: logged at INFO (with `detail` below it) where logging shows INFO,
    else printed to stderr; on ranks other than 0 only logged at DEBUG."""
    text = line if detail is None else f"{line}\n{detail}"
    if rank() != 0:
        logger.debug("%s", text)
    elif logs_info(logger):
        logger.info("%s", text)
    elif sys.stderr is not None:
        print(PREFIX + line, file=sys.stderr, flush=True)
