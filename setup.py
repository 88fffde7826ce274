"""Build kt_ops: setuptools drives CMake to build the one extension, kt_ops._C.

The build uses the PyTorch that is already installed (build with
``pip install --no-build-isolation``); it never asks pip for another torch.
CMake takes torch's headers and libraries from that installed torch
(cmake/torch.cmake), CPU or CUDA build alike; no CUDA toolkit is needed.
The extension carries every ISA path (ref, AVX2, AVX-512) and picks one at run
time, so a wheel (``pip wheel --no-build-isolation .``) runs on any x86-64 CPU.
Environment knobs: ``KT_OPS_BUILD_TYPE`` (Release), ``KT_OPS_BUILD_JOBS``
(number of cores), ``CMAKE_ARGS`` (extra arguments for the configure step).
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        try:
            import pybind11
            import torch
        except ImportError as e:  # pragma: no cover - build-time message
            raise RuntimeError(
                "kt_ops builds against the installed torch and pybind11: install them "
                "first (pip install torch pybind11) and build with --no-build-isolation"
            ) from e
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # One CMake build dir per torch version: switching torch must rebuild everything.
        torch_tag = torch.__version__.replace("+", "-")
        build_dir = Path(self.build_temp).resolve() / f"cmake-torch{torch_tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        prefix = pybind11.get_cmake_dir()
        cfg = os.environ.get("KT_OPS_BUILD_TYPE", "Release")
        args = [
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_PREFIX_PATH={prefix}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
        ]
        args += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        try:
            import ninja  # noqa: F401

            args += ["-GNinja"]
        except ImportError:
            pass
        jobs = os.environ.get("KT_OPS_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--config", cfg, "-j", jobs], check=True
        )


setup(
    ext_modules=[CMakeExtension("kt_ops._C")],
    cmdclass={"build_ext": CMakeBuild},
)
