"""The planner's network simplex, the DAG's longest path, the rounding's passes and the switch replay
(perseus/planner/_flow.c) as an optional C extension: where it cannot be compiled, the install goes
on, the planner solves its LP with HiGHS and the rest runs in Python. The C and Python versions do
the same float operations, so no multiply-add may be fused (`-ffp-contract=off`)."""

import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-ffp-contract=off"]
setup(
    ext_modules=[
        Extension("perseus.planner._flow", ["perseus/planner/_flow.c"], extra_compile_args=flags, optional=True)
    ]
)
