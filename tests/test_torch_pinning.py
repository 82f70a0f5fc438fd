"""hpcdl.torch.pinning: batches copied into pinned memory in a thread ahead of the script
(NOTE [pinned hand-off], issue 48 item 2), and hpcdl.torch.Loader's default slots."""

from __future__ import annotations

import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hpcdl.data.dataset import DataError
from hpcdl.torch import Loader
from hpcdl.torch.pinning import AHEAD, PinnedAhead

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA in torch")


def pin_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hpcdl-pin-memory"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pinning")
    with h5py.File(d / "part-0.h5", "w") as f:
        f["images"] = np.zeros((96, 8, 8, 3), np.uint8)
        f["labels"] = np.arange(96) % 4
    return d


def test_the_loader_takes_two_slots_per_worker_by_default(shards):
    with Loader(shards, 8, epochs=1, workers=3, handle_signals=False) as loader:
        assert loader.slots == 6 and loader._loader.slots_default
        assert sum(len(y) for _, y in loader) == 96
    with Loader(shards, 8, epochs=1, workers=3, prefetch=2, handle_signals=False) as loader:
        assert loader.slots == 2


def test_an_error_of_the_iteration_reaches_the_script_and_the_thread_ends():
    closed = threading.Event()

    def host():
        try:
            raise DataError("sample 7 of part-0.h5 is unreadable")
            yield  # a generator
        finally:
            closed.set()

    with pytest.raises(DataError, match="sample 7"):
        next(iter(PinnedAhead(host(), torch)))
    assert closed.is_set()
    assert not pin_threads()


@pytest.mark.gpu
@cuda
def test_pinned_batches_are_the_slots_contents_and_outlive_them():
    slot = np.empty((4, 3, 2, 2), np.float32)  # one buffer reused, as a loader slot is
    labels = np.empty(4, np.int64)

    def host():
        for k in range(6):
            slot[:] = k
            labels[:] = k
            yield slot, labels

    got = list(PinnedAhead(host(), torch))
    assert len(got) == 6
    for k, (x, y) in enumerate(got):
        assert x.is_pinned() and y.is_pinned()
        assert torch.all(x == k) and torch.all(y == k)


@pytest.mark.gpu
@cuda
def test_leaving_early_closes_the_iteration_in_its_thread():
    closed = threading.Event()
    made = []

    def host():
        try:
            for k in range(1000):
                made.append(k)
                yield np.full((2, 2), k, np.float32), np.array([k])
        finally:
            closed.set()

    batches = iter(PinnedAhead(host(), torch))
    next(batches)
    batches.close()
    assert closed.is_set() and not pin_threads()
    assert len(made) <= 2 + AHEAD  # the thread ran at most AHEAD batches ahead
