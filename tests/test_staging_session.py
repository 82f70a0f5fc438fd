"""StagingSession with the real hpcdl-stage process: copies, readers, capacity, death, cleanup."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
import warnings

from helpers import make_tree, stage_bytes, start_session, temp_files, wait_until

from hpcdl.staging import status as codes  # its codes on use: collects without a stager
from hpcdl.staging.ownership import data_key
from hpcdl.staging.status import StatusView

ARGS = dict(world_size=1, seed=0, shuffle="global")  # SamplerSpec fields but num_samples


def test_staged_copies_are_byte_identical_and_served_as_hits(tmp_path):
    ds = make_tree(tmp_path / "pfs", 60, 3000)
    stage = tmp_path / "stage"
    session = start_session(ds, stage, verify=True)
    status = StatusView(session.meta / "status")
    wait_until(lambda: status.field("plan_ready") == 60)
    assert oct(stage.stat().st_mode & 0o777) == "0o700"
    locate = pickle.loads(pickle.dumps(session.locator()))
    for fid, entry in enumerate(ds.files):
        path = locate(fid)
        assert path == session.local_root / entry.relpath
        assert path.read_bytes() == (ds.root / entry.relpath).read_bytes()
    stats = session.epoch_stats()
    assert stats["files_staged"] == 60 and stats["hits"] == 60 and stats["misses"] == 0
    assert stats["bytes_staged"] == sum(f.size for f in ds.files) and stats["stager_alive"]
    session.close()
    assert not stage.exists()


def test_locator_counts_hits_from_worker_processes(tmp_path):
    import multiprocessing as mp

    ds = make_tree(tmp_path / "pfs", 10, 100)
    session = start_session(ds, tmp_path / "stage")
    status = StatusView(session.meta / "status")
    wait_until(lambda: status.field("plan_ready") == 10)
    with mp.get_context("spawn").Pool(2) as pool:
        paths = pool.map(session.locator(), range(10))
    assert all(str(p).startswith(str(tmp_path / "stage")) for p in paths)
    assert session.epoch_stats()["hits"] == 10
    session.close()


def test_concurrent_reader_never_sees_a_partial_file(tmp_path, monkeypatch):
    ds = make_tree(tmp_path / "pfs", 12, 400_000)
    monkeypatch.setenv("HPCDL_STAGE_EMULATE_PFS", "latency_ms=1,mbps=40")
    stage = tmp_path / "stage"
    expected = {f.relpath: (ds.root / f.relpath).read_bytes() for f in ds.files}
    bad, checked, stop = [], [0], threading.Event()

    def reader():
        while not stop.is_set():
            for rel, data in expected.items():
                try:
                    got = (stage / data_key(ds.root) / rel).read_bytes()
                except OSError:
                    continue
                checked[0] += 1
                if got != data:
                    bad.append((rel, len(got)))

    t = threading.Thread(target=reader)
    t.start()
    session = start_session(ds, stage)
    status = StatusView(session.meta / "status")
    try:
        wait_until(lambda: status.field("plan_ready") == 12, timeout=60)
    finally:
        stop.set()
        t.join()
        session.close()
    assert not bad and checked[0] > 0


def test_capacity_below_data_size_is_never_exceeded(tmp_path):
    ds = make_tree(tmp_path / "pfs", 80, 10_000)  # ~800 KB
    capacity = 200_000
    stage = tmp_path / "stage"
    session = start_session(ds, stage, batch=4, epochs=(0, 2), capacity=capacity)
    status = StatusView(session.meta / "status")
    peak = 0
    steps = len(ds) // 4
    locate = session.locator()
    for epoch in range(2):
        for step in range(steps):
            with contextlib.suppress(AssertionError):  # pacing only: the checks read what is there
                wait_until(lambda: status.field("plan_ready") > 0, timeout=2)
            on_disk = stage_bytes(stage)
            peak = max(peak, on_disk, status.field("bytes_resident"))
            for fid in range(4):
                locate(fid)
            session.consumed(epoch, step + 1)
            if (epoch, step) == (1, steps // 2):
                # Half of the second epoch read: the files behind the cursor are not read again,
                # so to stage what comes next the stager must evict and copy more than fits.
                wait_until(lambda: status.field("evictions") > 0
                           and status.field("files_staged") > capacity // 10_100, timeout=60,
                           what="the stager evicted and copied past its capacity")  # fmt: skip
    stats = session.epoch_stats()
    session.close()
    assert peak <= capacity, peak
    assert stats["files_staged"] > capacity // 10_100  # it did stage, and evicted to go on
    assert stats["hits"] + stats["misses"] == 2 * steps * 4


def test_sigkill_to_stager_falls_back_with_one_warning_and_no_temp_files(tmp_path, monkeypatch):
    ds = make_tree(tmp_path / "pfs", 200, 50_000)
    monkeypatch.setenv("HPCDL_STAGE_EMULATE_PFS", "latency_ms=5,mbps=20")
    stage = tmp_path / "stage"
    session = start_session(ds, stage, threads=4)
    status = StatusView(session.meta / "status")
    wait_until(lambda: status.field("plan_ready") >= 2)
    os.kill(status.field("pid"), signal.SIGKILL)
    session.stager.proc.wait()
    locate = session.locator()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            session.last_check = 0.0
            session.consumed(0, step + 1)
        stats = session.epoch_stats()
    assert len([w for w in caught if "staging" in str(w.message)]) == 1
    assert not stats["stager_alive"]
    states = status.states()
    for fid, entry in enumerate(ds.files):
        path = locate(fid)
        if states[fid] != codes.READY:
            assert path == ds.root / entry.relpath
    session.close()
    assert temp_files(tmp_path) == []


def test_restart_reuses_intact_staged_files(tmp_path):
    ds = make_tree(tmp_path / "pfs", 30, 1000)
    stage = tmp_path / "stage"
    first = start_session(ds, stage, keep=True)
    status = StatusView(first.meta / "status")
    wait_until(lambda: status.field("plan_ready") == 30)
    first.close()
    (ds.root / ds.files[0].relpath).write_bytes(b"changed")  # its copy is stale now
    ds.files.sizes[0] = 7  # the size it was planned with
    second = start_session(ds, stage, keep=False)
    status = StatusView(second.meta / "status")
    wait_until(lambda: status.field("plan_ready") == 30)
    assert status.field("files_reused") == 29 and status.field("files_staged") == 1
    assert (second.local_root / ds.files[0].relpath).read_bytes() == b"changed"
    second.close()


def test_missing_source_and_symlinked_dir_are_failed_not_fatal(tmp_path, capfd):
    ds = make_tree(tmp_path / "pfs", 8, 100, dirs=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    stage = tmp_path / "stage"
    (stage / data_key(ds.root)).mkdir(parents=True)
    (stage / data_key(ds.root) / "d1").symlink_to(outside)  # a symlinked dir in the tree
    (ds.root / ds.files[0].relpath).unlink()  # unreadable source: gone after planning
    session = start_session(ds, stage)
    status = StatusView(session.meta / "status")
    wait_until(lambda: status.field("plan_ready") + status.field("failures") == 8)
    err = capfd.readouterr().err
    assert "d1" in err and "symlink" in err and "read from the PFS" in err
    assert ds.files[0].relpath in err and "No such file" in err
    states = status.states()
    assert states[0] == codes.FAILED and states[1] == codes.FAILED
    assert list(outside.iterdir()) == []
    assert session.locator()(0) == ds.root / ds.files[0].relpath
    session.close()


def read_epoch(session, ds, epoch, steps, batch=4):
    """Read every file of `epoch` through the locator, step by step, as a loader would."""
    from hpcdl.data.sampler import DistributedSampler

    locate = session.locator()
    sampler = DistributedSampler(rank=0, num_samples=len(ds), **ARGS)
    for step, batch_ids in enumerate(sampler.batches(epoch, batch)[:steps]):
        for fid in ds.file_ids(batch_ids):
            locate(int(fid))
        session.consumed(epoch, step + 1)


def test_a_first_epoch_that_outruns_staging_says_so_once_with_the_rate_needed(
    tmp_path, monkeypatch
):
    ds = make_tree(tmp_path / "pfs", 120, 20_000)
    monkeypatch.setenv("HPCDL_STAGE_EMULATE_PFS", "latency_ms=30,mbps=5")
    session = start_session(ds, tmp_path / "stage", threads=1, epochs=(0, 3))
    steps = len(ds) // 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read_epoch(session, ds, 0, steps)
        read_epoch(session, ds, 1, 2)
    session.close()
    lines = [str(w.message) for w in caught if "outran" in str(w.message)]
    assert len(lines) == 1, [str(w.message) for w in caught]
    assert "files/s" in lines[0] and "MB/s" in lines[0] and "--stage-threads" in lines[0]
    needed = float(lines[0].split("needed ")[1].split(" files/s")[0])
    assert needed > 100  # 120 files read in well under a second


def test_staging_that_keeps_up_says_nothing_about_the_rate(tmp_path):
    ds = make_tree(tmp_path / "pfs", 40, 2000)
    session = start_session(ds, tmp_path / "stage", threads=4, epochs=(0, 2))
    status = StatusView(session.meta / "status")
    wait_until(lambda: status.field("plan_ready") == status.field("plan_entries"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read_epoch(session, ds, 0, len(ds) // 4)
        read_epoch(session, ds, 1, 1)
        assert session.epoch_stats()["misses"] == 0
    session.close()
    assert [str(w.message) for w in caught if "outran" in str(w.message)] == []


def test_a_killed_stagers_temporaries_go_even_when_the_copies_are_kept(tmp_path, monkeypatch):
    ds = make_tree(tmp_path / "pfs", 60, 400_000)
    monkeypatch.setenv("HPCDL_STAGE_EMULATE_PFS", "latency_ms=1,mbps=20")
    session = start_session(ds, tmp_path / "stage", threads=4, keep=True)
    status = StatusView(session.meta / "status")
    wait_until(lambda: status.field("plan_ready") >= 1)
    wait_until(lambda: any(session.meta.glob("tmp.*")), timeout=10)  # copies in flight
    os.kill(status.field("pid"), signal.SIGKILL)
    session.stager.proc.wait()
    assert any(session.meta.glob("tmp.*"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session.close()
    assert temp_files(tmp_path) == []
    assert (session.meta / "status").exists()  # kept for inspection
