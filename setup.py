"""Builds akunu's decode-shaped matmul library on Linux (akunu/backends/cpu/_matvec.c); optional.

Without a C compiler the package still installs and MLX's matmuls stay on OpenBLAS's sgemm.
Everything else about the package is in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

matvec = Extension(
    "akunu.backends.cpu._matvec",
    sources=["akunu/backends/cpu/_matvec.c"],
    extra_compile_args=["-O3", "-fopenmp"],
    extra_link_args=["-fopenmp"],
    optional=True,
)

setup(ext_modules=[matvec] if sys.platform.startswith("linux") else [])
