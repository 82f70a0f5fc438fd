import pytest

from hpcdl.comm import cuda_aware


class NoInfoComm:
    def Get_info(self):
        raise NotImplementedError


def test_override_wins_and_is_validated():
    assert cuda_aware.detect(NoInfoComm(), "gpu", {"HPCDL_CUDA_AWARE": "1"}).aware
    assert not cuda_aware.detect(NoInfoComm(), "gpu", {"HPCDL_CUDA_AWARE": "0"}).aware
    with pytest.raises(ValueError, match="HPCDL_CUDA_AWARE must be 0 or 1"):
        cuda_aware.detect(NoInfoComm(), "gpu", {"HPCDL_CUDA_AWARE": "yes"})


def test_cpu_device_never_claims_awareness():
    result = cuda_aware.detect(NoInfoComm(), "cpu", {})
    assert not result.aware and "cpu" in result.reason


def test_site_switch():
    result = cuda_aware.detect(NoInfoComm(), "gpu", {"MPICH_GPU_SUPPORT_ENABLED": "1"})
    assert result.aware and "Cray" in result.reason


def test_queries_the_loaded_open_mpi():
    # The PyPI Open MPI wheel is built without CUDA: MPIX_Query_cuda_support() must say so.
    from mpi4py import MPI

    lib = cuda_aware.loaded_libmpi()
    assert lib is not None and "libmpi" in lib
    result = cuda_aware.detect(MPI.COMM_WORLD, "gpu", {})
    if "Open MPI" in MPI.Get_library_version():
        assert "MPIX_Query_cuda_support" in result.reason
