"""`python -m hpcdl.jobs render script ... -- COMMAND`: hpcdl's sbatch around a user's script.
The rendered script is valid bash with the site's launcher, the node-local stage dir and the
time-limit signal; and run as a batch shell on this host (mpirun, 2 ranks, no Slurm: its
variables faked), a SIGUSR1 to the shell reaches every rank as hpcdl.torch.stop_requested(),
the ranks checkpoint and exit 0, and the shell says the job stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hpcdl.jobs import JobSpec, JobSpecError, load_site, render


def spec(tmp_path, command, **overrides) -> JobSpec:
    values = dict(
        kind="script",
        nodes=1,
        tasks_per_node=2,
        device="cpu",
        time="01:00:00",
        config="",
        site=load_site("generic"),
        output_dir=str(tmp_path),
        extra_args=list(command),
    )
    values.update(overrides)
    return JobSpec(**values)


def bash_n(script: str) -> None:
    done = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert done.returncode == 0, done.stderr


def test_the_script_has_launcher_stage_dir_and_signal(tmp_path):
    script, warnings = render(spec(tmp_path, ["python", "train.py", "--dir={stage_dir}/x", "a b"]))
    bash_n(script)
    assert warnings == []
    assert "#SBATCH --signal=B:USR1@120" in script and "#SBATCH --ntasks-per-node=2" in script
    assert "-np 2 --map-by ppr:2:node" in script
    assert "python train.py --dir=\"$stage_dir\"/x 'a b' &" in script
    assert 'export HPCDL_JOB_STAGE_DIR="$stage_dir"' in script
    chain, _ = render(spec(tmp_path, ["python", "train.py"], chain=3))
    bash_n(chain)
    assert "for k in $(seq 1 3)" in chain and "--dependency=afterany" in chain


def test_what_cannot_be_rendered_is_one_line(tmp_path):
    for bad, words in [
        (spec(tmp_path, []), "needs the command after a bare --"),
        (spec(tmp_path, ["python", "t.py"], signal_seconds=3600), "--signal-seconds"),
        (spec(tmp_path, ["python", "t.py"], chain=2, requeue=True), "--chain and --requeue"),
        (spec(tmp_path, ["python", "t.py"], kind="train"), "needs --config"),
    ]:
        with pytest.raises(JobSpecError, match=words):
            render(bad)


TRAIN = """
import os, pathlib, time
import hpcdl.torch as hvd
hvd.init()
hvd.stop_requested()  # the first call installs the handler: before anything can signal
out = pathlib.Path({out!r})
(out / f"started.{{hvd.rank()}}").touch()
for step in range(100000):
    time.sleep(0.01)
    if hvd.stop_requested():
        if hvd.rank() == 0:
            (out / "checkpoint").write_text(str(step))
        break
"""


def test_a_signal_to_the_batch_shell_stops_every_rank_after_a_checkpoint(tmp_path):
    pytest.importorskip("torch")
    train = tmp_path / "train.py"
    train.write_text(textwrap.dedent(TRAIN.format(out=str(tmp_path))))
    script, _ = render(spec(tmp_path, [sys.executable, str(train)], stage=False))
    batch = tmp_path / "job.sbatch"
    batch.write_text(script)
    env = dict(
        os.environ,
        SLURM_JOB_ID="7",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NTASKS="2",
        SLURM_CPUS_PER_TASK="1",
    )
    shell = subprocess.Popen(
        ["bash", str(batch)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("started.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    shell.send_signal(__import__("signal").SIGUSR1)
    out, _ = shell.communicate(timeout=90)
    assert shell.returncode == 0, out
    assert "STOPPED by a signal before its time limit" in out
    assert (tmp_path / "checkpoint").exists()
