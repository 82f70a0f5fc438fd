"""`bench calibrate`'s PFS figures: open latency, one reader thread's bandwidth, and the file
system's limit, measured by reading distinct files of --data with 1, 2, 4, ... threads (world
rank 0 alone), then by every node's leader at once (two nodes or more). Also the files the
contention measure copies, spread over the tree between the sweep's."""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpcdl.clustermodel.calibration import PfsFigures
from hpcdl.comm.failure import UserError

SATURATED = 2 / 3  # reached rate / (threads x one-thread rate) below which a limit is recorded


def sample_files(root: Path, count: int, middle: bool = False) -> list[Path]:
    """Up to `count` regular files under root, spread over the tree (sorted, every k-th; middle:
    from the middle of the first k, so mostly not the files of a sample without it)."""
    files = [
        Path(d) / n
        for d, dirs, names in os.walk(root)
        for n in sorted(names)
        if not n.startswith(".")
    ]
    files.sort()
    if not files:
        raise UserError(f"hpcdl.bench calibrate: --data {root} holds no files to read")
    step = max(1, len(files) // count)
    return files[step // 2 if middle else 0 :: step][:count]


def copy_sample(root: Path, count: int, budget_bytes: int) -> tuple[list[str], list[int]]:
    """The files the contention measure copies (relative paths, sizes): up to `count`, spread
    over the tree between the PFS sweep's, within budget_bytes."""
    relpaths, sizes, total = [], [], 0
    for path in sample_files(root, count, middle=True):
        size = path.stat().st_size
        if total + size > budget_bytes:
            break
        relpaths.append(str(path.relative_to(root)))
        sizes.append(size)
        total += size
    return relpaths, sizes


def _read(path: Path) -> tuple[float, float, int]:
    """(seconds in open, seconds reading, bytes) of one whole file."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        t1 = time.perf_counter()
        n = 0
        while chunk := f.read(1 << 20):
            n += len(chunk)
    return t1 - t0, time.perf_counter() - t1, n


def measure_pfs(root: Path, max_threads: int, per_count: int) -> tuple[PfsFigures, list[dict]]:
    """Reader-thread sweep on distinct files; returns the figures and the sweep's rows."""
    counts = [1 << k for k in range(max_threads.bit_length()) if 1 << k <= max_threads]
    files = sample_files(root, per_count * len(counts))
    cut = len(files) < len(counts)  # each thread count reads distinct files: as far as they reach
    counts = counts[: len(files)]
    chunks = [files[i :: len(counts)] for i in range(len(counts))]
    rows = []
    for threads, chunk in zip(counts, chunks):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(_read, chunk))
        wall = time.perf_counter() - t0
        nbytes = sum(r[2] for r in results)
        rows.append(dict(threads=threads, files=len(chunk), opens_per_s=len(chunk) / wall,
                         bytes_per_s=nbytes / wall,
                         open_s=statistics.mean(r[0] for r in results),
                         read_s=statistics.mean(r[1] for r in results),
                         bytes=nbytes))  # fmt: skip
    if cut:
        rows[-1]["sweep_cut_at_files"] = len(files)
    one, top = rows[0], rows[-1]
    thread_bw = one["bytes"] / max(one["read_s"] * one["files"], 1e-9)
    limited = top["opens_per_s"] < SATURATED * top["threads"] * one["opens_per_s"]
    mean_size = top["bytes"] / max(top["files"], 1)
    big_files = mean_size / max(thread_bw, 1e-9) > one["open_s"]  # reading, not opening, dominates
    return PfsFigures(
        open_latency_s=one["open_s"],
        thread_bandwidth_Bps=thread_bw,
        total_bandwidth_Bps=top["bytes_per_s"] if limited and big_files else 0.0,
        total_opens_per_s=top["opens_per_s"] if limited and not big_files else 0.0,
    ), rows


def measure_pfs_together(
    world: Any, root: Path, threads: int, per_node: int, alone: PfsFigures
) -> PfsFigures:
    """Every node's leader reads per_node other files with `threads` threads at once, as the
    stagers will; an aggregate short of nodes x threads / (one file's time) by more than a
    tenth is written as the file system's limit at this many nodes."""
    from mpi4py import MPI  # noqa: PLC0415

    leaders = world.comm.Split(0 if world.local_rank == 0 else MPI.UNDEFINED, world.rank)
    result = alone
    if leaders:
        nodes = leaders.size
        files = sample_files(root, per_node * (nodes + 8))[-per_node * nodes :]
        leaders.Barrier()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(_read, files[leaders.rank :: nodes]))
        wall = leaders.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        total_files = leaders.allreduce(len(results))
        total_bytes = leaders.allreduce(sum(r[2] for r in results))
        leaders.Free()
        per_file = alone.open_latency_s + total_bytes / total_files / alone.thread_bandwidth_Bps
        reached = total_files / wall
        if reached < 0.9 * nodes * threads / per_file:
            result = replace(alone, total_opens_per_s=reached, total_bandwidth_Bps=0.0)
    return world.comm.bcast(result, root=0)
