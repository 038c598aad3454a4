"""The planner's network simplex (perseus/planner/_flow.c) as an optional C extension: where it
cannot be compiled, the install goes on and the planner solves its LP with HiGHS instead."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("perseus.planner._flow", ["perseus/planner/_flow.c"], optional=True)])
