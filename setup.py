"""Build settings live in setup.cfg, except the one mapping it cannot state: the kernel files sit
in the repository's top-level cuda/ folder, and the wheel ships them inside the package as
tinyvllm/cuda/ (a top-level `cuda` in site-packages would collide with NVIDIA's cuda-python).
tinyvllm/gpu/kernels.py finds them in either place."""
from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["tinyvllm", "tinyvllm.*"]), "tinyvllm.cuda"],
      package_dir={"tinyvllm.cuda": "cuda"})
