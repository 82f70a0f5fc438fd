"""`python -m hpcdl.launch`: the launcher's exit status, never 0 for a run that did not finish
(issue 49; NOTE [a lost node exits 0] in hpcdl/launch.py). Real processes stand in for the
launcher; tests/test_node_loss.py runs it around mpirun on emulated nodes with one killed."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hpcdl.launch import launcher_argv


def launch(script: str, cwd, *args: str) -> subprocess.CompletedProcess:
    """`python -m hpcdl.launch sh -c script sh args...` in cwd."""
    return subprocess.run([sys.executable, "-m", "hpcdl.launch", "sh", "-c", script, "sh", *args],
                          capture_output=True, text=True, timeout=60, cwd=cwd)  # fmt: skip


@pytest.mark.parametrize(
    ("script", "status"),
    [
        ('echo finished > "$HPCDL_OUTCOME"', 0),  # the run said it finished
        ("true", 0),  # a program that says nothing (a user's script): the launcher's status
        ('echo started > "$HPCDL_OUTCOME"; exit 3', 3),  # stopped by a signal, say
        ('echo started > "$HPCDL_OUTCOME"; kill -9 $$', 128 + 9),  # as a shell reports it
    ],
)
def test_the_launchers_status_is_passed_on(script, status, tmp_path):
    done = launch(script, tmp_path)
    assert done.returncode == status, done.stderr
    assert "did not finish" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # the outcome file is gone


def test_a_run_that_started_and_never_finished_does_not_exit_0(tmp_path):
    done = launch('echo started > "$HPCDL_OUTCOME"', tmp_path)
    assert done.returncode == 5
    assert done.stderr.splitlines() == [
        "hpcdl: the launcher exited 0, but the run did not finish (it never said so: a lost "
        "node?, see the lines above); exit status 5. Resume with --resume auto"
    ]
    assert list(tmp_path.iterdir()) == []


SAY_WHERE = 'echo "$HPCDL_OUTCOME" > "$0.where"; echo started > "$HPCDL_OUTCOME"'


@pytest.mark.parametrize(
    ("flags", "directory"),
    [
        (["--checkpoint-dir", "{run}/ckpt", "--metrics", "{run}/m/metrics.jsonl"], "ckpt"),
        (["--metrics={run}/m/metrics.jsonl"], "m"),
        (["--config", "{run}/job.toml"], "ckpt"),  # checkpoint_dir = "ckpt", beside the file
    ],
)
def test_the_outcome_file_lies_in_the_runs_own_directory(flags, directory, tmp_path):
    run, cwd = tmp_path / "run", tmp_path / "cwd"
    run.mkdir()
    cwd.mkdir()
    (run / "job.toml").write_text('data = "x"\ncheckpoint_dir = "ckpt"\n')
    done = launch(SAY_WHERE.replace("$0", str(tmp_path / "seen")), cwd,
                  *(flag.format(run=run) for flag in flags))  # fmt: skip
    assert done.returncode == 5, done.stderr
    seen = Path((tmp_path / "seen.where").read_text().strip())
    assert seen.parent == run / directory and seen.name.startswith(".hpcdl-outcome-")
    assert not seen.exists() and not seen.parent.exists()  # removed at the end, as made
    assert list(cwd.iterdir()) == []  # nothing in the working directory


def test_without_a_run_directory_the_outcome_lies_in_a_temporary_directory_removed_after(
    tmp_path,
):
    (tmp_path / "cwd").mkdir()
    done = launch(SAY_WHERE.replace("$0", str(tmp_path / "seen")), tmp_path / "cwd")
    assert done.returncode == 5, done.stderr
    seen = Path((tmp_path / "seen.where").read_text().strip())
    assert seen.parent.parent == Path(tempfile.gettempdir()), seen
    assert not seen.parent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "seen.where"]


def test_mpirun_is_told_to_pass_the_outcome_file_to_every_node():
    assert launcher_argv(["/opt/ompi/bin/mpirun", "-np", "4", "prog"]) == [
        "/opt/ompi/bin/mpirun", "-x", "HPCDL_OUTCOME", "-np", "4", "prog"
    ]  # fmt: skip
    assert launcher_argv(["srun", "-n", "4", "prog"]) == ["srun", "-n", "4", "prog"]


def test_a_finished_training_run_under_mpirun_exits_0(tmp_path):
    from helpers import mpi_env, mpirun_cmd  # noqa: PLC0415

    from tests.probe_model import sample_index_h5  # noqa: PLC0415

    data = sample_index_h5(tmp_path / "idx.h5", 64)
    argv = [sys.executable, "-m", "hpcdl.launch", *mpirun_cmd(2), sys.executable, "-m",
            "hpcdl.train", "--data", str(data), "--model", "mlp", "--epochs", "1",
            "--batch-size", "8", "--workers", "0", "--progress", "none", "--quiet"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=mpi_env(),
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "did not finish" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx.h5"]


def test_a_file_of_the_users_with_the_outcome_files_old_name_is_left_alone(tmp_path):
    """The outcome file is created afresh (never a name that exists); a file of the same name,
    a user's or another launch's (a PID seen on another node sharing the checkpoint directory)
    is neither truncated nor removed."""
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415

    from hpcdl.launch import FORWARDED, main  # noqa: PLC0415

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    theirs = ckpt / f".hpcdl-outcome-{os.getpid()}"  # the name this process used to take
    theirs.write_text("theirs\n")
    handlers = {sig: signal.getsignal(sig) for sig in FORWARDED}  # main() forwards these
    try:
        status = main(["sh", "-c", 'echo finished > "$HPCDL_OUTCOME"', "sh",
                       "--checkpoint-dir", str(ckpt)])  # fmt: skip
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert status == 0
    assert theirs.read_text() == "theirs\n"
    assert list(ckpt.iterdir()) == [theirs]  # its own file is gone, theirs stays
