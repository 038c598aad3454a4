"""The planner's network simplex and the DAG's longest path (perseus/planner/_flow.c) as an optional
C extension: where it cannot be compiled, the install goes on, the planner solves its LP with HiGHS
and longest paths run in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("perseus.planner._flow", ["perseus/planner/_flow.c"], optional=True)])
