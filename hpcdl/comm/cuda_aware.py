"""Is the loaded MPI library able to read and write GPU memory directly?

Decision order: the HPCDL_CUDA_AWARE override, then Open MPI's MPIX_Query_cuda_support()
found in the libmpi this process loaded, then the MPI-4.1 info key mpi_memory_alloc_kinds,
then site switches (Cray MPICH, MVAPICH2, Intel MPI). The answer is logged once by the trainer.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CudaAwareness:
    aware: bool
    reason: str


_SITE_SWITCHES = {
    "MPICH_GPU_SUPPORT_ENABLED": "Cray MPICH",
    "MV2_USE_CUDA": "MVAPICH2",
    "I_MPI_OFFLOAD": "Intel MPI",
}


def loaded_libmpi() -> str | None:
    """Path of the libmpi shared object mapped into this process (Linux), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "/libmpi" in path and ".so" in path:
                    return path
    except OSError:
        return None
    return None


def _query_openmpi(libpath: str | None) -> bool | None:
    if libpath is None:
        return None
    try:
        lib = ctypes.CDLL(libpath, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        query = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    return bool(query())


def _query_alloc_kinds(comm) -> bool | None:
    try:
        info = comm.Get_info()
        kinds = info.Get("mpi_memory_alloc_kinds")
        info.Free()
    except Exception:  # MPI < 4.1 or key unsupported
        return None
    if kinds is None:
        return None
    return "cuda" in kinds.lower()


def detect(comm, device: str, environ: dict[str, str] | None = None) -> CudaAwareness:
    """Decide whether gradient buffers on the GPU may be passed to MPI directly."""
    env = os.environ if environ is None else environ
    override = env.get("HPCDL_CUDA_AWARE")
    if override is not None:
        if override not in ("0", "1"):
            raise ValueError(f"HPCDL_CUDA_AWARE must be 0 or 1, got {override!r}")
        return CudaAwareness(override == "1", f"HPCDL_CUDA_AWARE={override}")
    if device == "cpu":
        return CudaAwareness(False, "cpu device: buffers live in host memory")
    for key, name in _SITE_SWITCHES.items():
        if env.get(key) == "1":
            return CudaAwareness(True, f"{key}=1 ({name})")
    openmpi = _query_openmpi(loaded_libmpi())
    if openmpi is not None:
        return CudaAwareness(openmpi, f"MPIX_Query_cuda_support() returned {int(openmpi)}")
    kinds = _query_alloc_kinds(comm)
    if kinds is not None:
        return CudaAwareness(kinds, f"mpi_memory_alloc_kinds {'lists' if kinds else 'lacks'} cuda")
    return CudaAwareness(False, "no sign of CUDA support in the MPI library; staging via host")
