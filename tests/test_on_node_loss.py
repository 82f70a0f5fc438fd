"""`--on-node-loss continue` (issue 49; NOTE [recovering from lost ranks] in hpcdl/comm/ulfm.py):
under `python -m hpcdl.launch mpirun --with-ft ulfm`, 3 ranks on one machine, ranks SIGKILLed
mid-epoch. The survivors go on in the same job from the latest checkpoint, and end exactly as a
job stopped at that checkpoint and resumed with --resume auto on the ranks left: the same
batches (the probe model records every step's sample indices, tests/probe_model.py), each
sample of the epoch read once, and bitwise the same final parameters. The limits (issue 49,
item 3; docs/reliability.md): rank 0 lost, a second loss after a recovery, the last rank lost,
a loss while the checkpoint is being written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from helpers import job_pids, mpirun_cmd, rank_pid, read_events, wait_until
from lost_ranks import kill, probe_env, wait_for_step
from probe_model import recorded_steps, sample_index_h5

from hpcdl import checkpoint
from hpcdl.data.epoch_order import global_order
from hpcdl.data.sampler import SamplerSpec

N, SEED, BATCH, STEPS = 144, 2, 4, 12  # 3 ranks x 4: 12 steps of global batch 12 an epoch
PROBE = f"{Path(__file__).parent / 'probe_model.py'}:probe_mlp"
NOT_FINISHED = (
    "hpcdl: the launcher exited 0, but the run did not finish (it never said so: a lost node?, "
    "see the lines above); exit status 5. Resume with --resume auto"
)


def train_cmd(ranks: int, data: Path, ckpt: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "hpcdl.launch", *mpirun_cmd(ranks), "--with-ft", "ulfm",
            sys.executable, "-m", "hpcdl.train", "--data", str(data), "--model", PROBE,
            "--epochs", "2", "--batch-size", str(BATCH), "--lr", "0.001", "--workers", "1",
            "--seed", str(SEED), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3",
            "--progress", "none", *more]  # fmt: skip


def continue_with_kills(
    record: Path, cmd: list[str], kills: list[tuple[int, int]], env: dict[str, str]
) -> tuple[int, str]:
    """Run cmd; for each (rank, steps) in order, SIGKILL that rank (its OMPI_COMM_WORLD_RANK)
    once it has recorded that many steps. Returns the exit status and the output."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as job:  # fmt: skip
        for rank, steps in kills:
            wait_for_step(job, record, rank, steps)
            assert kill(rank_pid(str(record), rank))
        output, _ = job.communicate(timeout=180)
    return job.returncode, output


def stop_and_resume(tmp_path: Path, data: Path, worlds: list[tuple[int, int]]) -> Path:
    """The reference: a job on worlds[0][0] ranks stopped at --max-steps worlds[0][1], then
    --resume auto on each next world (the last one runs to the end). Their records are in
    tmp_path/r1, r2, ...; returns the checkpoint dir."""
    ckpt = tmp_path / "ref" / "ckpt"
    for i, (ranks, stop_at) in enumerate(worlds):
        more = ["--resume", "auto"] if i else []
        more += ["--max-steps", str(stop_at)] if i < len(worlds) - 1 else []
        done = subprocess.run(train_cmd(ranks, data, ckpt, *more), capture_output=True,
                              text=True, timeout=300,
                              env=probe_env(tmp_path / f"r{i + 1}"))  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return ckpt


def resumed_at(output: str) -> list[int]:
    """The global steps each restart on the survivors resumed at (its `resumed at` line)."""
    found = re.finditer(r"hpcdl: resumed at epoch (\d+), step (\d+)", output)
    return [(int(m.group(1)) - 1) * STEPS + int(m.group(2)) for m in found]


def recovered_lines(output: str) -> list[str]:
    return [
        line for line in output.splitlines() if "); the survivors formed a new world in " in line
    ]


def assert_bitwise(out: Path, ref: Path) -> None:
    final = checkpoint.load(checkpoint.latest(out))
    expected = checkpoint.load(checkpoint.latest(ref))
    assert final.global_step == expected.global_step == 2 * STEPS
    assert final.params.tobytes() == expected.params.tobytes()  # bitwise


def assert_same_batches(tmp_path: Path, survivors: list[int], done: int) -> None:
    """The survivors (world ranks, in their new order) read, after their restart, exactly what
    the resumed job read (their records end with it), and before the loss what the stopped job
    read; every sample of the interrupted epoch is read once: the checkpoint's, then the rest."""
    for new, rank in enumerate(survivors):
        mine, after = recorded_steps(tmp_path / "a", rank), recorded_steps(tmp_path / "r2", new)
        assert mine[:done] == recorded_steps(tmp_path / "r1", rank)
        assert mine[len(mine) - len(after) :] == after
    epoch0 = Counter(i for r in range(3) for s in recorded_steps(tmp_path / "r1", r) for i in s)
    rest = [recorded_steps(tmp_path / "r2", r)[: STEPS - done] for r in range(len(survivors))]
    epoch0.update(i for steps in rest for step in steps for i in step)
    plan = global_order(SamplerSpec(N, 3, SEED), 0, BATCH)
    assert sorted(epoch0) == sorted(plan.tolist()) and set(epoch0.values()) == {1}


