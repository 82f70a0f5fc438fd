"""The cluster model's step beyond compute and allreduce: what a step waits for its batch
(--workers) and what the stager's copies cost the steps meanwhile, as `bench calibrate`
measures them on the job's data and the dry run predicts them."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import contention_from_note, stage_cli

from hpcdl.bench import synthetic
from hpcdl.clustermodel import calibration, equations
from hpcdl.clustermodel.calibration import (
    Calibration,
    ComputeFigures,
    LocalFigures,
    NetworkFigures,
    PfsFigures,
)
from hpcdl.clustermodel.equations import JobShape

REPO = Path(__file__).resolve().parents[1]
CAL = Calibration(  # a step of about 20 ms at batch 8, no input figure
    pfs=PfsFigures(open_latency_s=0.01, thread_bandwidth_Bps=1e8),
    local=LocalFigures(write_bandwidth_Bps=1e9),
    network=NetworkFigures(1e-5, 1e-9, 1e-4, 1e-8, "hierarchical"),
    compute=ComputeFigures(
        "mlp", 8, v0=800.0, t=0.01, backward_fraction=0.5, gradient_bytes=4_000_000
    ),  # fmt: skip
)
PER_SAMPLE = 2e-3  # seconds: a slow decode, so that workers can fall behind a short step
WITH_INPUT = replace(CAL, compute=replace(CAL.compute, input_s_per_sample=PER_SAMPLE))


def test_a_rank_that_builds_its_batch_waits_for_all_of_it_and_workers_hide_it():
    shape = JobShape(nodes=2, ranks_per_node=2, batch_size=8, epochs=1)
    without = equations.step_time(CAL, replace(shape, workers=0))
    assert without.input_s == 0.0  # no input figure (an older file): nothing charged
    alone = equations.step_time(WITH_INPUT, replace(shape, workers=0))
    assert alone.input_s == pytest.approx(8 * PER_SAMPLE)
    assert alone.step_s == pytest.approx(without.step_s + 8 * PER_SAMPLE)
    # one worker builds a batch (16 ms) while the rank computes (over 20 ms): no wait
    assert without.step_s > 8 * PER_SAMPLE
    assert equations.step_time(WITH_INPUT, replace(shape, workers=1)).step_s == without.step_s
    # a decode slower than the step: one worker sets the pace, and more workers share it
    slow = replace(CAL, compute=replace(CAL.compute, input_s_per_sample=0.02))
    one = equations.step_time(slow, replace(shape, workers=1))
    assert one.step_s == pytest.approx(8 * 0.02)
    four = equations.step_time(slow, replace(shape, workers=4))
    assert four.step_s == pytest.approx(max(without.step_s, 8 * 0.02 / 4))


def test_a_calibration_file_without_the_step_figures_loads_with_none(tmp_path):
    path = tmp_path / "old.toml"
    text = CAL.to_toml()
    for line in ("input_s_per_sample = 0.0\n", "contention_s_per_file = 0.0\n"):
        assert line in text
        text = text.replace(line, "")
    path.write_text(text)
    assert "contention_s_per_fetch" not in text  # None: not written
    old = calibration.load(path).compute
    assert old.input_s_per_sample == 0.0 and old.contention_s_per_file == 0.0
    both = replace(WITH_INPUT, compute=replace(WITH_INPUT.compute, contention_s_per_file=1e-3))
    calibration.save(path, both)
    assert calibration.load(path) == both
    assert both.compute.contention_s_per_fetch is None
    assert both.compute.fetch_contention_s() == 1e-3  # a fetch not measured costs a copy's
    fetched = replace(both, compute=replace(both.compute, contention_s_per_fetch=0.0))
    calibration.save(path, fetched)
    assert "contention_s_per_fetch = 0.0" in path.read_text()
    assert calibration.load(path).compute.fetch_contention_s() == 0.0  # measured as free
    path.write_text(
        path.read_text().replace("contention_s_per_fetch = 0.0", "contention_s_per_fetch = -1.0")
    )
    with pytest.raises(calibration.CalibrationError, match="contention_s_per_fetch must be >= 0"):
        calibration.load(path)


def reads(new: tuple[int, ...], steps: int = 30) -> equations.NodeReads:
    """A node that first reads `new` files in each epoch, epoch 1's spread over its steps."""
    first = np.linspace(new[0] / steps, new[0], steps).astype(np.int64)
    return equations.NodeReads(new, tuple(1000 * n for n in new), first, steps, "plan")


