"""The one part of the build pyproject.toml cannot state without an experimental table: the
MaxSim kernel (espn/native/maxsim.c, no Python headers, loaded with ctypes by
espn.maxsim_native). Optional: without a C compiler the install goes on and search scores
with torch, to the same results."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("espn._maxsim", sources=["espn/native/maxsim.c"], optional=True,
                             extra_compile_args=["-O3"])])
