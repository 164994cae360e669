"""The one compiled part of specdec: the CPU output layer (specdec/runtime/_cpu_head.c).

It is optional: where it does not compile, specdec installs without it and llama.cpp computes the
output layer itself (specdec/runtime/cpu_head.py says why it is faster where it is used)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("specdec.runtime._cpu_head", sources=["specdec/runtime/_cpu_head.c"],
                             extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"], optional=True)])
