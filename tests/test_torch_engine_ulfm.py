"""`--on-node-loss continue` with a torch model (issue 61; NOTE [recovering from lost ranks] in
hpcdl/comm/ulfm.py): under `python -m hpcdl.launch mpirun --with-ft ulfm`, 3 ranks train
tests/torch_models.py's CNN, rank 2 is SIGKILLed mid-epoch, and the survivors end bitwise as a
job stopped at the same checkpoint and resumed with --resume auto on 2 ranks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import mpi_env, mpirun_cmd, rank_pid, read_events, wait_until
from lost_ranks import kill

from hpcdl import checkpoint

pytest.importorskip("torch")

CNN = f"{Path(__file__).parent / 'torch_models.py'}:small_cnn"


def launch_cmd(ranks: int, digits: Path, ckpt: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "hpcdl.launch", *mpirun_cmd(ranks), "--with-ft", "ulfm",
            sys.executable, "-m", "hpcdl.train", "--data", str(digits / "train"), "--model", CNN,
            "--epochs", "2", "--batch-size", "16", "--lr", "0.05", "--workers", "0", "--seed",
            "5", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10", "--progress", "none",
            *more]  # fmt: skip


@pytest.mark.parametrize("sync_bn", [[], ["--sync-bn"]], ids=["", "sync-bn"])
def test_the_survivors_of_a_killed_rank_end_as_stop_and_resume_would(sync_bn, digits_dir, tmp_path):
    """With --sync-bn the ranks also meet in every BatchNorm layer's sums, on a communicator of
    their own, in forward and in backward: a rank lost there must not leave the survivors
    waiting in one."""
    out, metrics = tmp_path / "continue", tmp_path / "continue.jsonl"
    # 0.1 s a step until the kill lands mid-epoch; the survivors rebuild the module from step
    # 10's checkpoint and train on at full speed (tests/torch_models.py)
    env = {**mpi_env(), "HPCDL_TORCH_SLOW": f"0.1:{out}", "HPCDL_TEST_MARKER": str(out)}
    cmd = launch_cmd(3, digits_dir, out, "--on-node-loss", "continue", "--metrics", str(metrics),
                     "--metrics-every", "1", *sync_bn)  # fmt: skip
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as job:  # fmt: skip
        try:
            wait_until(lambda: metrics.exists() and len(read_events(metrics, "step")) >= 13,
                       timeout=120, what="step 13")  # fmt: skip
            assert kill(rank_pid(str(out), 2))
            output, _ = job.communicate(timeout=300)
        finally:
            job.kill()
    assert job.returncode == 0, output[-3000:]
    assert "the survivors formed a new world in" in output, output[-3000:]
    found = re.findall(r"hpcdl: resumed at epoch (\d+), step (\d+)", output)
    assert found == [("1", "10")], output[-3000:]

    ref = tmp_path / "ref"
    for ranks, more in ((3, ["--max-steps", "10"]), (2, ["--resume", "auto"])):
        cmd = launch_cmd(ranks, digits_dir, ref, *more, *sync_bn)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpi_env())
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    final, expected = (checkpoint.load(checkpoint.latest(d)) for d in (out, ref))
    assert final.global_step == expected.global_step
    assert final.params.tobytes() == expected.params.tobytes()  # bitwise
