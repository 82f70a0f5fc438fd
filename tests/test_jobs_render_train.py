"""`python -m hpcdl.jobs render train` reads the config as hpcdl.train does (dashed keys), takes
the --metrics and --checkpoint-dir given after a bare --, checks its own options, makes the log
directory, and its script says what ended a job (docs/slurm.md). The scripts run here under
bash with a stand-in launcher; tests/test_jobs_slurm_stop.py runs them under the test Slurm."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import one_line_error, wait_until

SLURM_ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "j", "SLURM_JOB_NODELIST": "n1",
             "SLURM_NTASKS": "2"}  # fmt: skip
# A stand-in for mpirun: appends a finished run's records to the --metrics its trainer got
# (the last one, as argparse takes it) and exits 0.
FINISHING = """#!/bin/sh
m=""; prev=""
for a in "$@"; do [ "$prev" = --metrics ] && m="$a"; prev="$a"; done
printf '{"event": "start"}\\n{"event": "summary"}\\n' >> "$m"
"""


def render(cwd: Path, config_text: str, *args: str) -> subprocess.CompletedProcess:
    (cwd / "job.toml").write_text(f'data = "data"\n{config_text}')
    return subprocess.run([sys.executable, "-m", "hpcdl.jobs", "render", "train", "--nodes", "1",
                           "--tasks-per-node", "2", "--time", "01:00:00", "--config", "job.toml",
                           "--output", "logs", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)  # fmt: skip


def with_launcher(script: str, launcher: Path) -> str:
    return re.sub(r"(?m)^launcher=.*$", f"launcher={launcher}", script)


def stand_in(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_dashed_keys_are_read_as_the_trainer_reads_them(tmp_path):
    done = render(tmp_path, 'checkpoint-dir = "ck"\non-node-loss = "continue"\n')
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr, done.stderr
    assert f"checkpoint_dir={tmp_path / 'ck'}\n" in done.stdout
    assert re.search(r"(?m)^\s+--resume auto\b", done.stdout)
    assert "--with-ft ulfm" in done.stdout
    chain = render(tmp_path, 'checkpoint-dir = "ck"\n', "--chain", "2")
    assert chain.returncode == 0, chain.stderr


def test_a_config_key_the_trainer_does_not_know_is_refused_in_one_line(tmp_path):
    line = one_line_error(render(tmp_path, 'checkpoint_dirr = "ck"\n'))
    assert "checkpoint_dirr" in line


def test_metrics_and_checkpoint_dir_after_a_bare_dashdash_are_where_the_script_looks(tmp_path):
    done = render(tmp_path, "", "--no-stage", "--", "--metrics", "other.jsonl",
                  "--checkpoint-dir=ck2")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"metrics={tmp_path / 'other.jsonl'}\n" in done.stdout
    assert f"checkpoint_dir={tmp_path / 'ck2'}\n" in done.stdout
    assert re.search(r"(?m)^\s+--resume auto\b", done.stdout)
    assert "warning" not in done.stderr, done.stderr
    script = with_launcher(done.stdout, stand_in(tmp_path / "mpirun", FINISHING))
    ran = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, **SLURM_ENV}, timeout=60)  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "hpcdl: job 42 finished training" in ran.stdout
    assert (tmp_path / "other.jsonl").exists()


def test_config_after_a_bare_dashdash_is_refused(tmp_path):
    line = one_line_error(render(tmp_path, "", "--", "--config", "other.toml"))
    assert "--config" in line


def test_a_relative_checkpoint_dir_is_made_absolute(tmp_path):
    done = render(tmp_path, "", "--checkpoint-dir", "ck")
    assert done.returncode == 0, done.stderr
    assert f"checkpoint_dir={tmp_path / 'ck'}\n" in done.stdout
    assert '--checkpoint-dir "$checkpoint_dir"' in done.stdout


@pytest.mark.parametrize("value", ["0", "-2"])
def test_cpus_per_task_below_1_is_refused(tmp_path, value):
    line = one_line_error(render(tmp_path, "", "--cpus-per-task", value))
    assert "--cpus-per-task" in line


def test_the_output_directory_is_made_when_missing(tmp_path):
    done = render(tmp_path, 'checkpoint_dir = "ck"\n', "--output", "logs/new")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "logs" / "new").is_dir()
    assert f"#SBATCH --output={tmp_path / 'logs' / 'new'}/%x-%j.out" in done.stdout


def test_an_output_directory_that_cannot_be_made_is_refused(tmp_path):
    (tmp_path / "file").write_text("mine\n")
    line = one_line_error(render(tmp_path, "", "--output", "file/logs"))
    assert "--output" in line
    assert (tmp_path / "file").read_text() == "mine\n"


def test_a_job_ended_by_a_signal_before_a_checkpoint_says_so(tmp_path):
    """scancel's SIGTERM; the launcher ends without the ranks' stop (exit 1): not 'FAILED ...
    see the errors above' when there are none."""
    started = tmp_path / "started"
    launcher = stand_in(tmp_path / "mpirun",
                        f"#!/bin/sh\ntrap 'exit 1' USR1\ntouch {started}\n"
                        "while :; do sleep 0.05; done\n")  # fmt: skip
    done = render(tmp_path, 'checkpoint_dir = "ck"\n', "--no-stage")
    assert done.returncode == 0, done.stderr
    job = subprocess.Popen(["bash", "-c", with_launcher(done.stdout, launcher)], text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                           env={**os.environ, **SLURM_ENV})  # fmt: skip
    try:
        wait_until(started.exists, 60, "the stand-in launcher")
        job.send_signal(signal.SIGTERM)
        out, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 1, out
    assert "see the errors above" not in out
    assert "hpcdl: job 42 ENDED by SIGTERM (scancel, or the time limit)" in out, out


def test_mpirun_runs_with_sigterm_blocked(tmp_path):
    done = render(tmp_path, "")
    assert '"$python" -m hpcdl.sigterm_blocked "$launcher" \\\n' in done.stdout
