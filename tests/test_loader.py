"""Loader with worker processes: determinism, order, control traffic, failures, clean shutdown."""

import gc
import os
import pickle
import re
import signal
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import children, wait_until
from loader_hooks import SlowLocate

from hpcdl.data import DataError, Loader, open_dataset
from hpcdl.data.pool import LoaderTimeout, WorkerDied
from hpcdl.data.sampler import DistributedSampler
from hpcdl.data.slots import PAGE, REPLY, TASK, SharedMemoryTooSmall, SlotLayout


@pytest.fixture(scope="module")
def h5data(tmp_path_factory):
    d = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (600, 12, 12, 3), dtype=np.uint8)
    for k in range(3):
        with h5py.File(d / f"part-{k}.h5", "w") as f:
            f["images"] = x[k * 200 : (k + 1) * 200]
            f["labels"] = np.arange(k * 200, (k + 1) * 200) % 10
    return open_dataset(d)


def shm_in_use() -> list[str]:
    gc.collect()
    names = [n for n in os.listdir("/dev/shm") if n.startswith(f"hpcdl-loader-{os.getpid()}-")]
    maps = Path("/proc/self/maps").read_text()
    return names + [line for line in maps.splitlines() if "hpcdl-loader" in line]


def epoch_batches(ds, epoch=0, batch=32, **kw):
    return DistributedSampler(len(ds), seed=5, **kw).batches(epoch, batch)


def run(ds, workers, augment="crop3+flip", epochs=(0, 1), **kw):
    out = []
    with Loader(ds, 32, workers=workers, seed=11, augment=augment, **kw) as loader:
        for e in epochs:
            out += [(x.copy(), y.copy()) for x, y in loader.iterate(epoch_batches(ds, e), e)]
        stats = loader.stats()
    return out, stats


def test_batches_are_bitwise_identical_for_0_1_and_3_workers(h5data):
    ref, _ = run(h5data, 0)
    assert len(ref) == 2 * (600 // 32)
    assert not np.array_equal(ref[0][0], ref[len(ref) // 2][0])  # epochs differ
    for k in (1, 3):
        got, stats = run(h5data, k)
        assert all(
            np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
            for a, b in zip(ref, got, strict=True)
        )
        assert stats["pfs_reads"] == 32 * len(ref)


def slow_workers(monkeypatch, ds, max_s):
    """A locate hook that delays each read by up to max_s; the workers can import it."""
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [tests, os.getenv("PYTHONPATH")]))
    )
    return SlowLocate(ds, max_s)


def test_order_is_kept_under_random_worker_delays(h5data, monkeypatch):
    locate = slow_workers(monkeypatch, h5data, 0.03)
    ref, _ = run(h5data, 0, augment="rrc10+flip", epochs=(2,))
    got, _ = run(h5data, 3, augment="rrc10+flip", epochs=(2,), locate=locate)
    for (xa, ya), (xb, yb) in zip(ref, got, strict=True):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)


def test_control_channel_carries_only_fixed_size_messages(h5data):
    got, stats = run(h5data, 2, epochs=(0,))
    # per batch one TASK and one REPLY, plus one READY per worker at start: no arrays
    assert stats["control_messages"] == 2 * len(got) + 2
    assert stats["control_bytes"] == len(got) * (TASK.size + REPLY.size) + 2 * REPLY.size
    assert TASK.size == REPLY.size == 32
    assert 32 * 12 * 12 * 3 * 4 > 100 * stats["control_bytes"] / len(got)


def test_early_exit_keeps_the_loader_usable_and_results_unchanged(h5data):
    ref, _ = run(h5data, 0, epochs=(1,))
    with Loader(h5data, 32, workers=2, prefetch=3, seed=11, augment="crop3+flip") as loader:
        for i, _ in enumerate(loader.iterate(epoch_batches(h5data, 0), 0)):
            if i == 2:
                break
        got = [(x.copy(), y.copy()) for x, y in loader.iterate(epoch_batches(h5data, 1), 1)]
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(ref, got, strict=True))


