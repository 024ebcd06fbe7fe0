"""The one part of the build pyproject.toml cannot state without an experimental table: the
native kernels (espn/native/: the MaxSim kernel and the centroid stage's estimate; no Python
headers, loaded with ctypes by espn.maxsim_native). Optional: without a C compiler the
install goes on and search runs the torch and numpy versions, to the same results."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("espn._maxsim", sources=["espn/native/maxsim.c", "espn/native/centroid_estimate.c"], optional=True,
                             extra_compile_args=["-O3"])])
