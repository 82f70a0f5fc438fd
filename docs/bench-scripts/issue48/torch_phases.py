"""Issue 48: where examples/torch_ddp.py's time goes with hpcdl.torch behind the slow file system
(docs/PERFORMANCE.md, "hpcdl.train and hpcdl.torch behind the slow FS, 68caa3e against main").

Mounts the data behind the slow file system (5 ms per open, 200 MB/s) as `tools.bench train
--torch-loader` does, builds each side's index once, then runs the example (hpcdl.torch.Loader,
staging on, --model linear, 3 epochs, 2 workers, batch 32) under `mpirun -np 1`, the sides
alternated, and prints the wall seconds and the seconds since start at each phase: torch and
hpcdl imported, the process group, Loader(), DistributedDataParallel(), each epoch's first
batch and end; at DistributedDataParallel()'s start and end also the CPU seconds so far of the
rank's busy threads (T:) and of its children (C:, the stager and the loader workers), from /proc.

    python docs/bench-scripts/issue48/torch_phases.py ROUNDS DATA OLD_PYTHON OLD_TREE OLD_STAGER

Run from the repository root with main's interpreter; DATA is the bench's synthetic folder
(/tmp/hpcdl-bench-data-0/synthetic-6000-jpg-32/train); OLD_*: the other side's interpreter,
checkout and hpcdl-stage (see loader_ab.py for its venv).
"""

import argparse
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

T0 = time.perf_counter()
REPO = Path(__file__).resolve().parents[3]


def _cpu(stat: Path) -> tuple[str, int, float]:
    """(name, parent pid, user + system CPU seconds) from a /proc stat file."""
    head, rest = stat.read_text().rsplit(")", 1)
    fields = rest.split()
    ticks = int(fields[11]) + int(fields[12])
    return head.split("(", 1)[1], int(fields[1]), ticks / os.sysconf("SC_CLK_TCK")


def cpu_so_far() -> str:
    """CPU seconds of this process's threads that used over 0.05 s, and of its children."""
    me, out = os.getpid(), []
    for task in Path(f"/proc/{me}/task").iterdir():
        name, _, seconds = _cpu(task / "stat")
        if seconds > 0.05:
            out.append(f"T:{name}={seconds:.2f}")
    for proc in Path("/proc").iterdir():
        try:
            name, parent, seconds = _cpu(proc / "stat") if proc.name.isdigit() else ("", 0, 0)
        except OSError:  # ended meanwhile
            continue
        if parent == me:
            out.append(f"C:{name}={seconds:.2f}")
    return " ".join(out)


def stamp(what: str, cpu: bool = False) -> None:
    extra = f" [{cpu_so_far()}]" if cpu else ""
    print(f"PHASE {what} {time.perf_counter() - T0:.3f}{extra}", file=sys.stderr, flush=True)


def wrapped(script: str, argv: list[str]) -> None:
    """Inside the rank: run script with stamps around the phases."""
    import torch.distributed as dist  # noqa: PLC0415
    import torch.nn.parallel as parallel  # noqa: PLC0415

    stamp("torch imported")
    import hpcdl.torch  # noqa: PLC0415

    stamp("hpcdl.torch imported")

    def around(owner, name: str, label: str, cpu: bool = False) -> None:
        inner = getattr(owner, name)

        def timed(*a, **k):
            stamp(f"{label} start", cpu)
            out = inner(*a, **k)
            stamp(f"{label} end", cpu)
            return out

        setattr(owner, name, timed)

    around(dist, "init_process_group", "process group")
    around(hpcdl.torch.Loader, "__init__", "Loader()")
    around(parallel.DistributedDataParallel, "__init__", "DDP()", cpu=True)
    epochs = hpcdl.torch.Loader.__iter__

    def iterate(self):
        for i, batch in enumerate(epochs(self)):
            if i == 0:
                stamp("first batch")
            yield batch
        stamp("epoch end")

    hpcdl.torch.Loader.__iter__ = iterate
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        stamp("script end")


def run(side: str, python: str, tree: str, env: dict, data: str, stage: Path) -> None:
    from hpcdl.bench.launch import child_env, mpirun_command  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    example = f"{tree}/examples/torch_ddp.py"
    flags = "--epochs 3 --batch-size 32 --workers 2 --augment none --model linear".split()
    cmd = [*mpirun_command(1), python, __file__, "--wrap", example, "--data", data, *flags]
    cmd += ["--stage-dir", str(stage)]
    env = child_env(1, "cpu") | {"MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"} | env
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    wall = time.perf_counter() - start
    phases = [line[6:] for line in done.stderr.splitlines() if line.startswith("PHASE ")]
    print(f"{side} rc={done.returncode} wall={wall:.2f} | " + " | ".join(phases), flush=True)


def main(rounds: int, data: str, old_python: str, old_tree: str, old_stager: str) -> None:
    sys.path.insert(0, str(REPO))
    from tools.bench import peers  # noqa: PLC0415  (sets PYTHONPATH to this checkout)
    from tools.bench.slowfs import SlowFSOptions  # noqa: PLC0415

    # the old side: its own tree and stager, main's mpirun after its own bin
    path = os.pathsep.join([str(Path(old_python).parent), str(Path(sys.executable).parent)])
    old_env = {"PYTHONPATH": old_tree, "HPCDL_STAGE_BIN": old_stager}
    old_env["PATH"] = f"{path}{os.pathsep}{os.environ['PATH']}"
    sides = {
        "old": (old_python, old_tree, old_env),
        "main": (sys.executable, str(REPO), {}),
    }
    with ExitStack() as stack:
        scratch = Path(tempfile.mkdtemp(prefix="torch-phases-"))
        args = argparse.Namespace(slow_fs_options=SlowFSOptions(5.0, 200.0))
        mount = str(peers.mount_data(stack, args, data, scratch).mountpoint)
        for python, tree, env in sides.values():  # each side's index, built once, off the clock
            code = f"from hpcdl.data import open_dataset; open_dataset({mount!r})"
            subprocess.run([python, "-c", code], cwd=tree, env=os.environ | env, check=True)
        for r in range(rounds):
            for side, (python, tree, env) in sides.items():
                run(side, python, tree, env, mount, scratch / f"stage-{side}-{r}")


if __name__ == "__main__":
    if sys.argv[1] == "--wrap":
        wrapped(sys.argv[2], sys.argv[3:])
    else:
        main(int(sys.argv[1]), *sys.argv[2:6])
