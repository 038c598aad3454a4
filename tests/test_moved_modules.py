"""The module paths that moved in 0.2 are refused with where their parts went."""

from __future__ import annotations

import pytest


def test_importing_perseus_server_says_where_its_parts_went():
    with pytest.raises(ImportError, match=r"perseus\.client .*perseus\.service .*perseus\.wire"):
        import perseus.server  # noqa: F401
