"""`python -m tools.bench memory`: memory per process kind, hpcdl vs PyTorch's DataLoader.

    python -m tools.bench memory [--files 1281000] [--ranks 2] [--workers 3] [--json]

On a generated ImageNet-sized tree of image names (--classes directories; each class's names
are hard links to one small JPEG, as ext4 allows 65,000 links per file), generated once into
--cache-dir and reused, it runs in the same run:

- hpcdl: `mpirun -np R python -m hpcdl.train --model M --augment rrc64+flip --workers K
  --stage-dir S --max-steps N` (the issue's command, cut short);
- PyTorch: `mpirun -np R` processes that each iterate a DataLoader with K forked workers over
  an ImageFolder-style list of (path, label) pairs (tools.bench.torch_folder) for --batches
  batches, as a DDP job's loaders do;

and both again on a --small-files tree, so that the difference is what the tree's size costs.
Every second it reads /proc/PID/smaps_rollup of every process of the runs and reports, per
process kind (rank, loader worker, stager; DataLoader main, DataLoader worker), the last PSS
(proportional set size: shared pages split among their users) and USS (private memory,
Private_Clean + Private_Dirty) seen before the process ended, in MB (1e6 bytes), and the
summed PSS of the mapped index file (/proc/PID/smaps): what the index costs the node. Needs Linux,
mpirun and, for the PyTorch side, `torch` (--skip-torch without it).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from hpcdl.bench import synthetic
from hpcdl.bench.launch import mpirun_command
from hpcdl.helpformat import HelpFormatter

INDEX_SUFFIX = ".hpcdl-index"  # the image-folder index file (hpcdl.data.imagefolder)
KINDS = ("rank", "worker", "stager", "dataloader main", "dataloader worker")
_IMAGE_SIDE = 80  # > 64: rrc64 crops it; the centre crop of the DataLoader side is 64 x 64


def make_names_tree(root: Path, files: int, classes: int) -> None:
    """root/cNNNN/cNNNN_NNNNNNN.JPEG: `files` names in `classes` directories, each class's
    names hard links to the class's one JPEG. Built beside root and renamed into place, so a
    tree at root is always whole."""
    if root.is_dir():
        return
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    rng = np.random.default_rng(0)
    per_class = np.full(classes, files // classes)
    per_class[: files % classes] += 1
    for c, count in enumerate(per_class.tolist()):
        d = tmp / f"c{c:04d}"
        d.mkdir(mode=0o755)
        first = d / f"c{c:04d}_{0:07d}.JPEG"
        pixels = rng.integers(0, 256, (_IMAGE_SIDE, _IMAGE_SIDE, 3), dtype=np.uint8)
        first.write_bytes(synthetic.encode(pixels, "jpg", quality=75))  # PIL's default
        os.chmod(first, 0o644)
        for i in range(1, count):
            os.link(first, d / f"c{c:04d}_{i:07d}.JPEG")
    os.chmod(tmp, 0o755)
    os.rename(tmp, root)


def make_tar_names(root: Path, files: int, classes: int, shards: int) -> None:
    """root/shard-NNNNNN.tar (WebDataset) and root/classes.json: `shards` hard links to one
    shard of ceil(files / shards) samples (KEY.jpg, one small JPEG per sample, and KEY.cls,
    label KEY % classes): an ImageNet-sized shard set whose index reads as much as a real one
    (every header, every label, each image's first 4 KB). Built beside root, renamed in."""
    if root.is_dir():
        return
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (_IMAGE_SIDE, _IMAGE_SIDE, 3), dtype=np.uint8)
    jpeg = synthetic.encode(pixels, "jpg", quality=75)
    first = tmp / "shard-000000.tar"
    with tarfile.open(first, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key in range(-(-files // shards)):
            for name, data in (
                (f"{key:07d}.jpg", jpeg),
                (f"{key:07d}.cls", b"%d" % (key % classes)),
            ):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o444
                tar.addfile(info, io.BytesIO(data))
    for s in range(1, shards):
        os.link(first, tmp / f"shard-{s:06d}.tar")
    (tmp / "classes.json").write_text(json.dumps([f"c{c:04d}" for c in range(classes)]) + "\n")
    os.chmod(tmp, 0o755)
    os.rename(tmp, root)


def smaps_rollup(pid: int) -> tuple[int, int] | None:
    """(PSS, USS) of pid in bytes; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        kb[name] = int(rest.split()[0])
    return kb["Pss"] * 1024, (kb["Private_Clean"] + kb["Private_Dirty"]) * 1024


def mapping(pid: int, suffix: str) -> dict[str, int] | None:
    """The /proc/PID/smaps fields (kB) of pid's mappings of files whose path ends with suffix,
    summed; None when there is none (or pid is gone)."""
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return None
    found, inside, fields = False, False, {}
    for line in lines:
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
            inside = len(head) >= 6 and head[-1].endswith(suffix)
            found = found or inside
        elif inside and line.endswith(" kB"):
            name, value = line.split(":")
            fields[name] = fields.get(name, 0) + int(value.split()[0])
    return fields if found else None


def descendants(pid: int) -> list[int]:
    """Every process below pid (children, their children, ...)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += map(int, kids)
        todo += map(int, kids)
    return out


def kind_of(pid: int) -> str | None:
    """Which KINDS pid is (None: the launcher's own processes)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        parent_cmd = Path(f"/proc/{parent}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return None
    text = b" ".join(cmd)
    if b"hpcdl.data.worker" in text:
        return "worker"
    if cmd[0].endswith(b"hpcdl-stage"):
        return "stager"
    if b"hpcdl.train" in text:
        return "rank"
    if b"--torch-child" in text:  # forked workers run the same command line as their main
        forked = parent_cmd.split(b"\0")[1:3] == [b"-m", b"tools.bench.memory"]
        return "dataloader worker" if forked else "dataloader main"
    return None


def watch(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, list[tuple]]:
    """Run cmd; the last (PSS, USS, PSS of the mapped index file) of each process of each
    kind, sampled every second."""
    last: dict[int, tuple[str, tuple]] = {}
    with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            for pid in descendants(proc.pid):
                kind, mem = kind_of(pid), smaps_rollup(pid)
                index = mapping(pid, INDEX_SUFFIX) if kind is not None else None
                if kind is not None and mem is not None:
                    last[pid] = (kind, (*mem, 1024 * index["Pss"] if index else 0))
            time.sleep(1.0)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{tail}")
    by_kind: dict[str, list[tuple]] = {}
    for kind, mem in last.values():
        by_kind.setdefault(kind, []).append(mem)
    return by_kind


def hpcdl_command(a: argparse.Namespace, tree: Path, stage: Path) -> list[str]:
    return [
        *mpirun_command(a.ranks, oversubscribe=True),
        sys.executable,
        "-m",
        "hpcdl.train",
        "--data",
        str(tree),
        "--model",
        a.model,
        "--augment",
        "rrc64+flip",
        "--workers",
        str(a.workers),
        "--batch-size",
        str(a.batch_size),
        "--max-steps",
        str(a.steps),
        "--stage-dir",
        str(stage),
        "--stage-capacity",
        a.stage_capacity,
        "--quiet",
    ]


def torch_command(a: argparse.Namespace, tree: Path) -> list[str]:
    child = [sys.executable, "-m", "tools.bench.memory", "--torch-child", str(tree)]
    mpirun = mpirun_command(a.ranks, oversubscribe=True)
    return [*mpirun, *child, "--workers", str(a.workers), "--batches", str(a.batches)]


def torch_child(tree: Path, workers: int, batches: int, batch_size: int = 32) -> int:
    """One DataLoader process: `batches` batches of 64 x 64 centre crops, then a pause so
    that the sampler sees the workers in their steady state."""
    import torch  # noqa: PLC0415
    from torch.utils.data import DataLoader  # noqa: PLC0415

    from tools.bench.torch_folder import CentreCropFolder  # noqa: PLC0415

    torch.set_num_threads(1)
    ds = CentreCropFolder(tree, (64, 64))
    loader = DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    for i, _ in enumerate(loader):
        if i + 1 == batches:
            break
    time.sleep(3.0)
    return 0


def summarize(by_kind: dict[str, list[tuple]]) -> dict[str, dict]:
    """Per kind: processes, PSS and USS per process (min..max), all in MB, the sum of their PSS
    and of the PSS of their mappings of the index file."""
    out = {}
    for kind in KINDS:
        mems = by_kind.get(kind)
        if not mems:
            continue
        pss = [m[0] / 1e6 for m in mems]
        uss = [m[1] / 1e6 for m in mems]
        out[kind] = dict(
            processes=len(mems),
            pss_mb=[round(min(pss), 1), round(max(pss), 1)],
            uss_mb=[round(min(uss), 1), round(max(uss), 1)],
            pss_total_mb=round(sum(pss), 1),
            index_pss_total_mb=round(sum(m[2] for m in mems) / 1e6, 1),
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench memory",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    a = p.add_argument
    a("--files", type=int, default=1_281_000, help="image names in the large tree")
    a("--small-files", type=int, default=1000, help="image names in the reference tree")
    a("--classes", type=int, default=1000, help="class directories of the large tree")
    a("--ranks", type=int, default=2, help="training ranks (and DataLoader processes)")
    a("--workers", type=int, default=3, help="loader workers per rank")
    a("--model", default="resnet18", help="hpcdl model of the training run")
    a("--batch-size", type=int, default=32, help="per-rank batch size")
    a("--steps", type=int, default=20, help="training steps of the hpcdl run")
    a("--batches", type=int, default=100, help="DataLoader batches per process")
    a("--stage-capacity", default="100M", help="--stage-capacity of the hpcdl run")
    a(
        "--layout",
        choices=("folder", "tar"),
        default="folder",
        help="folder: trees of names; tar: --shards hard-linked tar shards of as many samples "
        "(hpcdl only); every hpcdl run with a fresh index cache: the first job on the data set, "
        "which builds the index",
    )
    a("--shards", type=int, default=1024, help="--layout tar: shards of the large set")
    a("--make-only", action="store_true", help="make the data sets in --cache-dir, print them")
    a("--skip-torch", action="store_true", help="only hpcdl (no PyTorch installed)")
    a("--skip-small", action="store_true", help="only the large tree")
    a(
        "--cache-dir",
        help="where the trees are generated once and reused "
        "(default: $XDG_CACHE_HOME/hpcdl-bench, else ~/.cache/hpcdl-bench)",
    )
    a("--json", action="store_true", help="last line: one JSON object")
    a("--torch-child", metavar="TREE", help="internal: be one DataLoader process over TREE")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.torch_child:
        return torch_child(Path(a.torch_child), a.workers, a.batches)
    cache = Path(
        a.cache_dir
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcdl-bench"
    )
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    sizes = [(a.files, a.classes)] + ([] if a.skip_small else [(a.small_files, 10)])
    results: dict = {"ranks": a.ranks, "workers": a.workers, "trees": []}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    for files, classes in sizes:
        t0 = time.perf_counter()
        tree = make_data(a, cache, files, classes)
        row: dict = {"files": files, "tree": str(tree), "tree_s": time.perf_counter() - t0}
        if a.make_only:
            print(f"{tree}: made or found in {row['tree_s']:.1f} s")
            continue
        with tempfile.TemporaryDirectory(prefix="hpcdl-bench-memory-") as tmp:
            log = cache / "last-run.log"  # kept: a failed run's whole output
            run_env = dict(env, XDG_CACHE_HOME=str(Path(tmp) / "xdg"))  # the first job's index
            t0 = time.perf_counter()
            cmd = hpcdl_command(a, tree, Path(tmp) / "stage")
            row["hpcdl"] = summarize(watch(cmd, run_env, log))
            row["hpcdl_s"] = round(time.perf_counter() - t0, 1)
            if not a.skip_torch and a.layout == "folder":
                t0 = time.perf_counter()
                row["torch"] = summarize(watch(torch_command(a, tree), env, log))
                row["torch_s"] = round(time.perf_counter() - t0, 1)
        results["trees"].append(row)
        print_tree(row)
    if a.json:
        print(json.dumps(results))
    return 0


def make_data(a: argparse.Namespace, cache: Path, files: int, classes: int) -> Path:
    """The --layout data set of `files` samples in cache (made once); its path."""
    if a.layout == "folder":
        tree = cache / f"names-{files}x{classes}"
        make_names_tree(tree, files, classes)
        return tree
    shards = a.shards if files == a.files else max(1, a.shards * files // a.files)
    tree = cache / f"tar-names-{files}x{classes}-{shards}"
    make_tar_names(tree, files, classes, shards)
    return tree


def print_tree(row: dict) -> None:
    print(f"{row['files']} image names ({row['tree']}):")
    for side in ("hpcdl", "torch"):
        for kind, r in row.get(side, {}).items():
            pss, uss = r["pss_mb"], r["uss_mb"]
            print(
                f"  {kind:<18} {r['processes']:2d} x  PSS {pss[0]:7.1f}..{pss[1]:7.1f} MB  "
                f"USS {uss[0]:7.1f}..{uss[1]:7.1f} MB  (PSS sum {r['pss_total_mb']:7.1f} MB, "
                f"of the index file {r['index_pss_total_mb']:5.1f} MB)"
            )
        if side in row:
            print(f"  {side} run: {row[side + '_s']} s")


if __name__ == "__main__":
    sys.exit(main())
