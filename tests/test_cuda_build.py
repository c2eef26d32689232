"""The CUDA extension as built on a machine without a GPU (this one, CI): it exists wherever nvcc
does, carries SASS for sm_80 and sm_90 and PTX, stays out of processes that do not ask for it
(test_imports.py), and says plainly why its kernels cannot run. Its arithmetic is the CPU kernels' (test_kernels.py,
test_topk.py, test_fusion.py cover it); tests/gpu/ runs the kernels where a GPU is."""

import glob
import os
import shutil
import subprocess
import sysconfig
from array import array
from pathlib import Path

import pytest
import torch

import ringcomm
import ringcomm.cuda as rc_cuda

CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
NVCC = shutil.which("nvcc") or shutil.which("nvcc", path=str(CUDA_HOME / "bin"))
needs_build = pytest.mark.skipif(
    NVCC is None or os.environ.get("RINGCOMM_CUDA") == "0",
    reason="no nvcc here (or RINGCOMM_CUDA=0): ringcomm._C_cuda is not built",
)


def extension_path():
    return next(Path(ringcomm.__file__).parent.glob("_C_cuda*.so"))


def cuobjdump():
    """The toolkit's, or the one the nvidia-cuda-cuobjdump wheel (test extra) brings."""
    found = shutil.which("cuobjdump") or shutil.which("cuobjdump", path=str(CUDA_HOME / "bin"))
    if found:
        return found
    site = sysconfig.get_paths()["purelib"]
    wheel = sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "cuobjdump")))
    if not wheel:
        pytest.fail("no cuobjdump: install the test extra (nvidia-cuda-cuobjdump)")
    return wheel[-1]


@needs_build
def test_extension_is_built_where_nvcc_is():
    assert rc_cuda.built()
    assert extension_path().exists()


@needs_build
def test_extension_carries_sm80_sm90_and_ptx():
    tool = cuobjdump()
    path = str(extension_path())
    elf = subprocess.run(
        [tool, "--list-elf", path], capture_output=True, text=True, check=True
    ).stdout
    ptx = subprocess.run(
        [tool, "--list-ptx", path], capture_output=True, text=True, check=True
    ).stdout
    # One cubin per kernel file and architecture.
    assert elf.count(".sm_80.cubin") >= 3 and elf.count(".sm_90.cubin") >= 3, elf
    assert ".sm_90.ptx" in ptx, ptx


@needs_build
def test_device_path_kernels_have_sm80_and_sm90_code():
    # The window plans' kernels (kernels/cuda/window.cu): entry points in the cubin of each
    # architecture, not only in the PTX a driver would compile at load.
    out = subprocess.run(
        [cuobjdump(), "-symbols", str(extension_path())], capture_output=True, text=True, check=True
    ).stdout
    entries, arch = {}, None
    for line in out.splitlines():
        if line.startswith("arch = "):
            arch = line.split()[-1]
        elif " ENTRY " in line and arch:
            entries.setdefault(arch, set()).add(line.split()[-1])
    for arch in ("sm_80", "sm_90"):
        for kernel in ("fold_vectors_kernel", "fold_kernel", "copy_kernel", "write_words_kernel"):
            assert any(kernel in e for e in entries.get(arch, ())), (arch, kernel)


def needed(path):
    out = subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def test_extension_links_no_cuda_library_and_no_torch():
    # The CUDA runtime is linked statically; NCCL is loaded at run time; the core (the step lists
    # the NCCL transport runs) is libringcomm, which itself needs neither CUDA nor torch.
    libraries = needed(extension_path())
    assert not [
        lib for lib in libraries if "cuda" in lib or "torch" in lib or "c10" in lib or "nccl" in lib
    ], libraries
    assert "libringcomm.so" in libraries, libraries
    core = needed(extension_path().parent / "libringcomm.so")
    assert not [lib for lib in core if "cuda" in lib or "torch" in lib or "c10" in lib], core


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_kernels_say_why():
    ok, reason = rc_cuda.status()
    assert not ok and reason
    if rc_cuda.built():
        assert "CUDA driver" in reason or "no CUDA device" in reason or "torch" in reason, reason
    with pytest.raises(RuntimeError, match="CUDA kernels cannot run"):
        rc_cuda.topk(torch.randn(10), 1)
    # The CPU path of the same entry point is unaffected.
    values, indices = ringcomm.compress.topk(torch.tensor([1.0, -3.0, 2.0]), 1)
    assert indices.tolist() == [1]


@needs_build
def test_raw_bindings_check_arguments_before_touching_a_device():
    from ringcomm import _C_cuda

    with pytest.raises(ValueError, match="unsupported dtype code"):
        _C_cuda.reduce(42, 0, 0, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="needs an integer"):
        _C_cuda.reduce(0, 5, 0, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="top-k supports"):
        _C_cuda.topk(6, 0, 10, 1, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="larger than the number"):
        _C_cuda.topk(0, 0, 10, 11, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="cannot convert"):
        _C_cuda.pack(6, array("Q", [0]), array("Q", [4]), 0, 4, 0, 0, 0, 1.0, 0)
    with pytest.raises(ValueError, match="addresses must be a contiguous buffer of uint64"):
        _C_cuda.pack(0, array("i", [0]), array("Q", [4]), 0, 4, 0, 0, 0, 1.0, 0)
    with pytest.raises(ValueError, match="differ in length"):
        _C_cuda.unpack(0, 0, 0, array("Q", [0]), array("Q", []), 0, 0, 0, 1.0, 0)
