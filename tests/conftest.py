"""Makes this folder importable by every test (pytest puts a rootdir conftest's folder on sys.path),
for the helpers beside it (benchmark_scripts)."""