def test_the_copies_of_each_epoch_slow_the_steps_that_run_beside_them():
    c = 2e-3
    cal = replace(CAL, compute=replace(CAL.compute, contention_s_per_file=c))
    shape = JobShape(nodes=4, ranks_per_node=1, batch_size=8, epochs=4)
    step = equations.step_time(CAL, shape).step_s
    node = reads((240, 180, 135, 101))  # a global shuffle's new files per epoch
    # every epoch the stager copies the next epoch's new files from the PFS, epoch 1 its own too
    quiet = equations.predict_shape(CAL, shape, node).epoch_s
    slowed = equations.predict_shape(cal, shape, node).epoch_s
    assert quiet[1:] == [pytest.approx(30 * step)] * 3  # fast staging: the steps set the epoch
    assert quiet[0] < 30 * step + 0.05  # its first step waits for its first files only
    assert slowed == [  # the copies' cost is above that wait
        pytest.approx(30 * step + c * (240 + 180)), pytest.approx(30 * step + c * 135),
        pytest.approx(30 * step + c * 101), pytest.approx(30 * step)  # the last: no copies
    ]  # fmt: skip
    # with peers, later epochs' files are fetches: charged as copies where no fetch figure
    # was measured, else at theirs (f); epoch 1 copies its own files from the PFS
    peered = equations.predict_shape(cal, shape, node, pfs_shares=[1.0, 0.0, 0.0, 0.0]).epoch_s
    assert peered == slowed
    f = 5e-4
    fetching = replace(cal, compute=replace(cal.compute, contention_s_per_fetch=f))
    fetched = equations.predict_shape(fetching, shape, node, pfs_shares=[1.0, 0.0, 0.0, 0.0])
    assert fetched.epoch_s == [
        pytest.approx(30 * step + c * 240 + f * 180), pytest.approx(30 * step + f * 135),
        pytest.approx(30 * step + f * 101), pytest.approx(30 * step)
    ]  # fmt: skip
    # a node shuffle copies in epoch 1 only
    alone = equations.predict_shape(cal, shape, reads((240, 0, 0, 0))).epoch_s
    assert alone == [pytest.approx(30 * step + c * 240), *[pytest.approx(30 * step)] * 3]
    # an epoch that waits for slow staging anyway is not made longer by it
    slow_pfs = replace(cal, pfs=replace(cal.pfs, open_latency_s=5.0))
    waiting = equations.predict_shape(slow_pfs, shape, node)
    quiet_waiting = equations.predict_shape(replace(CAL, pfs=slow_pfs.pfs), shape, node)
    assert waiting.epoch_s == quiet_waiting.epoch_s
    assert waiting.epoch1_input_bound_s > 0


