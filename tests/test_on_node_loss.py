"""`--on-node-loss continue` (issue 49; NOTE [recovering from lost ranks] in hpcdl/comm/ulfm.py):
under `mpirun --with-ft ulfm`, 3 ranks on one machine, rank 2 SIGKILLed mid-epoch. The
survivors go on in the same job from the latest checkpoint, and end exactly as a job stopped
at that checkpoint and resumed with --resume auto on 2 ranks: the same batches (the probe
model records every step's sample indices, tests/probe_model.py), each sample of the epoch
read once, and bitwise the same final parameters."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from helpers import mpi_env, mpirun_cmd
from probe_model import recorded_steps, sample_index_h5

from hpcdl import checkpoint
from hpcdl.data.epoch_order import global_order
from hpcdl.data.sampler import SamplerSpec

N, SEED, BATCH, STEPS = 144, 2, 4, 12  # 3 ranks x 4: 12 steps of global batch 12 an epoch
PROBE = f"{Path(__file__).parent / 'probe_model.py'}:probe_mlp"


def train_cmd(ranks: int, data: Path, ckpt: Path, *more: str) -> list[str]:
    return [*mpirun_cmd(ranks), "--with-ft", "ulfm", sys.executable, "-m", "hpcdl.train",
            "--data", str(data), "--model", PROBE, "--epochs", "2", "--batch-size", str(BATCH),
            "--lr", "0.001", "--workers", "1", "--seed", str(SEED), "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "3", "--progress", "none", *more]  # fmt: skip


def probe_env(record: Path, slow: str = "") -> dict[str, str]:
    record.mkdir()
    return {**mpi_env(), "HPCDL_PROBE_RECORD": str(record), "HPCDL_PROBE_SLOW": slow}


def rank_pid(rank: int, marker: str) -> int | None:
    """The pid of hpcdl.train's rank `rank` whose command line holds marker."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or marker not in (entry / "cmdline").read_text():
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def test_the_survivors_of_a_killed_rank_finish_as_a_resumed_job_would(tmp_path):
    data = sample_index_h5(tmp_path / "idx.h5", N)
    out = tmp_path / "continue"
    # 0.3 s a step (the probe, in a run that started without a checkpoint): the kill lands
    # mid-epoch; the survivors' run starts from one and is quick.
    env = probe_env(tmp_path / "a", f"0.3:{out / 'ckpt'}")
    cmd = train_cmd(3, data, out / "ckpt", "--on-node-loss", "continue")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as job:  # fmt: skip
        rank2, deadline = tmp_path / "a" / "rank-2.txt", time.monotonic() + 120
        while not rank2.exists() or len(rank2.read_text().splitlines()) < 7:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.02)
        pid = rank_pid(2, str(out))
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        output, _ = job.communicate(timeout=180)
    assert job.returncode == 0, output[-3000:]
    lines = output.splitlines()
    recovered = [line for line in lines if "); the survivors formed a new world in " in line]
    assert len(recovered) == 1 and recovered[0].startswith("hpcdl: lost rank 2 (on "), output[
        -3000:
    ]
    assert recovered[0].endswith(
        ": training goes on on 2 ranks on 1 node, from the latest checkpoint "
        "(--on-node-loss continue)"
    ), recovered
    assert "Traceback" not in output and "Exception" not in output, output[-3000:]
    (resumed,) = [
        m for line in lines if (m := re.match(r"hpcdl: resumed at epoch 1, step (\d+)", line))
    ]
    done = int(resumed.group(1))
    assert 3 <= done < STEPS

    # The reference: the same 3 ranks stopped at that step, then --resume auto on 2 ranks.
    ref = tmp_path / "ref"
    first = subprocess.run(train_cmd(3, data, ref / "ckpt", "--max-steps", str(done)),
                           capture_output=True, text=True, timeout=300,
                           env=probe_env(tmp_path / "r1"))  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]
    second = subprocess.run(train_cmd(2, data, ref / "ckpt", "--resume", "auto"),
                            capture_output=True, text=True, timeout=300,
                            env=probe_env(tmp_path / "r2"))  # fmt: skip
    assert second.returncode == 0, second.stdout + second.stderr[-3000:]

    final = checkpoint.load(checkpoint.latest(out / "ckpt"))
    expected = checkpoint.load(checkpoint.latest(ref / "ckpt"))
    assert final.global_step == expected.global_step == 2 * STEPS
    assert final.params.tobytes() == expected.params.tobytes()  # bitwise

    # The batches: the survivors read, after their restart, exactly what the resumed job read
    # (their records end with it), and before the kill what the stopped job read.
    for rank in range(2):
        mine, after = recorded_steps(tmp_path / "a", rank), recorded_steps(tmp_path / "r2", rank)
        assert mine[:done] == recorded_steps(tmp_path / "r1", rank)
        assert mine[len(mine) - len(after) :] == after
    # ... and every sample of the interrupted epoch once: the checkpoint's, then the rest.
    epoch0 = Counter(i for r in range(3) for s in recorded_steps(tmp_path / "r1", r) for i in s)
    epoch0.update(i for r in range(2) for s in recorded_steps(tmp_path / "r2", r)[: STEPS - done]
                  for i in s)  # fmt: skip
    plan = global_order(SamplerSpec(N, 3, SEED), 0, BATCH)
    assert sorted(epoch0) == sorted(plan.tolist()) and set(epoch0.values()) == {1}


def test_continue_needs_a_checkpoint_dir_to_go_on_from():
    import pytest  # noqa: PLC0415

    from hpcdl.config import ConfigError, parse_args  # noqa: PLC0415

    with pytest.raises(ConfigError, match="--on-node-loss continue needs --checkpoint-dir"):
        parse_args(["--data", "x", "--on-node-loss", "continue"])
    assert parse_args(["--data", "x"]).on_node_loss == "stop"
