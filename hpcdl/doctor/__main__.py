"""Command line of hpcdl.doctor: probe every rank, merge per node, print text or JSON."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any

from hpcdl.data import worker_cores
from hpcdl.doctor import probes
from hpcdl.doctor.findings import ERROR, EXIT_ERRORS, WARNING, merge, rank_ranges
from hpcdl.doctor.stagedir import check_stage_dir, default_stage_dir, read_mounts
from hpcdl.helpformat import HelpFormatter
from hpcdl.messages import launcher_rank
from hpcdl.units import binary_size

LABELS = {
    "mpi": "MPI",
    "cuda_aware": "CUDA-aware",
    "gpus": "GPUs",
    "blas": "BLAS",
    "loader": "loader",
    "stager": "stager",
    "torch_engine": "torch",
    "stage_dir": "stage dir",
    "slurm": "Slurm",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcdl.doctor",
        description=__doc__.split("\n")[0] + " Run it alone or under mpirun/srun.",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--stage-dir",
        help="the node-local directory hpcdl.train --stage-dir will get (default: "
        "$HPCDL_STAGE_DIR, else $SLURM_TMPDIR, else $TMPDIR, else /tmp, as the sbatch templates)",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="loader workers per rank to check (default: hpcdl.train's for this layout)",
    )
    p.add_argument("--prefetch", default="auto", help="batch slots per rank to check: auto or N")
    p.add_argument(
        "--batch-size", type=int, default=128, help="samples per batch, for the slots' memory"
    )
    p.add_argument(
        "--sample-shape", default="3,224,224", help="C,H,W of one sample after --augment"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def check_flags(args: argparse.Namespace) -> str | None:
    """The first flag whose value the doctor cannot check with, as one line; None when all are
    usable (the same bounds as hpcdl.train's --workers, --prefetch and --batch-size)."""
    if args.workers is not None and args.workers < 0:
        return f"--workers must be >= 0, got {args.workers}"
    if args.batch_size < 1:
        return f"--batch-size must be a positive integer, got {args.batch_size}"
    prefetch = args.prefetch
    if prefetch != "auto" and not (prefetch.isascii() and prefetch.isdigit() and int(prefetch)):
        return f"--prefetch must be auto or an integer >= 1, got {prefetch!r}"
    dims = args.sample_shape.split(",")
    if len(dims) != 3 or not all(d.isascii() and d.isdigit() and int(d) >= 1 for d in dims):
        return f"--sample-shape must be C,H,W, three integers >= 1, got {args.sample_shape!r}"
    return None


def rank_report(world: Any, stage_dir: str | None, args: Any = None) -> dict[str, Any]:
    """This rank's facts by category and its problems (as dicts). Collective on the node."""
    facts: dict[str, Any] = {}
    problems: list[dict[str, str]] = []

    def add(name: str, found: probes.Found) -> None:
        facts[name] = found[0]
        problems.extend(p.to_dict() for p in found[1])

    add("mpi", probes.mpi(world.comm))
    add("cuda_aware", probes.cuda_awareness(world.comm))
    add("gpus", probes.gpus(world.local_rank, world.local_size))
    add("blas", probes.blas(world.node_comm))
    args = args or build_parser().parse_args([])
    shape = tuple(int(v) for v in args.sample_shape.split(","))
    cores = worker_cores.for_rank(world.node_comm, world.local_rank)
    add("loader", probes.loader(args.workers, args.prefetch, args.batch_size, shape,
                                world.local_size, cores))  # fmt: skip
    add("stager", probes.stager())
    add("torch_engine", probes.torch_engine())
    add("slurm", probes.slurm(world.size, world.num_nodes, facts["blas"]["cores"]))
    # one rank per node makes and removes the probe files; the others take its answer
    stage = None
    if world.is_node_leader:
        path, origin = (stage_dir, "--stage-dir") if stage_dir else default_stage_dir()
        stage_facts, stage_problems = check_stage_dir(path, origin, read_mounts())
        stage = (stage_facts, [p.to_dict() for p in stage_problems])
    stage_facts, stage_problems = world.node_comm.bcast(stage, root=0)
    facts["stage_dir"] = stage_facts
    if world.is_node_leader:
        problems.extend(stage_problems)
    return {
        "host": socket.gethostname(),
        "rank": world.rank,
        "local_rank": world.local_rank,
        "facts": facts,
        "problems": problems,
    }


def describe(name: str, v: dict[str, Any]) -> str:
    """One line for one category of facts."""
    if name == "mpi":
        return (
            f"{v['library']} (MPI {v['standard']}, mpi4py {v['mpi4py']}), {v['thread_level']}, "
            f"libmpi {v['libmpi'] or 'not found in this process'}"
        )
    if name == "cuda_aware":
        answer = {True: "yes", False: "no", None: "unknown"}[v["aware"]]
        return f"{answer} for --device gpu ({v['reason']})"
    if name == "gpus":
        cupy = f"CuPy {v['cupy']}" if v["cupy"] else "CuPy not installed"
        cuda = (
            f", CUDA runtime {v['cuda_runtime']}, driver {v['cuda_driver']}"
            if v["cuda_runtime"]
            else ""
        )
        cvd = v["cuda_visible_devices"]
        seen = f"{v['visible']} visible" + (
            f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else ""
        )
        bound = f", binds GPU {v['bound']} ({v['name']})" if v["bound"] is not None else ""
        return f"{seen}{bound}; {cupy}{cuda}{fast_kernels(v)}"
    if name == "blas":
        env = ", ".join(f"{k}={v[k]}" for k in probes.THREAD_VARS if v[k] is not None)
        return (
            f"{v['library'] or 'unknown'}, hpcdl.train runs {v['threads']} thread(s) per rank "
            f"({v['reason']}); "
            f"{v['cores']} core(s) for this rank, {v['node_cores']} on the node; "
            f"{env or 'OMP_NUM_THREADS unset'}"
        )
    if name == "loader":
        return _loader_text(v)
    if name == "stager":
        return f"{v['path']} ({v['version']})" if v["path"] else "not found"
    if name == "stage_dir":
        where = v["path"] + f" ({v['origin']})"
        if "fs_type" not in v:
            return f"{where}: {'writable' if v.get('writable') else 'NOT writable'}"
        local = {"network": "NOT node-local", "memory": "node-local, in RAM", "local": "node-local"}
        return (
            f"{where}: {v['fs_type']} ({v['device']} at {v['mount_point']}), {local[v['kind']]}, "
            f"{binary_size(v['free_bytes'])} free of {binary_size(v['total_bytes'])}, "
            f"{'writable' if v['writable'] else 'NOT writable'}"
        )
    if name == "torch_engine":
        return _torch_engine_text(v)
    if name == "slurm":
        if not v["job_id"]:
            return "not in a Slurm job"
        return (
            f"job {v['job_id']}: SLURM_NTASKS={v['ntasks']}, SLURM_NNODES={v['nnodes']}, "
            f"SLURM_CPUS_PER_TASK={v['cpus_per_task']}"
        )
    return json.dumps(v)


def _torch_engine_text(v: dict) -> str:
    """The torch engine fact: which torch models hpcdl.train can train here."""
    if not v["torch"]:
        return (
            "torch not installed: --model FILE.py:FN of a torch.nn.Module needs pip install torch"
        )
    if not v["torchvision"]:
        return (
            f"torch {v['torch']}: --model FILE.py:FN of a torch.nn.Module trains; "
            "torchvision not installed (--model torchvision:NAME needs it)"
        )
    return (
        f"torch {v['torch']}, torchvision {v['torchvision']}: --model FILE.py:FN and "
        "torchvision:NAME train"
    )


def _loader_text(v: dict) -> str:
    """The loader fact: workers (and their cores), slots, shared memory, GPU decode."""
    how = "auto" if v["slots_default"] else "--prefetch"
    where = ""
    if "worker_cores" in v:
        where = f" on cores {v['worker_cores']} (the rank's: {v['rank_cores']})"
    return (
        f"{v['workers']} worker(s) per rank{where}, {v['slots']} batch slots ({how}) of "
        f"{binary_size(v['slot_bytes'])} (batch {v['batch']} x {'x'.join(map(str, v['shape']))}); "
        f"{binary_size(v['shm_free_bytes'])} free in {v['shm_dir']}; --decode gpu on the GPU: "
        f"{'yes' if v['gpu_decode'] else 'no'} ({v['gpu_decode_reason']})"
    )


def render(merged: dict[str, Any]) -> str:
    lines = [f"hpcdl doctor: {merged['world_size']} rank(s) on {merged['num_nodes']} node(s)"]
    for node in merged["nodes"]:
        lines.append(f"node {node['host']}, ranks {rank_ranges(node['ranks'])}")
        for name, label in LABELS.items():
            if name in node["facts"]:
                lines.append(f"  {label:<11} {describe(name, node['facts'][name])}")
            else:
                for rank, facts in node["per_rank"].items():
                    lines.append(f"  {label:<11} rank {rank}: {describe(name, facts[name])}")
    problems = merged["problems"]
    for p in problems:
        many = len(p["ranks"]) > 1 and merged["world_size"] > 1
        where = f" [ranks {rank_ranges(p['ranks'])}]" if many else ""
        lines.append(f"{p['level']}: {p['message']}{where}")
    errors = sum(p["level"] == ERROR for p in problems)
    warnings = sum(p["level"] == WARNING for p in problems)
    if problems:
        status = merged["status"]
        lines.append(
            f"hpcdl doctor: {errors} error(s), {warnings} warning(s); exit status {status}"
        )
    else:
        lines.append("hpcdl doctor: nothing to fix")
    return "\n".join(lines)


def fast_kernels(v: dict) -> str:
    """The cuDNN and --gpu-kernels part of the GPU line; empty without CuPy."""
    if not v["cupy"]:
        return ""
    cudnn = f"cuDNN {v['cudnn']}" if v.get("cudnn") else "cuDNN frontend not installed"
    graphs = "on" if v.get("gpu_kernels") else "off (--gpu-kernels or HPCDL_GPU_KERNELS=1)"
    tf32 = "; float32 on TF32 tensor cores (HPCDL_TF32)" if v.get("tf32") else ""
    same = "; deterministic cuDNN engines (HPCDL_DETERMINISTIC)" if v.get("deterministic") else ""
    tuned = v.get("autotune") or 0
    timed = (f"; cuDNN's first {tuned} engines timed per convolution (HPCDL_CUDNN_AUTOTUNE)"
             if tuned > 1 else "")  # fmt: skip
    half = (
        "; bf16/fp16 weight gradients in the format (HPCDL_HALF_WGRAD)"
        if v.get("half_wgrad")
        else ""
    )
    return f"; {cudnn}; fast kernels and CUDA graphs of the step {graphs}{tf32}{same}{timed}{half}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = check_flags(args)
    if bad:  # before MPI starts: every rank of a job finds the same, the first one says so
        if launcher_rank() == 0:
            print(f"hpcdl.doctor: error: {bad}", file=sys.stderr)
        return EXIT_ERRORS
    try:
        from hpcdl.comm.world import init_world  # noqa: PLC0415

        world = init_world()
    except Exception as exc:  # mpi4py without a loadable libmpi, or MPI_Init failing
        print(
            f"error: MPI does not start ({exc}); fix: install an MPI and reinstall mpi4py "
            "against it (pip install --no-binary mpi4py mpi4py), or load the site's MPI module",
            file=sys.stderr,
        )
        return EXIT_ERRORS
    report = rank_report(world, args.stage_dir, args)
    reports = world.comm.gather(report, root=0)
    status = None
    if world.is_root:
        merged = merge(reports)
        print(json.dumps(merged, indent=1) if args.json else render(merged), flush=True)
        status = merged["status"]
    return int(world.comm.bcast(status, root=0))


if __name__ == "__main__":
    from hpcdl import cli

    sys.exit(cli.run(main))