def dry_run(cal_path: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    return stage_cli("--dry-run", "--data", str(data), "--files-only", "--calibration",
                     str(cal_path), "--nodes", "2", "--ranks-per-node", "2", "--batch-size", "8",
                     "--epochs", "2", "--json", *extra, cwd=REPO)  # fmt: skip


def test_the_dry_run_charges_the_input_to_the_jobs_workers(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(64):
        (data / f"f{i:02d}").write_bytes(b"x" * 100)
    path = tmp_path / "c.toml"
    calibration.save(path, WITH_INPUT)

    def row(*extra: str) -> dict:
        proc = dry_run(path, data, *extra)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.splitlines()[-1])["predictions"][0]

    inline, workers = row("--workers", "0"), row("--workers", "2")
    assert inline["input_wait_s"] == pytest.approx(8 * PER_SAMPLE)
    assert workers["input_wait_s"] == 0.0
    assert inline["step_s"] == pytest.approx(workers["step_s"] + 8 * PER_SAMPLE)
    later = inline["epoch_s"][1] - workers["epoch_s"][1]
    assert later == pytest.approx(inline["steps_per_epoch"] * 8 * PER_SAMPLE)
    proc = dry_run(path, data, "--workers", "-1")
    assert proc.returncode == 2 and "--workers must be 0 or more" in proc.stderr


class Landed:
    """The copies beside the timed steps as _timed_copies sees them: `count` landed here."""

    failed = ""

    def __init__(self, count: int):
        self.count = count

    def landed(self) -> int:
        return self.count

    def close(self) -> None:
        pass


@pytest.mark.mpi(min_size=2)
def test_the_contention_note_shows_the_numbers_its_figure_comes_from():
    """Every rank a node of its own, the first seeing 1 fetch land, the second 2: the figure is
    over 1.5 fetches per node, and the note must say so (it said "2", so the figure recomputed
    from the note was a quarter off when few fetches landed, as under load)."""
    from mpi4py import MPI  # noqa: PLC0415

    from hpcdl.bench.calibrate_contention import Window, _timed_copies  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    world = SimpleNamespace(comm=comm, num_nodes=comm.Get_size())
    steps = [0.030] * 10  # 30 ms each beside the fetches, 20 ms quiet

    def timed(beside) -> Window:
        return Window(steps, 0.0, 1.0)

    figure, note = _timed_copies(world, 0.020, timed, Landed(comm.rank + 1), "fetches")
    recomputed, shown = contention_from_note(note, "fetches")
    assert figure == pytest.approx(recomputed, abs=shown), note


# calibrate()'s --steps. Its steps take about a millisecond here: 30 of them, so that the
# copier's start (a process, its plan, its threads) fits in the window of steps beside it.
STEPS = 30


def calibrate(data: Path, stage_dir: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpcdl.bench", "calibrate", "--data", str(data), "--stage-dir",
           str(stage_dir), "--threads", "1", "--files", "4", "--local-mb", "1",
           "--steps", str(STEPS), "--batch-size", "4", "--input-shape", "3,16,16",
           "--classes", "4", "--repeats", "1", "--out", str(out)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)


def listing(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in root.rglob("*"))  # fmt: skip


def test_bench_calibrate_times_batches_of_node_local_copies_of_the_data(tmp_path):
    data = synthetic.class_colour_folder(tmp_path / "images", 24, side=16, classes=4)
    before = listing(data)
    stage_dir = tmp_path / "local" / "stage"  # missing: made as training makes it, removed
    proc = calibrate(data, stage_dir, tmp_path / "c.toml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    figure = calibration.load(tmp_path / "c.toml").compute.input_s_per_sample
    assert 0 < figure < 1.0, proc.stdout
    line = next(line for line in proc.stdout.splitlines() if line.strip().startswith("input"))
    assert f"{figure * 1e3:.3f} ms per sample (16 samples of --data" in line, line
    line = next(line for line in proc.stdout.splitlines() if "trainer step" in line)
    found = re.search(r": ([\d.]+) ms \(the median of quiet windows of ([\d.]+), ([\d.]+), "
                      r"([\d.]+) ms\)", line)  # fmt: skip
    assert found, line  # three windows, one after the other: the middle one is the step
    assert float(found[1]) == sorted(float(found[k]) for k in (2, 3, 4))[1], line
    assert not (tmp_path / "local").exists()  # the copies and the dirs made for them are gone
    assert listing(data) == before  # the data set is only read


def test_bench_calibrate_times_the_steps_while_a_stager_copies_the_data(tmp_path):
    data = synthetic.class_colour_folder(tmp_path / "images", 200, side=16, classes=4)
    before = listing(data)
    stage_dir = tmp_path / "stage"
    stage_dir.mkdir()
    proc = calibrate(data, stage_dir, tmp_path / "c.toml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    figure = calibration.load(tmp_path / "c.toml").compute.contention_s_per_file
    line = next(line for line in proc.stdout.splitlines() if "contention:" in line)
    # one stager (one node) copied files of --data while the steps ran
    recomputed, shown = contention_from_note(line, "copies", most=200)
    assert figure == pytest.approx(recomputed, abs=shown), line
    assert list(stage_dir.iterdir()) == []  # the copier's directory and manifest are gone
    assert listing(data) == before
    # one node: no peer to fetch from, so a fetch is charged a copy's figure
    assert calibration.load(tmp_path / "c.toml").compute.contention_s_per_fetch is None
    assert ("contention: training loses per peer fetch what a copy costs (per fetch not "
            "measured: one node has no peer)") in proc.stdout, proc.stdout  # fmt: skip


def test_calibrates_trainer_step_runs_in_the_trainers_stop_agreement():
    """bench calibrate times hpcdl.train's step with the stop agreement every step of the
    trainer runs in (a nonblocking allreduce across the step). A stop signal caught while the
    steps run ends them at that step, and is then delivered as it would have been without."""
    from mpi4py import MPI  # noqa: PLC0415

    from hpcdl.bench.calibrate import measure_trainer_step  # noqa: PLC0415
    from hpcdl.comm.world import build_world  # noqa: PLC0415

    caught: list[int] = []
    builds = 0

    def build() -> None:
        nonlocal builds
        builds += 1
        if builds == 6:  # the third timed step of the first window
            signal.raise_signal(signal.SIGUSR1)

    args = SimpleNamespace(model="mlp", shape=(1, 8, 8), classes=4, batch_size=4, bucket_mb=25.0,
                           steps=20)  # fmt: skip
    world = build_world(MPI.COMM_SELF)
    previous = signal.signal(signal.SIGUSR1, lambda signum, _: caught.append(signum))
    try:
        step = measure_trainer_step(args, world, SimpleNamespace(build=build))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    # The agreement saw the signal at the step it came in: the steps ended there, not after the
    # 3 windows of 20 + 3 steps, and the stop came once the measurement had let go of it.
    assert builds == 6
    assert caught == [signal.SIGUSR1]  # delivered once, to the handler the caller had
    assert step.step_s > 0


def test_bench_calibrate_says_why_the_input_was_not_timed(tmp_path):
    flat = tmp_path / "flat"  # files without class folders: not a data set hpcdl.train reads
    flat.mkdir()
    for i in range(8):
        (flat / f"f{i}").write_bytes(np.arange(64, dtype=np.uint8).tobytes())
    stage_dir = tmp_path / "stage"
    stage_dir.mkdir()
    proc = calibrate(flat, stage_dir, tmp_path / "c.toml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert calibration.load(tmp_path / "c.toml").compute.input_s_per_sample == 0.0
    assert f"input (the rank builds its batch, --workers 0): not measured: --data {flat}" in (
        proc.stdout
    )
    assert list(stage_dir.iterdir()) == []


def test_the_peer_staging_table_sets_each_round_against_its_own_calibration():
    from tools.bench.peer_staging import table  # noqa: PLC0415

    def job(measured: list[float], model: list[float], fetch: float | None = None,
            **more: float) -> dict:  # fmt: skip
        step = dict(step_s=model[1] / 30, input_s_per_sample=1e-4, contention_s_per_file=2e-3,
                    contention_s_per_fetch=fetch, **more)  # fmt: skip
        return dict(epochs_s=measured, model_epochs_s=model, model_step=step,
                    data_wait_s=[0.1, 0.1], stager_pfs_opens=8, peer_files=0, misses=0,
                    fs_opens=8)  # fmt: skip

    # round 0 measured 2 s against a model of 1 s (+100 %), round 1 3 s against 3 s (0 %)
    # (a round recorded before the checkpoint figure has none: 0)
    rounds = [job([2.0, 2.0], [1.0, 1.0]),
              job([3.0, 3.0], [3.0, 3.0], fetch=1e-3, checkpoint_s=0.06)]  # fmt: skip
    result = dict(setup=dict(files=8), global_params_bitwise_equal=True,
                  jobs={name: dict(rounds=rounds) for name in
                        ("node", "global, no peers", "global, peers")})  # fmt: skip
    rows = table(result).splitlines()
    node = next(r for r in rows if r.startswith("| node |"))
    # medians: measured 2.5, model 2.0, and the rounds' own errors +100 % and 0 %: +50 %
    assert "| 2.50 (model 2.00, +50%) | 2.50 (model 2.00, +50%) |" in node, node
    assert ("model per round (its calibration): step ms 33.3, 100.0; input ms/sample 0.10, "
            "0.10; contention ms per copy 2.00, 2.00; per fetch -, 1.00; checkpoint ms 0, 60"
            ) in rows, rows  # fmt: skip


def test_calibrate_times_the_trainers_checkpoint_and_leaves_the_directory_as_it_was(
    tmp_path, monkeypatch
):
    """bench calibrate --checkpoint-dir: rank 0 saves the checkpoint hpcdl.train would save of
    this model (parameters, buffers, SGD momentum) with hpcdl.checkpoint.save, a few times, in
    a temporary directory inside the given one, and keeps the median. Nothing else there is
    touched; a directory that did not exist is made and removed again."""
    from contextlib import ExitStack

    from mpi4py import MPI

    from hpcdl import checkpoint
    from hpcdl.bench.calibrate_checkpoint import measure_checkpoint
    from hpcdl.bench.calibrate_step import random_batch, step_engine
    from hpcdl.comm.world import build_world

    spec = SimpleNamespace(model="mlp", shape=(3, 32, 32), classes=4, batch_size=2, bucket_mb=25.0)
    engine = step_engine(spec, build_world(MPI.COMM_SELF), ExitStack())
    batch = random_batch(engine, spec.shape, spec.classes, 2)

    saved = []
    real_save = checkpoint.save

    def spy(directory, ckpt, keep=2):
        path = real_save(directory, ckpt, keep)
        saved.append((path.stat().st_size, ckpt.params.size, sorted(ckpt.optimizer)))
        return path

    monkeypatch.setattr(checkpoint, "save", spy)
    user = tmp_path / "ckpts"
    user.mkdir()
    (user / "mine").write_text("a user's file")
    seconds, note = measure_checkpoint(engine, batch, user)
    assert 0 < seconds < 30 and "MB" in note
    assert len(saved) >= 3
    size, params, state = saved[0]
    assert params > 0 and state  # the momentum is there, as after a step
    assert size > 2 * 4 * params  # float32 parameters and as many momentum values
    assert sorted(p.name for p in user.iterdir()) == ["mine"]
    assert (user / "mine").read_text() == "a user's file"
    assert measure_checkpoint(engine, batch, tmp_path / "new" / "dir")[0] > 0
    assert not (tmp_path / "new").exists()