def test_partial_validation_batches(h5data):
    idx = np.arange(0, 600, 7)
    batches = [idx[i : i + 32] for i in range(0, len(idx), 32)]
    with Loader(h5data, 32, workers=2, augment="crop3+flip") as loader:
        got = [(x.shape, y.copy()) for x, y in loader.iterate(batches, 0, train=False)]
    assert [s[0] for s, _ in got] == [32, 32, len(idx) - 64]
    np.testing.assert_array_equal(np.concatenate([y for _, y in got]), idx % 10)


def test_killed_worker_raises_within_seconds_and_leaves_nothing_behind(h5data, monkeypatch):
    locate = slow_workers(monkeypatch, h5data, 0.05)
    before = children()
    loader = Loader(h5data, 32, workers=2, prefetch=4, seed=1, locate=locate)
    pids = loader.worker_pids
    assert set(pids) <= children()
    it = loader.iterate(epoch_batches(h5data), 0)
    next(it)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    died = rf"loader worker pid {pids[1]} died \(killed by SIGKILL\) while building batch"
    with pytest.raises(WorkerDied, match=died):
        for _ in it:
            pass
    assert time.monotonic() - t0 < 10
    loader.close()
    assert children() == before
    assert shm_in_use() == []


def test_a_worker_that_died_idle_is_named_with_the_batch_it_was_being_given(h5data):
    """A worker killed while it had nothing to build is found dead when the next batch is sent
    to it: the line names that batch (it failed run 5 beside two CPU burners, where a worker
    had finished its batches before the test's kill, as "while idle")."""
    with Loader(h5data, 32, workers=2, prefetch=2, seed=1) as loader:
        pid = loader.worker_pids[1]
        assert pid in children()
        os.kill(pid, signal.SIGKILL)
        # children() leaves out zombies: exited, its socket closed, not yet reaped by the pool
        wait_until(lambda: pid not in children(), 10, "the killed worker to exit")
        died = rf"loader worker pid {pid} died \(killed by SIGKILL\) while building batch 1 of"
        with pytest.raises(WorkerDied, match=died):
            list(loader.iterate(epoch_batches(h5data), 0))


def test_exception_in_the_training_loop_shuts_everything_down(h5data):
    before = children()
    with pytest.raises(KeyboardInterrupt):
        with Loader(h5data, 32, workers=2) as loader:
            for _ in loader.iterate(epoch_batches(h5data), 0):
                raise KeyboardInterrupt
    assert children() == before
    assert shm_in_use() == []


def test_data_error_in_a_worker_is_raised_in_the_trainer(h5data, tmp_path):
    ds = open_dataset(h5data.root)
    ds.source = tmp_path / "gone"  # workers cannot open it
    with pytest.raises(DataError, match="gone: no such file"):
        with Loader(ds, 32, workers=1) as loader:
            list(loader.iterate(epoch_batches(ds), 0))


