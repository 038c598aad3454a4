"""The metrics tests use the planner-service tests' helpers and their `serve` fixture (real
`perseus serve` processes on loopback)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SERVER_TESTS = Path(__file__).parents[1] / "server"
sys.path.insert(0, str(SERVER_TESTS))

_spec = importlib.util.spec_from_file_location("server_tests_conftest", SERVER_TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_server_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_server_conftest)
serve = _server_conftest.serve
