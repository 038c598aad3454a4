"""Text the service keeps, sends and logs from clients, planners and the OS: one printable line of
bounded length, so no message can forge log lines or grow a reply without bound."""

from __future__ import annotations

MAX_TEXT = 2000


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """`text` with control characters escaped, cut to `limit` characters."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
