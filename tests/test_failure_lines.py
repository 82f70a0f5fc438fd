"""One line per failure (issue 19): real `mpirun -np 2 python -m hpcdl.train` runs on real files.

At start-up a bad input is one `hpcdl.train: error: ...` line from one rank and exit status 2.
Mid-run the failing rank prints its one line (a user error) or its one traceback (a bug); every
other rank prints at most `hpcdl: rank R: stopped because rank N failed`, never a traceback or a
guessed cause of its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import mpi_env, run_train, train_cmd

from hpcdl import checkpoint

TIMEOUT_S = 180  # a hang is a failed test (subprocess.TimeoutExpired)
COMMON = ["--model", "mlp", "--batch-size", 16, "--workers", 0, "--seed", 1, "--quiet"]


def hpcdl_lines(output: str) -> list[str]:
    """hpcdl's own lines, not mpirun's framed reports or PMIx noise. Taken from the whole output
    and stripped: under load mpirun may forward a rank's line inside or right after its own
    report, which own_lines would drop."""
    return [line.strip() for line in output.splitlines() if line.strip().startswith("hpcdl")]


def assert_one_startup_line(proc, *fragments: str) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    lines = hpcdl_lines(output)
    assert len(lines) == 1, output
    assert lines[0].startswith("hpcdl.train: error: "), output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# --- resuming a checkpoint that cannot be used -----------------------------------------------


@pytest.fixture(scope="module")
def good_checkpoint(digits_dir, tmp_path_factory) -> Path:
    """A checkpoint written by a real one-epoch run of two ranks (SGD)."""
    ckpt_dir = tmp_path_factory.mktemp("good")
    proc = run_train(
        2, "--data", digits_dir / "train", *COMMON, "--epochs", 1, "--checkpoint-dir", ckpt_dir
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return checkpoint.latest(ckpt_dir)


def spoil(path: Path, case: str) -> str:
    """Edit a copy of a good checkpoint in place; returns what the error line must mention."""
    with h5py.File(path, "r+") as f:
        if case == "missing_attribute":
            del f.attrs["global_step"]
            return "'global_step'"
        if case == "other_optimizer":  # Adam's state in a file whose config says SGD
            n = f["params"].shape[0]
            del f["optimizer"]
            group = f.create_group("optimizer")
            group["m"], group["v"] = np.zeros(n, np.float32), np.zeros(n, np.float32)
            group["t"] = np.asarray(44)
            return "velocity"
        if case == "short_params":
            params = f["params"][...]
            del f["params"]
            f["params"] = params[:-5]
            return f"{len(params) - 5} parameter values"
        if case == "garbage_rng":
            f.attrs["rng_states"] = json.dumps([{"bit_generator": "PCG64", "state": "x"}] * 2)
            return "RNG state"
        if case == "rng_not_json":
            f.attrs["rng_states"] = "{not json"
            return "'rng_states'"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case", ["missing_attribute", "other_optimizer", "short_params", "garbage_rng", "rng_not_json"]
)
@pytest.mark.parametrize("resume", ["path", "auto"])
def test_resuming_a_bad_checkpoint_is_one_startup_line(
    case, resume, good_checkpoint, digits_dir, tmp_path
):
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    bad = ckpt_dir / good_checkpoint.name
    shutil.copy(good_checkpoint, bad)
    fragment = spoil(bad, case)
    before = bad.read_bytes()
    metrics = tmp_path / "m.jsonl"
    how = ["--resume", bad] if resume == "path" else ["--resume", "auto"]
    proc = run_train(
        2,
        *("--data", digits_dir / "train", *COMMON, "--epochs", 2),
        *("--checkpoint-dir", ckpt_dir, "--metrics", metrics, *how),
        timeout=TIMEOUT_S,
    )
    assert_one_startup_line(proc, f"checkpoint {bad}", fragment)
    assert not metrics.exists()
    assert checkpoint.list_checkpoints(ckpt_dir) == [bad] and bad.read_bytes() == before


def test_resuming_with_another_optimizer_names_both(good_checkpoint, digits_dir, tmp_path):
    args = ["--data", digits_dir / "train", *COMMON, "--epochs", 2, "--optimizer", "adam"]
    proc = run_train(2, *args, "--resume", good_checkpoint, timeout=TIMEOUT_S)
    assert_one_startup_line(proc, str(good_checkpoint), "--optimizer sgd", "--optimizer adam")


# --- metrics ---------------------------------------------------------------------------------


def test_metrics_path_that_is_a_directory_is_one_startup_line(digits_dir, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    args = ["--data", digits_dir / "train", *COMMON, "--epochs", 1, "--checkpoint-dir", ckpt_dir]
    proc = run_train(2, *args, "--metrics", tmp_path, timeout=TIMEOUT_S)
    line = assert_one_startup_line(proc, f"--metrics {tmp_path} is a directory")
    assert line.endswith(f"give a file name such as {tmp_path / 'metrics.jsonl'}"), line
    assert not ckpt_dir.exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_metrics_write_that_fails_is_one_line_naming_the_file(tmp_path):
    from hpcdl.metrics import MetricsError, MetricsWriter

    with pytest.raises(MetricsError, match=f"^cannot open --metrics {tmp_path}: Is a directory"):
        MetricsWriter(str(tmp_path))
    writer = MetricsWriter("/dev/full")  # every write: ENOSPC
    with pytest.raises(MetricsError) as info:
        writer.write("start", world_size=2)
    assert str(info.value).startswith("cannot write --metrics /dev/full: No space left on device")
    writer.write("step", step=1)  # stopped writing: no second error
    writer.close()


TMPFS_SIZE = 8 * 1024  # two pages: the start record and a few dozen step records


@pytest.fixture(scope="module")
def tiny_fs(tmp_path_factory):
    """Runs a command with a fresh 8 KiB tmpfs mounted on a directory (private mount namespace);
    what the command left there is copied to `<directory>.after` before the tmpfs goes away."""
    probe = tmp_path_factory.mktemp("probe")
    mount = f'mount -t tmpfs -o size={TMPFS_SIZE} tmpfs "$0"'
    try:
        proc = subprocess.run(
            ["unshare", "-m", "sh", "-c", mount, probe], capture_output=True, text=True, timeout=30
        )
    except FileNotFoundError as exc:
        pytest.skip(f"cannot mount a small tmpfs: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root and unshare): {proc.stderr.strip()}")

    def run(where: Path, cmd: list) -> subprocess.CompletedProcess:
        where.mkdir()
        after = Path(f"{where}.after")
        after.mkdir()
        script = f'{mount} && "$@"; status=$?; cp -a "$0"/. "{after}"; exit $status'
        return subprocess.run(
            ["unshare", "-m", "sh", "-c", script, where, *map(str, cmd)],
            capture_output=True,
            text=True,
            env=mpi_env(),
            timeout=TIMEOUT_S,
        )

    return run


def assert_rank_0_line_and_stopped_line(proc, *fragments: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    lines = hpcdl_lines(output)
    errors = [line for line in lines if line.startswith("hpcdl: rank 0: error: ")]
    assert len(errors) == 1, output
    for fragment in fragments:
        assert fragment in errors[0], errors
    assert sorted(lines) == sorted([errors[0], "hpcdl: rank 1: stopped because rank 0 failed"])


def test_metrics_disk_full_mid_run_is_one_line_from_rank_0(digits_dir, tiny_fs, tmp_path):
    full = tmp_path / "full"
    metrics = full / "m.jsonl"
    args = ["--data", digits_dir / "train", *COMMON, "--epochs", 3]
    proc = tiny_fs(full, train_cmd(2, *args, "--metrics", metrics, "--metrics-every", 1))
    assert_rank_0_line_and_stopped_line(
        proc, f"cannot write --metrics {metrics}", "No space left on device"
    )
    records = Path(f"{full}.after/m.jsonl").read_text().splitlines()
    assert records and all(json.loads(line)["event"] for line in records)  # whole lines only


def test_checkpoint_disk_full_mid_run_is_one_line_from_rank_0(digits_dir, tiny_fs, tmp_path):
    full = tmp_path / "full"
    args = ["--data", digits_dir / "train", *COMMON, "--epochs", 2]
    proc = tiny_fs(full, train_cmd(2, *args, "--checkpoint-dir", full / "ckpt"))
    assert_rank_0_line_and_stopped_line(
        proc,
        f"cannot write checkpoint {full / 'ckpt'}/ckpt-e",
        f"No space left on device; free space in --checkpoint-dir {full / 'ckpt'} or choose",
    )
    left = [p.name for p in Path(f"{full}.after/ckpt").iterdir()]
    assert left in ([], ["flight"]), left  # no temporary file left behind; flight: hpcdl.diag
    assert not list(Path(f"{full}.after/ckpt").glob("flight/.*"))


# --- an unexpected exception mid-run -------------------------------------------------------------

# Imported by every Python process that has this directory on PYTHONPATH: the ranks of the real
# `python -m hpcdl.train` raise RuntimeError in their 5th training step (HPCDL_TEST_FAIL: ranks);
# with HPCDL_TEST_BUSY=1 the other ranks are busy in Python at that step until the launcher's
# SIGTERM arrives, then go on to the next batch (whose loader workers that SIGTERM has killed).
SITECUSTOMIZE = textwrap.dedent(
    """
    import os, signal, time
    RANK = os.environ.get("OMPI_COMM_WORLD_RANK")
    if RANK is not None:
        from hpcdl import nn
        FAIL = {int(r) for r in os.environ["HPCDL_TEST_FAIL"].split(",")}
        BUSY = os.environ.get("HPCDL_TEST_BUSY") == "1"
        terms, real_signal, real_accuracy, calls = [], signal.signal, nn.accuracy_count, [0]

        def watched(sig, handler):
            if sig == signal.SIGTERM and callable(handler):
                def on_term(s, frame, handler=handler):
                    terms.append(s)
                    handler(s, frame)
                return real_signal(sig, on_term)
            return real_signal(sig, handler)

        def accuracy_count(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 5 and int(RANK) in FAIL:
                raise RuntimeError("injected failure")
            if calls[0] == 5 and BUSY:
                end = time.monotonic() + 20
                while not terms and time.monotonic() < end:
                    time.sleep(0.01)
            return real_accuracy(*args, **kwargs)

        signal.signal, nn.accuracy_count = watched, accuracy_count
    """
)


@pytest.mark.parametrize(
    ("failing", "busy", "workers"),
    [("0", False, 0), ("1", False, 0), ("0", True, 1), ("1", True, 1), ("0,1", False, 0)],
    ids=["rank0", "rank1", "rank0-other-busy", "rank1-other-busy", "both"],
)
def test_an_exception_mid_run_is_one_traceback_and_one_stopped_line(
    failing, busy, workers, digits_dir, tmp_path
):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**mpi_env(), "PYTHONPATH": str(tmp_path), "HPCDL_TEST_FAIL": failing}
    env["HPCDL_TEST_BUSY"] = "1" if busy else "0"
    args = ["--data", digits_dir / "train", *COMMON, "--epochs", 2, "--workers", workers]
    proc = run_train(2, *args, env=env, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert output.count("Traceback") == 1, output
    assert output.count("RuntimeError: injected failure") == 1, output
    assert "WorkerDied" not in output and "out of memory" not in output.lower(), output
    lines = hpcdl_lines(output)
    first = int(failing[0])
    if failing == "0,1":  # both fail: the first to tell the other reports
        first = 0 if "hpcdl: rank 0 failed:" in lines else 1
    other = 1 - first
    stopped = f"hpcdl: rank {other}: stopped because rank {first} failed"
    assert sorted(lines) == sorted([f"hpcdl: rank {first} failed:", stopped]), output
