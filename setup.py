"""Build and install PocketMoE; the native CPU kernels (cpp_engine/) build as pocketmoe._native."""

import glob
import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext


def read_requirements(path: str) -> list[str]:
    with open(path) as f:
        lines = [ln.split("#")[0].strip() for ln in f]
    return [ln for ln in lines if ln]


def native_extension():
    """pocketmoe._native from cpp_engine/src + cpp_engine/python; None when there are no sources."""
    sources = sorted(glob.glob("cpp_engine/src/*.cpp") + glob.glob("cpp_engine/src/ops/*.cpp")) + sorted(glob.glob("cpp_engine/python/*.cpp"))
    if not sources or os.environ.get("POCKETMOE_NO_NATIVE") == "1":
        return None
    from pybind11.setup_helpers import Pybind11Extension

    # AVX2+FMA is the baseline; wider ISAs are compiled per function and picked at run time.
    return Pybind11Extension(
        "pocketmoe._native",
        sources,
        include_dirs=["cpp_engine/include"],
        depends=sorted(glob.glob("cpp_engine/src/*.h") + glob.glob("cpp_engine/src/*.inc")
                       + glob.glob("cpp_engine/src/ops/*.h") + glob.glob("cpp_engine/include/pocketmoe/*.h")
                       + glob.glob("cpp_engine/python/*.h")),
        cxx_std=17,
        extra_compile_args=["-O3", "-mavx2", "-mfma", "-mf16c", "-mbmi2", "-fno-math-errno", "-pthread"],
        extra_link_args=["-pthread"],
    )


class OptionalBuildExt(build_ext):
    """A failed native build leaves the torch reference path working, and says so."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure
            print(f"warning: native kernels not built ({exc}); the torch reference path will be used",
                  file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"warning: native extension {ext.name} failed to build ({exc})", file=sys.stderr)


ext = native_extension()
install_requires = [r.replace("torch==2.13.0", "torch>=2.4") for r in read_requirements("requirements.txt")]

setup(
    name="pocketmoe",
    version="0.1.0",
    description="Run huge Mixture-of-Experts GGUF models on small GPUs plus host RAM",
    packages=find_packages(include=["pocketmoe", "pocketmoe.*"]),
    package_data={"pocketmoe": ["quant/cuda/*.cu", "data/*", "ops/cuda/src/*.cu", "ops/cuda/src/*.cuh",
                              "ops/cuda/shim/*.h", "ops/cuda/shim/*.cpp"]},
    python_requires=">=3.10",
    install_requires=install_requires,
    extras_require={
        "cuda": ["cupy-cuda12x>=13"],
        "test": read_requirements("requirements-test.txt"),
        "parity": ["llama-cpp-python==0.3.36"],
        "plots": ["matplotlib>=3.7"],  # scripts/demo_model_report.py only
    },
    ext_modules=[ext] if ext is not None else [],
    cmdclass={"build_ext": OptionalBuildExt},
    zip_safe=False,
)
