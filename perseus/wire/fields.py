"""Field validation of wire messages: the one mechanism every message uses.

Each message type is a frozen dataclass (a `Message`) whose `__post_init__` checks every field
with the `check_*` functions here (types, ranges, enums), normalizing it with `set_fields`; a
check raises ConfigError naming the field and what it must be. `Message.from_wire()` rejects
unknown or missing fields (`fields_of`), `to_wire()` gives plain msgpack-able values.
"""

from __future__ import annotations

import math
import reprlib
import sys
from dataclasses import MISSING, fields
from typing import Any, ClassVar

from perseus.exceptions import ConfigError
from perseus.wire.limits import MAX_FREQUENCIES, MAX_FREQUENCY_MHZ, PROTOCOL_VERSION

_SHOW = reprlib.Repr()
_SHOW.maxlevel = 3  # a field nested 1,000 deep must not make the error message recurse
_SHOW.maxstring = _SHOW.maxother = 60


def show(value: Any) -> str:
    """`value` for an error message: at most 60 characters, nesting cut at 3 levels."""
    text = _SHOW.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {show(value)}")
    return int(value)


def check_float(value: Any, name: str, lo: float, hi: float, *, open_lo: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or not (lo < value if open_lo else lo <= value) or value > hi:
        bound = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise ConfigError(f"{name} must be a finite number in {bound}, got {show(value)}")
    return float(value)


def check_str(
    value: Any,
    name: str,
    max_len: int,
    *,
    min_len: int = 0,
    choices: tuple[str, ...] | None = None,
    printable: bool = True,
) -> str:
    if not isinstance(value, str) or not min_len <= len(value) <= max_len:
        raise ConfigError(f"{name} must be a string of {min_len} to {max_len} characters, got {show(value)}")
    if printable and not value.isprintable():  # names reach log lines: no newlines or terminal escapes
        raise ConfigError(
            f"{name} must be printable text (no control characters such as newlines or escapes), got {show(value)}"
        )
    if choices is not None and value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {show(value)}")
    return value


def check_seq(value: Any, name: str, max_len: int, *, min_len: int = 0) -> list | tuple:
    if not isinstance(value, (list, tuple)) or not min_len <= len(value) <= max_len:
        raise ConfigError(f"{name} must be a list of {min_len} to {max_len} items, got {show(value)}")
    return value


def check_ints(value: Any, name: str, lo: int, hi: int, max_len: int, *, min_len: int = 0) -> tuple[int, ...]:
    return tuple(
        check_int(v, f"{name}[{i}]", lo, hi) for i, v in enumerate(check_seq(value, name, max_len, min_len=min_len))
    )


def check_frequencies(value: Any, name: str) -> tuple[int, ...]:
    """Distinct frequencies in MHz, returned highest first."""
    freqs = check_ints(value, name, 1, MAX_FREQUENCY_MHZ, MAX_FREQUENCIES, min_len=1)
    if len(set(freqs)) != len(freqs):
        raise ConfigError(f"{name} lists a frequency twice; list each supported frequency once")
    return tuple(sorted(freqs, reverse=True))


def check_job_id(value: Any, name: str) -> str:
    text = check_str(value, name, 64, min_len=1)
    if not text.startswith("job-") or not all(c in "0123456789abcdef" for c in text[4:]):
        raise ConfigError(f"{name} must be a job id as register_job returns (job-<hex>), got {show(value)}")
    return text


def set_fields(obj: object, **values: Any) -> None:
    """Store checked (normalized) values on a frozen message."""
    for key, value in values.items():
        object.__setattr__(obj, key, value)


class Message:
    """Base of every wire message: dataclass fields are the wire fields."""

    TYPE: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_wire(cls, doc: Any) -> Any:
        return cls(**fields_of(cls, doc, cls.TYPE or cls.__name__))


def fields_of(cls: type, doc: Any, where: str) -> dict[str, Any]:
    """`doc` as constructor keywords of dataclass `cls`: a map with no unknown or missing keys."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{where} must be a map, got {show(doc)}")
    known = {f.name: f for f in fields(cls)}
    unknown = [k for k in doc if k not in known]
    if unknown:
        named = ", ".join(show(k) for k in unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise ConfigError(
            f"{where}: unknown field(s) {named}; protocol v{PROTOCOL_VERSION} fields are {', '.join(known)}"
        )
    missing = [n for n, f in known.items() if n not in doc and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
    return dict(doc)


def check_opt_float(value: Any, name: str) -> float | None:
    """A status figure: any finite non-negative number (a job's energy summed over many ranks and
    iterations has no useful upper bound)."""
    return None if value is None else check_float(value, name, 0.0, sys.float_info.max)