def test_the_survivors_of_a_killed_rank_finish_as_a_resumed_job_would(tmp_path):
    data = sample_index_h5(tmp_path / "idx.h5", N)
    out = tmp_path / "continue"
    # 0.3 s a step (the probe, in a run that started without a checkpoint): the kill lands
    # mid-epoch; the survivors' run starts from one and is quick.
    env = probe_env(tmp_path / "a", f"0.3:{out / 'ckpt'}")
    cmd = train_cmd(3, data, out / "ckpt", "--on-node-loss", "continue")
    status, output = continue_with_kills(tmp_path / "a", cmd, [(2, 7)], env)
    assert status == 0, output[-3000:]
    recovered = recovered_lines(output)
    assert len(recovered) == 1 and recovered[0].startswith("hpcdl: lost rank 2 (on "), output[
        -3000:
    ]
    assert recovered[0].endswith(
        ": training goes on on 2 ranks on 1 node, from the latest checkpoint "
        "(--on-node-loss continue)"
    ), recovered
    assert "Traceback" not in output and "Exception" not in output, output[-3000:]
    (done,) = resumed_at(output)
    assert 3 <= done < STEPS

    ref = stop_and_resume(tmp_path, data, [(3, done), (2, 0)])
    assert_bitwise(out / "ckpt", ref)
    assert_same_batches(tmp_path, [0, 1], done)


def test_rank_0_lost_a_new_rank_0_takes_over_metrics_and_checkpoints(tmp_path):
    """Rank 0 (the writer of metrics and checkpoints) killed mid-epoch: world rank 1 becomes
    rank 0 of the survivors, appends the new run to --metrics, writes the checkpoints and says
    the run finished (hpcdl.launch's exit 0); the end is bitwise a stop + --resume auto."""
    data, out = sample_index_h5(tmp_path / "idx.h5", N), tmp_path / "continue"
    metrics = out / "metrics.jsonl"
    env = probe_env(tmp_path / "a", f"0.3:{out / 'ckpt'}")
    cmd = train_cmd(3, data, out / "ckpt", "--on-node-loss", "continue", "--metrics", str(metrics))
    status, output = continue_with_kills(tmp_path / "a", cmd, [(0, 7)], env)
    assert status == 0, output[-3000:]
    (recovered,) = recovered_lines(output)
    assert recovered.startswith("hpcdl: lost rank 0 (on "), recovered
    assert "Traceback" not in output and NOT_FINISHED not in output, output[-3000:]
    (done,) = resumed_at(output)
    assert [s["world_size"] for s in read_events(metrics, "start")] == [3, 2]
    assert [s["world_size"] for s in read_events(metrics, "summary")] == [2]
    assert [e["epoch"] for e in read_events(metrics, "epoch")][-2:] == [0, 1]
    # the survivors' flight records, as world ranks 1 and 2 of the lost run
    flights = sorted((out / "ckpt" / "flight").glob("rank-*.json"))
    assert [json.loads(f.read_text())["reason"] for f in flights] == [
        "ranks lost (--on-node-loss continue)"
    ] * 2, flights

    ref = stop_and_resume(tmp_path, data, [(3, done), (2, 0)])
    assert_bitwise(out / "ckpt", ref)
    assert_same_batches(tmp_path, [1, 2], done)


def test_a_second_loss_after_a_recovery_is_recovered_again(tmp_path):
    """Rank 2 killed, then, a few steps after the survivors' restart, rank 1: world rank 0
    goes on alone, twice recovered, and ends bitwise as a job stopped and resumed on 2 ranks,
    then stopped and resumed on 1. Its flight record is the second run's."""
    data, out = sample_index_h5(tmp_path / "idx.h5", N), tmp_path / "continue"
    env = probe_env(tmp_path / "a", "0.3:")  # every run slow: the second kill lands mid-run
    cmd = train_cmd(3, data, out / "ckpt", "--on-node-loss", "continue")
    status, output = continue_with_kills(tmp_path / "a", cmd, [(2, 7), (1, 14)], env)
    assert status == 0, output[-3000:]
    recovered = recovered_lines(output)
    assert [line.split(" (on ")[0] for line in recovered] == [
        "hpcdl: lost rank 2",
        "hpcdl: lost rank 1",
    ], output[-3000:]
    assert recovered[1].endswith(": training goes on on 1 rank on 1 node, from the latest "
                                 "checkpoint (--on-node-loss continue)")  # fmt: skip
    first, second = resumed_at(output)
    assert 3 <= first < second <= 2 * STEPS, (first, second)
    record = json.loads((out / "ckpt" / "flight" / "rank-00000.json").read_text())
    assert record["world_size"] == 2, record  # written by the second run, not the first

    ref = stop_and_resume(tmp_path, data, [(3, first), (2, second), (1, 0)])
    assert_bitwise(out / "ckpt", ref)


