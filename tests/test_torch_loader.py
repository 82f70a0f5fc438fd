"""hpcdl.torch in one process: the batches are hpcdl's loader's as torch tensors over its slots,
torch's DataLoader gets the same ones through HpcdlSampler/HpcdlSamples, bad options end in one
line, staging is started and cleaned up. Jobs of several ranks: tests/test_torch_ddp.py."""

from __future__ import annotations

import gc
import os
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from helpers import children, niceness
from torch.utils.data import DataLoader

from hpcdl.data import Loader as NumpyLoader
from hpcdl.data import open_dataset
from hpcdl.data.sampler import DistributedSampler
from hpcdl.torch import HpcdlSampler, HpcdlSamples, Loader, LoaderStartError

SEED, BATCH, AUG = 5, 32, "crop3+flip"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("torch-loader") / "data"
    d.mkdir()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (400, 12, 12, 3), dtype=np.uint8)
    for k in range(2):
        with h5py.File(d / f"part-{k}.h5", "w") as f:
            f["images"] = x[k * 200 : (k + 1) * 200]
            f["labels"] = np.arange(k * 200, (k + 1) * 200) % 10
    return d


def numpy_batches(data: Path, epoch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """What hpcdl.train's loader yields for this rank (copies)."""
    ds = open_dataset(data)
    order = DistributedSampler(len(ds), seed=SEED).batches(epoch, BATCH)
    with NumpyLoader(ds, BATCH, workers=0, seed=SEED, augment=AUG) as loader:
        return [(x.copy(), y.copy()) for x, y in loader.iterate(order, epoch)]


def test_batches_are_hpcdls_as_tensors_in_the_sampler_order(shards):
    with Loader(shards, BATCH, epochs=2, workers=2, seed=SEED, augment=AUG) as loader:
        assert len(loader) == 400 // BATCH
        assert loader.sample_shape == (3, 12, 12)
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            got = [(x.clone(), y.clone()) for x, y in loader]
            want = numpy_batches(shards, epoch)
            assert len(got) == len(want) == len(loader)
            for (x, y), (wx, wy) in zip(got, want):
                assert x.dtype == torch.float32 and y.dtype == torch.int64
                assert x.shape == (BATCH, 3, 12, 12)
                assert np.array_equal(x.numpy(), wx) and np.array_equal(y.numpy(), wy)
        assert not np.array_equal(numpy_batches(shards, 0)[0][1], want[0][1])  # epochs differ
        with pytest.raises(ValueError, match="outside the loader's epochs 0..1"):
            loader.set_epoch(2)


def test_a_batch_is_its_slot_no_copy_valid_until_the_next_request(shards):
    """NOTE [slot lifetime]: the tensor is the shared-memory slot; once the next batches are
    asked for, the workers write new batches into it."""
    want = numpy_batches(shards, 0)
    with Loader(shards, BATCH, epochs=1, workers=1, prefetch=2, seed=SEED, augment=AUG) as loader:
        batches = iter(loader)
        first, labels = next(batches)
        kept = first.clone()
        assert np.array_equal(kept.numpy(), want[0][0])
        for _ in range(3):  # two slots: batch 2 went into batch 0's slot
            next(batches)
        assert not torch.equal(first, kept)
        assert np.array_equal(kept.numpy(), want[0][0])  # the clone is the way to keep one
        assert np.array_equal(labels.numpy(), want[0][1])  # labels are copied: still right
        del first
        batches.close()


def test_the_workers_go_on_into_the_epoch_the_script_will_ask_for_next(shards):
    """hpcdl.data.pool NOTE [the next epoch]: with set_epoch before each epoch, the last batches
    of one epoch are taken while the workers build the next one's first; without set_epoch the
    same epoch comes again. One TASK and one REPLY per batch built, one READY per worker."""
    n, workers = 400 // BATCH, 2
    with Loader(shards, BATCH, epochs=2, workers=workers, seed=SEED, augment=AUG) as loader:
        loader.set_epoch(0)
        got = [(x.clone(), y.clone()) for x, y in loader]
        assert loader.stats()["control_messages"] > 2 * n + workers  # epoch 1 is under way
        loader.set_epoch(1)
        got += [(x.clone(), y.clone()) for x, y in loader]
        assert loader.stats()["control_messages"] == 2 * 2 * n + workers  # none built twice
    with Loader(shards, BATCH, epochs=2, workers=workers, seed=SEED, augment=AUG) as loader:
        again = [(x.clone(), y.clone()) for _ in range(2) for x, y in loader]
    want = numpy_batches(shards, 0) + numpy_batches(shards, 1)
    for (x, y), (wx, wy) in zip(got + again, want + numpy_batches(shards, 0) * 2, strict=True):
        assert np.array_equal(x.numpy(), wx) and np.array_equal(y.numpy(), wy)


def test_torch_dataloader_in_hpcdls_order_yields_the_same_batches(shards):
    samples = HpcdlSamples(str(shards), AUG, SEED)
    sampler = HpcdlSampler(len(samples), BATCH, rank=0, world_size=1, seed=SEED)
    dataloader = DataLoader(samples, BATCH, sampler=sampler, num_workers=1)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        want = numpy_batches(shards, epoch)
        got = list(dataloader)
        assert len(got) == len(want)
        for (x, y), (wx, wy) in zip(got, want):
            assert np.array_equal(x.numpy(), wx) and np.array_equal(y.numpy(), wy)


def test_a_bad_option_ends_with_one_line_and_starts_nothing(shards, capfd):
    before = children()
    cases = [
        (dict(stage_dir=shards / "stage"), "--stage-dir .* overlaps --data .* inside the data"),
        (dict(batch_size=401), "--batch-size 401 is larger than each rank's shard"),
        (dict(augment="spin"), "augment"),
        (dict(stage_nice=25), "--stage-nice must be auto or 0..19, got '25'"),
        (dict(data=shards / "missing"), "missing"),
    ]
    for options, message in cases:
        kwargs = dict(data=shards, batch_size=BATCH, epochs=1, workers=1) | options
        with pytest.raises(LoaderStartError) as info:
            Loader(**kwargs)
        assert info.value.code == 2
        err = capfd.readouterr().err.splitlines()
        assert len(err) == 1, err
        assert err[0].startswith("hpcdl: rank 0: error: ")
        assert re.search(message, err[0]), err[0]
    assert children() == before
    assert not (shards / "stage").exists()


def test_under_torchrun_before_init_process_group_one_line_says_so(shards, capfd, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # what torchrun sets for its workers
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(LoaderStartError):
        Loader(shards, BATCH, epochs=1, workers=1)
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("hpcdl: rank 0: error: torchrun started"), err
    assert "init_process_group()" in err[0]


@pytest.mark.parametrize("keep", [False, True], ids=["remove", "keep"])
def test_staging_figures_and_clean_up(shards, tmp_path, keep):
    stage = tmp_path / "stage"
    before = children()
    loader = Loader(
        shards, BATCH, epochs=2, workers=1, seed=SEED, stage_dir=stage, keep_staged=keep
    )
    assert len(children() - before) == 2  # the stager and one worker
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
    stats = loader.stats()
    loader.close()
    assert stats["staging"] and stats["stager_alive"]
    assert stats["files_staged"] == 2 and stats["bytes_staged"] > 0
    assert stats["hits"] + stats["misses"] > 0 and stats["bad_samples"] == 0
    assert stats["local_reads"] + stats["pfs_reads"] == 2 * len(loader) * BATCH
    gc.collect()
    assert children() == before
    staged = sorted(p.name for p in stage.rglob("*.h5")) if stage.exists() else []
    assert staged == (["part-0.h5", "part-1.h5"] if keep else [])


def test_stage_nice_reaches_every_thread_of_the_stager(shards, tmp_path):
    """stage_nice is hpcdl.train's --stage-nice: N is every stager thread N steps nicer."""
    with Loader(shards, BATCH, epochs=1, workers=1, stage_dir=tmp_path / "stage",
                stage_nice=4) as loader:  # fmt: skip
        threads = niceness(loader.staging.stager.proc.pid)
    assert threads == {min(19, os.getpriority(os.PRIO_PROCESS, 0) + 4)}, threads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_with_cuda_batches_are_pinned_and_copy_asynchronously(shards):
    want = numpy_batches(shards, 0)
    with Loader(shards, BATCH, epochs=1, workers=1, seed=SEED, augment=AUG) as loader:
        got = []
        for x, y in loader:
            assert x.is_pinned() and y.is_pinned()
            got.append((x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)))
        torch.cuda.synchronize()
    for (x, y), (wx, wy) in zip(got, want):
        assert np.array_equal(x.cpu().numpy(), wx) and np.array_equal(y.cpu().numpy(), wy)
