"""`python -m tools.bench on-node-loss`: `--on-node-loss continue` vs the restart path (issue 49).

One machine, 3 ranks of hpcdl.train under `python -m hpcdl.launch mpirun`, the probe model
(tests/probe_model.py: a small MLP that records each step's sample indices) on an HDF5 data
set whose first pixel is the sample's index, 2 epochs, a checkpoint every --checkpoint-every
steps. Per round, in turn:

1. continue: `--on-node-loss continue` under `mpirun --with-ft ulfm`, rank 2 SIGKILLed once it
   has taken --kill-at steps; the survivors finish in the same job;
2. restart: the same job with `--on-node-loss stop` (no fault-tolerant mode) and the same kill,
   then `--resume auto` on the 2 ranks left;
3. undisturbed: the same job without a kill, with `stop` and with `continue`.

Per round: exactly once (from the probe's records: every sample of each epoch read once, the
steps kept by the checkpoint and those after the restart), the two paths' final parameters
bitwise equal (when both resumed from the same checkpoint), the time lost to the failure (wall
seconds from the last step the killed job logged to the moment the survivors' run, or the
resumed job, logged that step again: recovery or restart, and the steps since the checkpoint
trained again), their ratio (issue 49's goal: at most 0.25), the recovery (kill to the
survivors' `resumed at` line; the line's own figure, loss to new world), and the mean step
of the undisturbed jobs from --metrics, continue / stop (goal: at most 1.02). The table shows
medians over the rounds and each round's ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl import checkpoint, metrics_file
from hpcdl.bench.launch import child_env, mpirun_command
from hpcdl.data.epoch_order import global_order
from hpcdl.data.sampler import SamplerSpec
from hpcdl.helpformat import HelpFormatter

RANKS, SEED, BATCH, EPOCHS = 3, 2, 4, 2
PROBE = Path(__file__).resolve().parents[2] / "tests" / "probe_model.py"
NEW_WORLD = re.compile(r"the survivors formed a new world in ([0-9.]+) s")
RESUMED = re.compile(r"hpcdl: resumed at epoch (\d+), step (\d+)")


def index_h5(path: Path, samples: int) -> Path:
    """1x4x4 float32 images whose first pixel is the sample's index, 4 classes."""
    import h5py  # noqa: PLC0415

    rng = np.random.default_rng(0)
    images = rng.standard_normal((samples, 1, 4, 4)).astype(np.float32)
    images[:, 0, 0, 0] = np.arange(samples)
    with h5py.File(path, "w") as f:
        f["images"] = images
        f["labels"] = rng.integers(0, 4, samples).astype(np.int64)
    return path


def job_argv(a: argparse.Namespace, ranks: int, out: Path, mode: str, *more: str) -> list[str]:
    """hpcdl.launch around mpirun (with `--with-ft ulfm` for continue) around hpcdl.train."""
    ft = ["--with-ft", "ulfm"] if mode == "continue" else []
    return [sys.executable, "-m", "hpcdl.launch", *mpirun_command(ranks, oversubscribe=True),
            *ft, "-x", "HPCDL_PROBE_RECORD", sys.executable, "-m", "hpcdl.train",
            "--data", str(a.data), "--model", f"{PROBE}:probe_mlp", "--epochs", str(EPOCHS),
            "--batch-size", str(BATCH), "--lr", "0.001", "--workers", "1", "--seed", str(SEED),
            "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every",
            str(a.checkpoint_every), "--metrics", str(out / "metrics.jsonl"), "--metrics-every",
            "1", "--progress", "none", "--on-node-loss", mode, *more]  # fmt: skip


def run_job(
    argv: list[str], record: Path, steps: int, kill_at: int | None = None
) -> dict[str, Any]:
    """Run one job; with kill_at, SIGKILL world rank 2 once its record holds that many steps.
    Its wall time, exit status, output, and the times (from the start) of the kill and of the
    survivors' `resumed at` line."""
    record.mkdir(parents=True)
    env = {**child_env(RANKS, "cpu"), "HPCDL_PROBE_RECORD": str(record)}
    start, lines, seen = time.monotonic(), [], {}
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env)  # fmt: skip

    def read() -> None:
        for line in job.stdout:
            lines.append(line)
            if RESUMED.match(line) and "resumed" not in seen:
                seen["resumed"] = time.monotonic() - start

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if kill_at is not None:
        rank2 = record / "rank-2.txt"
        while job.poll() is None and (not rank2.exists() or _lines(rank2) < kill_at):
            time.sleep(0.002)
        pid = _rank_pid(record, 2)
        if pid is not None and job.poll() is None:
            os.kill(pid, signal.SIGKILL)
            seen["killed"] = time.monotonic() - start
    status = job.wait(timeout=600)
    reader.join(timeout=30)
    output = "".join(lines)
    found = NEW_WORLD.search(output)
    return dict(wall_s=time.monotonic() - start, status=status, output=output,
                new_world_s=float(found.group(1)) if found else None,
                resumed_step=_resumed_step(output, steps), **seen)  # fmt: skip


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")