def test_slot_layout_is_page_aligned_and_travels_to_workers_unchanged():
    layout = SlotLayout(4, 5, [3, 8, 8])  # indices | labels | images, each slot page-aligned
    assert layout.shape == (3, 8, 8) and layout.labels_offset == 40
    assert layout.images_offset == 128  # 16 * 5 rounded up to 64
    assert layout.slot_bytes == -(-(128 + 5 * 3 * 8 * 8 * 4) // PAGE) * PAGE
    assert layout.total_bytes == 4 * layout.slot_bytes and layout.slot_bytes % PAGE == 0
    assert pickle.loads(pickle.dumps(layout)) == layout


def test_too_small_dev_shm_is_a_clear_error(h5data, monkeypatch):
    import hpcdl.data.slots as slots

    monkeypatch.setattr(slots, "free_bytes", lambda path: 1 << 20)
    with pytest.raises(
        SharedMemoryTooSmall,
        match=r"needs 3\.\d MiB of shared memory in "
        r"/dev/shm \(4 slots x 0\.\d MiB\) but only 1\.0 MiB are free.*--shm-size",
    ):
        Loader(h5data, 512, workers=1, prefetch=4)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_trainer_rss_does_not_grow_across_epochs(h5data):
    with Loader(h5data, 32, workers=2, augment="crop3+flip") as loader:
        sizes = []
        for e in range(8):
            for x, _ in loader.iterate(epoch_batches(h5data, e), e):
                float(x.sum())
            gc.collect()
            sizes.append(rss_bytes())
    assert sizes[-1] - sizes[1] < 8 << 20, sizes


# --- faults: a stalled worker, a stop request while waiting, a shard that shrinks -------------


def test_stalled_worker_warns_then_raises_loader_timeout_and_leaves_nothing(h5data, capfd):
    before = children()
    loader = Loader(h5data, 32, workers=2, prefetch=4, seed=1, timeout_s=10)
    stalled = loader.worker_pids[1]
    it = loader.iterate(epoch_batches(h5data), 0)
    next(it)
    os.kill(stalled, signal.SIGSTOP)
    try:
        silent = rf"loader worker pid {stalled} has not answered for \d+ s while building batch"
        with pytest.raises(LoaderTimeout, match=silent + r".*--loader-timeout"):
            for _ in it:
                pass
        # the warning at half the timeout: one line as hpcdl prints its messages, not Python's
        # warnings format with a source path and a line of code under it
        err = capfd.readouterr().err.splitlines()
        assert len(err) == 1, err
        assert re.fullmatch(
            r"hpcdl: rank 0: warning: " + silent + r".*stopped.*--loader-timeout\)", err[0]
        ), err[0]
        loader.close()
        assert children() == before
        assert shm_in_use() == []
    finally:
        if stalled in children():
            os.kill(stalled, signal.SIGKILL)


def test_stop_request_while_waiting_builds_the_rest_in_process_bitwise_equal(h5data):
    ref, _ = run(h5data, 0, epochs=(0,))
    before = children()
    stop = [False]
    with Loader(h5data, 32, workers=1, prefetch=3, seed=11, augment="crop3+flip") as loader:
        stalled = loader.worker_pids[0]
        it = loader.iterate(epoch_batches(h5data, 0), 0, stop_requested=lambda: stop[0])
        got = [tuple(a.copy() for a in next(it))]
        os.kill(stalled, signal.SIGSTOP)
        stop[0] = True  # a SIGTERM caught while the trainer waits on the stopped worker
        try:
            got += [(x.copy(), y.copy()) for x, y in it]
        finally:
            if stalled in children():
                os.kill(stalled, signal.SIGKILL)
        assert children() == before  # the pool was closed: nothing waits on the stalled worker
        assert loader.stats()["pfs_reads"] == 32 * len(ref)
    for (xa, ya), (xb, yb) in zip(ref, got, strict=True):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)


def test_workers_leave_stop_signals_to_the_training_process(h5data):
    ref, _ = run(h5data, 0, epochs=(0,))
    with Loader(h5data, 32, workers=2, seed=11, augment="crop3+flip") as loader:
        it = loader.iterate(epoch_batches(h5data, 0), 0)
        got = [tuple(a.copy() for a in next(it)) for _ in range(2)]  # one from each worker
        for pid, sig in zip(loader.worker_pids, (signal.SIGTERM, signal.SIGUSR1)):
            os.kill(pid, sig)  # Slurm's time limit signals every process of the job step
        got += [(x.copy(), y.copy()) for x, y in it]
    for (xa, ya), (xb, yb) in zip(ref, got, strict=True):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)


TRUNCATE_SCRIPT = """
import os, sys
import numpy as np
from hpcdl.data import DataError, Loader, open_dataset
from hpcdl.data.sampler import DistributedSampler

root, workers = sys.argv[1], int(sys.argv[2])
ds = open_dataset(root)
batches = DistributedSampler(len(ds), seed=5).batches(0, 32)
with Loader(ds, 32, workers=workers, prefetch=2) as loader:
    it = loader.iterate(batches, 0)
    next(it)
    os.truncate(os.path.join(root, "part-1.h5"), 4096)
    try:
        for _ in it:
            pass
    except DataError as exc:
        print(exc)
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_shard_truncated_under_a_reader_is_a_data_error_naming_the_file(h5data, workers, tmp_path):
    import shutil
    import subprocess
    import sys

    root = tmp_path / "shards"
    shutil.copytree(h5data.root, root)
    proc = subprocess.run(
        [sys.executable, "-c", TRUNCATE_SCRIPT, str(root), str(workers)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # not -SIGBUS
    assert f"in {root / 'part-1.h5'} cannot be read" in proc.stdout, proc.stdout + proc.stderr
    assert "was truncated or changed" in proc.stdout