def test_a_rank_lost_while_the_survivors_recover_is_recovered_with_it(tmp_path):
    """Rank 2 killed; ranks 0 and 1 shrink, and the probe holds them there
    (HPCDL_PROBE_HOLD_RECOVERY) until rank 1 is killed too: rank 0 shrinks again and goes on
    alone, with one line for both losses, bitwise as a stop + --resume auto on 1 rank."""
    data, out = sample_index_h5(tmp_path / "idx.h5", N), tmp_path / "continue"
    hold = tmp_path / "hold"
    hold.mkdir()
    env = probe_env(tmp_path / "a", f"0.3:{out / 'ckpt'}", HPCDL_PROBE_HOLD_RECOVERY=str(hold))
    cmd = train_cmd(3, data, out / "ckpt", "--on-node-loss", "continue")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as job:  # fmt: skip
        wait_for_step(job, tmp_path / "a", 2, 7)
        assert kill(rank_pid(str(tmp_path / "a"), 2))
        both = [hold / "recovering-0", hold / "recovering-1"]
        wait_until(lambda: all(p.exists() for p in both) or job.poll() is not None, 60, "hold")
        assert kill(rank_pid(str(tmp_path / "a"), 1))
        (hold / "go").touch()
        output, _ = job.communicate(timeout=180)
    assert job.returncode == 0, output[-3000:]
    (recovered,) = recovered_lines(output)
    assert recovered.startswith("hpcdl: lost ranks 1, 2 (on "), recovered
    assert recovered.endswith("training goes on on 1 rank on 1 node, from the latest checkpoint "
                              "(--on-node-loss continue)"), recovered  # fmt: skip
    (done,) = resumed_at(output)
    ref = stop_and_resume(tmp_path, data, [(3, done), (1, 0)])
    assert_bitwise(out / "ckpt", ref)


def test_the_last_rank_lost_ends_the_job_non_zero(tmp_path):
    """2 ranks: rank 1 killed (recovered: rank 0 goes on alone), then rank 0, the last one. No
    rank is left to finish: hpcdl.launch's one line, exit 5, and no process of the job left."""
    data, out = sample_index_h5(tmp_path / "idx.h5", N), tmp_path / "continue"
    env = probe_env(tmp_path / "a", "0.3:")
    cmd = train_cmd(2, data, out / "ckpt", "--on-node-loss", "continue")
    status, output = continue_with_kills(tmp_path / "a", cmd, [(1, 7), (0, 11)], env)
    assert len(recovered_lines(output)) == 1, output[-3000:]
    assert status == 5, output[-3000:]
    assert output.rstrip().splitlines()[-1] == NOT_FINISHED, output[-3000:]
    wait_until(lambda: not job_pids(str(tmp_path / "a")), 30, "the job's processes to end")


def test_a_loss_while_the_checkpoint_is_written_resumes_from_the_one_before(tmp_path):
    """Rank 0 killed while it writes the checkpoint of step 9 (the probe holds it there with
    the temporary file written whole, HPCDL_PROBE_HOLD): the checkpoint of step 6 stays the
    latest and valid, the survivors resume from it, and end bitwise as stop at 6 + resume."""
    data, out = sample_index_h5(tmp_path / "idx.h5", N), tmp_path / "continue"
    hold = tmp_path / "hold"
    hold.mkdir()
    env = probe_env(tmp_path / "a", f"0.3:{out / 'ckpt'}", HPCDL_PROBE_HOLD=f"9:{hold}")
    cmd = train_cmd(3, data, out / "ckpt", "--on-node-loss", "continue")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env) as job:  # fmt: skip
        wait_until(lambda: (hold / "holding").exists() or job.poll() is not None, 120, "hold")
        assert job.poll() is None, job.communicate()
        assert checkpoint.latest(out / "ckpt").name == checkpoint.checkpoint_name(0, 6)
        assert kill(rank_pid(str(tmp_path / "a"), 0))
        output, _ = job.communicate(timeout=180)
    assert job.returncode == 0, output[-3000:]
    (recovered,) = recovered_lines(output)
    assert recovered.startswith("hpcdl: lost rank 0 (on "), recovered
    assert resumed_at(output) == [6], output[-3000:]
    assert Path((hold / "holding").read_text()).exists()  # the unpublished write, left aside

    ref = stop_and_resume(tmp_path, data, [(3, 6), (2, 0)])
    assert_bitwise(out / "ckpt", ref)
    assert_same_batches(tmp_path, [1, 2], 6)


def test_continue_needs_a_checkpoint_dir_to_go_on_from():
    import pytest  # noqa: PLC0415

    from hpcdl.config import ConfigError, parse_args  # noqa: PLC0415

    with pytest.raises(ConfigError, match="--on-node-loss continue needs --checkpoint-dir"):
        parse_args(["--data", "x", "--on-node-loss", "continue"])
    assert parse_args(["--data", "x"]).on_node_loss == "stop"
