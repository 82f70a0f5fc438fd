"""hpcdl.torch.Loader in a script that runs under mpirun without torch.distributed: the rank and
world come from MPI (pytest --with-mpi, 2 ranks)."""

import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.data.sampler import DistributedSampler


@pytest.mark.mpi(min_size=2)
def test_rank_and_world_come_from_mpi_and_each_rank_reads_its_shard():
    from mpi4py import MPI

    from hpcdl.torch import Loader

    comm = MPI.COMM_WORLD
    root = comm.bcast(tempfile.mkdtemp(prefix="hpcdl-torch-mpi-") if comm.rank == 0 else None)
    data = Path(root) / "data.h5"
    if comm.rank == 0:
        with h5py.File(data, "w") as f:
            f["images"] = np.zeros((96, 4, 4, 1), np.uint8)
            f["labels"] = np.arange(96) % 10
            f["sample_ids"] = np.arange(96)
    comm.Barrier()
    with Loader(data, 8, epochs=2, workers=1, seed=3, stage_dir=Path(root) / "stage") as loader:
        assert loader.launched_by == "MPI"
        assert (loader.world.rank, loader.world.size) == (comm.rank, comm.size)
        assert len(loader) == 96 // comm.size // 8
        loader.set_epoch(1)
        labels = np.concatenate([y.numpy() for _, y in loader])
    order = DistributedSampler(96, comm.size, comm.rank, seed=3).indices(1)
    assert np.array_equal(labels, order % 10)
    shards = comm.allgather(set(order.tolist()))
    assert not set.intersection(*shards)  # disjoint shards
    comm.Barrier()
    assert not (Path(root) / "stage").exists()
    if comm.rank == 0:
        shutil.rmtree(root)