def _rank_pid(record: Path, rank: int) -> int | None:
    """The pid of the job's world rank `rank` (its environment names the record dir)."""
    want = (f"HPCDL_PROBE_RECORD={record}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode())
    for entry in os.scandir("/proc"):
        try:
            environ = Path(entry.path, "environ").read_bytes().split(b"\0")
            cmdline = Path(entry.path, "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if all(w in environ for w in want) and b"hpcdl.train" in cmdline:
            return int(entry.name)
    return None


def _resumed_step(output: str, steps: int) -> int | None:
    """The global step the survivors' run resumed at (epochs of `steps` steps)."""
    found = RESUMED.search(output)
    return None if found is None else (int(found.group(1)) - 1) * steps + int(found.group(2))


def steps_of(record: Path, rank: int) -> list[list[int]]:
    text = (record / f"rank-{rank}.txt").read_text()
    return [[int(i) for i in line.split()] for line in text.splitlines()]


def exactly_once(a: argparse.Namespace, before: Path, after: Path, done: int) -> bool:
    """Every sample of each epoch read once: the first `done` steps of the 3 ranks in `before`,
    then the last steps of the 2 survivors (world ranks 0, 1) in `after` (the rest)."""
    steps = a.samples // (RANKS * BATCH)
    left = EPOCHS * steps - done
    survivors = [steps_of(after, r)[-left:] for r in range(2)]
    first = Counter(i for r in range(RANKS) for s in steps_of(before, r)[:done] for i in s)
    first.update(i for mine in survivors for s in mine[: steps - done] for i in s)
    second = Counter(i for mine in survivors for s in mine[steps - done :] for i in s)
    plan = global_order(SamplerSpec(a.samples, RANKS, SEED), 0, BATCH)
    once = sorted(first) == sorted(plan.tolist()) and set(first.values()) == {1}
    return once and sorted(second) == list(range(a.samples)) and set(second.values()) == {1}


def mean_step(out: Path) -> float:
    """Rank 0's mean t_step over the job's steps after its first 5 (start-up)."""
    run = metrics_file.load_run(out / "metrics.jsonl")
    return float(np.mean([s["t_step"] for s in run.steps[5:]]))


def time_lost(metrics: Path) -> float | None:
    """Wall seconds from the last step the failed run logged (rank 0, --metrics-every 1) to the
    moment the run after it (the survivors', or the resumed job) logged that step again: the
    recovery or restart and the steps since the checkpoint, trained again."""
    runs = metrics_file.load_runs(metrics)
    if len(runs) < 2 or not runs[0].steps:
        return None
    last = runs[0].steps[-1]
    again = next((s for s in runs[1].steps if s["step"] == last["step"]), None)
    return None if again is None else again["time"] - last["time"]


def one_round(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The five jobs of a round (module notes) and its figures."""
    steps = a.samples // (RANKS * BATCH)
    cont = run_job(job_argv(a, RANKS, work / "c", "continue"), work / "c-rec", steps, a.kill_at)
    stop = run_job(job_argv(a, RANKS, work / "s", "stop"), work / "s-rec", steps, a.kill_at)
    resume = run_job(job_argv(a, 2, work / "s", "stop", "--resume", "auto"), work / "r-rec", steps)
    plain = {m: run_job(job_argv(a, RANKS, work / m, m), work / f"{m}-rec", steps)
             for m in ("stop", "continue")}  # fmt: skip
    lost_c, lost_r = (
        time_lost(work / "c" / "metrics.jsonl"),
        time_lost(work / "s" / "metrics.jsonl"),
    )
    same_start = cont["resumed_step"] == resume["resumed_step"]
    final = [checkpoint.load(checkpoint.latest(work / d / "ckpt")).params for d in ("c", "s")]
    c_done, r_done = cont["resumed_step"], resume["resumed_step"]
    jobs = dict(continue_=cont, stop=stop, resume=resume, plain_stop=plain["stop"],
                plain_continue=plain["continue"])  # fmt: skip
    return dict(
        status={name: job["status"] for name, job in jobs.items()},
        killed_after_s=cont.get("killed"),
        resumed_step=dict(continue_=c_done, restart=r_done),
        exactly_once=dict(
            continue_=c_done is not None
            and exactly_once(a, work / "c-rec", work / "c-rec", c_done),
            restart=r_done is not None and exactly_once(a, work / "s-rec", work / "r-rec", r_done),
        ),
        bitwise_equal=(final[0].tobytes() == final[1].tobytes()) if same_start else None,
        lost_s=dict(continue_=lost_c, restart=lost_r),
        lost_ratio=lost_c / lost_r if lost_c is not None and lost_r else None,
        recovery_s=cont["resumed"] - cont["killed"] if {"resumed", "killed"} <= set(cont) else None,
        new_world_s=cont["new_world_s"],
        wall_s={name: job["wall_s"] for name, job in jobs.items()},
        step_s=dict(stop=mean_step(work / "stop"), continue_=mean_step(work / "continue")),
    )


def table(rounds: list[dict[str, Any]]) -> str:
    """The figures of the rounds: counts, medians, and each round's ratios (module notes)."""

    def med(figure) -> float:
        return float(np.median([figure(r) for r in rounds]))

    def each(values, spec: str = ".2f") -> str:
        return ", ".join("-" if v is None else f"{v:{spec}}" for v in values)

    n = len(rounds)
    ok = sum(r["status"]["continue_"] == 0 and r["exactly_once"]["continue_"] for r in rounds)
    ok_r = sum(bool(r["exactly_once"]["restart"]) for r in rounds)
    same = [r["bitwise_equal"] for r in rounds]
    steps = [r["step_s"]["continue_"] / r["step_s"]["stop"] for r in rounds]
    lost_c, lost_r = med(lambda r: r["lost_s"]["continue_"]), med(lambda r: r["lost_s"]["restart"])
    ratios = [r["lost_ratio"] for r in rounds if r["lost_ratio"] is not None]
    step_s, step_c = med(lambda r: r["step_s"]["stop"]), med(lambda r: r["step_s"]["continue_"])
    return "\n".join([
        f"rounds: {n}",
        f"continue: exit 0 and every sample of each epoch read once in {ok} of {n}; "
        f"restart path: exactly once in {ok_r} of {n}",
        f"final parameters bitwise equal, continue vs restart: {same.count(True)} of "
        f"{n - same.count(None)} rounds that resumed from the same checkpoint "
        f"({same.count(None)} did not)",
        f"time lost to the failure, median s: continue {lost_c:.2f}, restart {lost_r:.2f}; "
        f"continue / restart per round: {each(r['lost_ratio'] for r in rounds)} "
        f"(median {np.median(ratios):.2f}; goal <= 0.25)",
        f"recovery, kill to the survivors' `resumed at` line, s: "
        f"{each(r['recovery_s'] for r in rounds)}; loss to new world (the line's figure), s: "
        f"{each(r['new_world_s'] for r in rounds)}",
        f"mean step before any failure, median ms: stop {step_s * 1e3:.2f}, continue "
        f"{step_c * 1e3:.2f}; continue / stop per round: {each(steps, '.3f')} "
        f"(median {np.median(steps):.3f}; goal <= 1.02)",
    ])  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench on-node-loss",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    a = ap.add_argument
    a("--rounds", type=int, default=3, help="rounds of the five jobs (module notes)")
    a("--samples", type=int, default=720, help="samples of the data set (3 ranks x 4 a step)")
    a("--kill-at", type=int, default=25, help="rank 2 is killed after this many steps")
    a("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    a("--json", action="store_true", help="last line: one JSON object")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hpcdl-on-node-loss-") as scratch:
        args.data = index_h5(Path(scratch) / "idx.h5", args.samples)
        rounds = []
        for r in range(args.rounds):
            rounds.append(one_round(args, Path(scratch) / f"round{r}"))
            print(f"round {r + 1}: lost {rounds[-1]['lost_ratio']:.2f}x, "
                  f"step {rounds[-1]['step_s']['continue_'] / rounds[-1]['step_s']['stop']:.3f}x",
                  file=sys.stderr, flush=True)  # fmt: skip
    print(table(rounds), flush=True)
    if args.json:
        setup = {k: v for k, v in vars(args).items() if k not in ("data", "json")}
        print(json.dumps(dict(setup=setup, rounds=rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
