"""`python -m tools.bench shards`: the same images as an image folder and as tar shards (issue 62).

One data set of `--images` JPEGs of `--image-size` W x H (smooth noise plus grain, 10 classes),
written once as an image folder and converted with `python -m hpcdl.data convert folder SRC
OUT --to tar` into `--shards` WebDataset shards (cached in the bench cache). Three parts, each
alternating the two layouts `--rounds` times in the same run (the order flips every round):

(a) `--slow-fs MS,MBPS` (default 5,200): both layouts behind the slow read-only FUSE file system
    of tools.bench.slowfs, `mpirun -np --ranks python -m hpcdl.train --stage-dir ...` for
    `--epochs` epochs, each run with a fresh index cache (as a new user's first job): tar total
    / folder total (goal <= 0.3) and epoch 1 alone (goal <= 0.2).
(b) stage-only behind the same mount: `python -m hpcdl.stage --data TAR --stage-dir S` (fresh
    index cache) against `cp -r FOLDER`: cp time / stage time (goal >= 10).
(c) on the local disk, one loader of `--workers` workers and `--batch-size`, one epoch, images/s
    from the end of the first batch, `--augment none` (decode, centre crop to the image size,
    normalise): hpcdl's loader on the folder and on the shards (`hpcdl.bench train
    --measure-load`), and webdataset's WebLoader and wids.ShardListDataset + DataLoader on the
    same shards (tools.bench.wds_loaders; skipped, said once, without webdataset/wids/torch):
    tar / folder and tar / each webdataset loader (goals >= 1.0).

Without FUSE, (a) and (b) are skipped with one line saying why. `--json` prints one JSON object
last. Every ratio is reported per round and as its range.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.bench import synthetic
from hpcdl.bench import train as user_bench
from hpcdl.bench.launch import child_env
from tools.bench.slowfs import SlowFSOptions, mounted, unavailable
from tools.bench.staging import timed

PROG = "python -m tools.bench shards"
LAYOUTS = ("folder", "tar")
CLASSES = 10


def build_parser() -> argparse.ArgumentParser:
    ap = user_bench.build_parser(PROG)
    ap.description = __doc__.split("\n")[0]
    ap.set_defaults(synthetic=6000, ranks=2, workers=2, epochs=3, augment="rrc64+flip")
    ap.add_argument("--shards", type=int, default=24, help="tar shards of the data set")
    ap.add_argument("--jpeg-size", dest="image_wh", default="500x375", help="WxH of each JPEG")
    ap.add_argument("--slow-fs", default="5,200", help="MS,MBPS of the slow FUSE file system")
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds of each part")
    ap.add_argument(
        "--parts", default="train,stage,local", help="which of train (a), stage (b), local (c)"
    )
    ap.add_argument("--dir", help="scratch directory (default: a temporary one)")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.wh = tuple(int(v) for v in args.image_wh.split("x"))
        latency_ms, mbps = (float(v) for v in args.slow_fs.split(","))
    except ValueError:
        ap.error(f"--jpeg-size takes WxH (500x375), --slow-fs MS,MBPS (5,200); got "
                 f"{args.image_wh!r}, {args.slow_fs!r}")  # fmt: skip
    args.slow_fs_options = SlowFSOptions(latency_ms, mbps)
    args.parts = set(args.parts.split(","))
    if not args.parts <= {"train", "stage", "local"} or args.rounds < 1 or args.shards < 1:
        ap.error("--parts takes train,stage,local; --rounds and --shards must be >= 1")
    if args.synthetic < args.shards:
        ap.error("--synthetic must be at least --shards")
    if args.dir is not None and not Path(args.dir).is_dir():
        ap.error(f"--dir {args.dir} is not an existing directory; give one, or leave it out")
    return args


def make_images(root: Path, count: int, wh: tuple[int, int]) -> None:
    """root/classK/NNNNNN.jpg: count JPEGs of W x H, image i of class i % 10."""
    rng = np.random.default_rng(0)
    w, h = wh
    for i in range(count):
        coarse = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        pixels = np.repeat(np.repeat(coarse, 8, axis=0), 8, axis=1)[:h, :w].astype(np.int16)
        pixels += rng.integers(-12, 13, pixels.shape, dtype=np.int16)
        folder = root / f"class{i % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        synthetic.save(folder / f"{i:06d}.jpg", np.clip(pixels, 0, 255).astype(np.uint8))


def ensure_data(args: argparse.Namespace) -> Path:
    """The cached base holding folder/ and tar/ of the same images (made once)."""
    w, h = args.wh
    base = user_bench.private_cache_dir() / f"shards-{args.synthetic}-{w}x{h}-{args.shards}"
    if (base / ".complete").exists():
        return base
    print(f"making {args.synthetic} JPEGs of {w}x{h} and {args.shards} tar shards in {base}",
          flush=True)  # fmt: skip
    work = base.with_name(f"{base.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    make_images(work / "folder", args.synthetic, args.wh)
    per_shard = -(-args.synthetic // args.shards)
    subprocess.run([sys.executable, "-m", "hpcdl.data", "convert", "folder", str(work / "folder"),
                    str(work / "tar"), "--to", "tar", "--shard-size", str(per_shard)],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    (work / ".complete").touch()
    shutil.rmtree(base, ignore_errors=True)
    work.rename(base)
    return base


def data_facts(base: Path) -> dict[str, Any]:
    jpegs = list((base / "folder").rglob("*.jpg"))
    shards = sorted((base / "tar").glob("*.tar"))
    return {
        "images": len(jpegs),
        "image_bytes": sum(p.stat().st_size for p in jpegs),
        "shards": len(shards),
        "shard_bytes": sum(p.stat().st_size for p in shards),
    }


def order(round_: int) -> tuple[str, ...]:
    """The layouts of one round: folder first in even rounds, tar first in odd ones."""
    return LAYOUTS if round_ % 2 == 0 else LAYOUTS[::-1]


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "values": values}


# --- (a) training with staging behind the slow file system -----------------------------------


def train_part(args: argparse.Namespace, mount: Path, scratch: Path) -> dict[str, Any]:
    """hpcdl.train with staging on each layout, alternated; totals, epochs and their ratios."""
    runs: dict[str, list[dict]] = {k: [] for k in LAYOUTS}
    for r in range(args.rounds):
        for kind in order(r):
            os.environ["XDG_CACHE_HOME"] = str(scratch / f"cache-train-{kind}-{r}")
            run, wall = user_bench.run_training(
                args, (str(mount / kind), None), True, scratch / f"train-{kind}-{r}.jsonl"
            )
            runs[kind].append(user_bench.summarise(run, None, wall))
            seconds = runs[kind][-1]["epoch_seconds"]
            print(f"  (a) round {r + 1} {kind:>6}: {wall:7.2f} s total, epochs "
                  f"{', '.join(f'{s:.2f}' for s in seconds)} s", flush=True)  # fmt: skip
    total = [t["wall_s"] / f["wall_s"] for f, t in zip(runs["folder"], runs["tar"], strict=True)]
    first = [
        t["epoch_seconds"][0] / f["epoch_seconds"][0]
        for f, t in zip(runs["folder"], runs["tar"], strict=True)
    ]
    return {"runs": runs, "tar_over_folder_total": spread(total),
            "tar_over_folder_epoch1": spread(first)}  # fmt: skip


# --- (b) stage-only of the shards against cp -r of the folder ---------------------------------


def stage_part(args: argparse.Namespace, mount: Path, scratch: Path) -> dict[str, Any]:
    """`python -m hpcdl.stage` of the shards (fresh index cache) vs `cp -r` of the folder."""
    env = {k: v for k, v in os.environ.items() if k != user_bench.EMULATE_ENV}
    seconds: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    for r in range(args.rounds):
        for kind in order(r):
            dst = scratch / f"stage-{kind}-{r}"
            if kind == "folder":
                wall, _ = timed(["cp", "-r", str(mount / "folder"), str(dst)])
            else:
                cmd = [sys.executable, "-m", "hpcdl.stage", "--data", str(mount / "tar"),
                       "--stage-dir", str(dst), "--batch-size", str(args.batch_size),
                       "--ranks-per-node", str(args.ranks), "--quiet"]  # fmt: skip
                wall, _ = timed(cmd, dict(env, XDG_CACHE_HOME=str(scratch / f"cache-st-{r}")))
            seconds[kind].append(wall)
            shutil.rmtree(dst, ignore_errors=True)
            name = "cp -r folder" if kind == "folder" else "hpcdl.stage tar"
            print(f"  (b) round {r + 1} {name:>16}: {wall:7.2f} s", flush=True)
    ratio = [c / s for c, s in zip(seconds["folder"], seconds["tar"], strict=True)]
    return {"cp_folder_s": seconds["folder"], "stage_tar_s": seconds["tar"],
            "cp_over_stage": spread(ratio)}  # fmt: skip


# --- (c) the loaders on the local disk --------------------------------------------------------


def hpcdl_rate(args: argparse.Namespace, root: Path) -> float | None:
    """images/s of hpcdl's loader (one rank, `--augment none`) over one epoch of root."""
    one = copy.copy(args)
    one.ranks = 1
    seconds = user_bench.measure_load(one, str(root))
    return None if seconds is None else args.batch_size / seconds


def wds_rate(args: argparse.Namespace, root: Path, loader: str, crop: list[int]) -> float | None:
    """images/s of one of webdataset's loaders (tools.bench.wds_loaders); None if it failed."""
    cmd = [sys.executable, "-m", "tools.bench.wds_loaders", "--data", str(root), "--loader",
           loader, "--workers", str(args.workers), "--batch-size", str(args.batch_size),
           "--crop", f"{crop[0]},{crop[1]}", "--json"]  # fmt: skip
    done = subprocess.run(
        cmd, env=child_env(1, "cpu"), capture_output=True, text=True, timeout=args.timeout
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"{PROG}: {loader} skipped: {tail}", file=sys.stderr)
        return None
    return json.loads(done.stdout.splitlines()[-1])["images_per_s"]


def local_part(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """images/s of hpcdl (folder, tar) and webdataset's loaders (tar), alternated per round."""
    crop = [args.wh[1], args.wh[0]]  # H, W: the whole image, hpcdl's --augment none
    rates: dict[str, list] = {"folder": [], "tar": [], "webloader": [], "wids": []}
    for r in range(args.rounds):
        sides = ("folder", "tar", "webloader", "wids")
        for side in sides if r % 2 == 0 else sides[::-1]:
            if side in LAYOUTS:
                rate = hpcdl_rate(args, base / side)
            else:
                rate = wds_rate(args, base / "tar", side, crop)
            rates[side].append(rate)
            shown = "n/a" if rate is None else f"{rate:.1f}"
            print(f"  (c) round {r + 1} {side:>9}: {shown} images/s", flush=True)
    out: dict[str, Any] = {"images_per_s": rates}
    for peer in ("folder", "webloader", "wids"):
        pairs = [(t, p) for t, p in zip(rates["tar"], rates[peer], strict=True) if t and p]
        if pairs:
            out[f"tar_over_{peer}"] = spread([t / p for t, p in pairs])
    return out


# --- the run ----------------------------------------------------------------------------------


def run_parts(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """Each asked part; the slow-FS ones share one mount of base (folder/ and tar/)."""
    results: dict[str, Any] = {"data": data_facts(base)}
    with ExitStack() as stack:
        scratch = Path(tempfile.mkdtemp(prefix="hpcdl-bench-shards-", dir=args.dir))
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        keep_cache = os.environ.get("XDG_CACHE_HOME")
        stack.callback(_restore_env, "XDG_CACHE_HOME", keep_cache)
        if args.parts & {"train", "stage"}:
            why = unavailable()
            if why:
                print(f"{PROG}: (a) and (b) skipped: {why}", file=sys.stderr)
                results["slow_fs_skipped"] = why
            else:
                (scratch / "pfs").mkdir()
                with mounted(base, scratch / "pfs", args.slow_fs_options) as pfs:
                    if "train" in args.parts:
                        results["train"] = train_part(args, pfs.mountpoint, scratch)
                    if "stage" in args.parts:
                        results["stage"] = stage_part(args, pfs.mountpoint, scratch)
        _restore_env("XDG_CACHE_HOME", keep_cache)
        if "local" in args.parts:
            os.environ["XDG_CACHE_HOME"] = str(scratch / "cache-local")
            results["local"] = local_part(args, base)
    return results


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def print_ratios(results: dict[str, Any]) -> None:
    goals = [("train", "tar_over_folder_total", "tar / folder, 3 epochs with staging", "<= 0.3"),
             ("train", "tar_over_folder_epoch1", "tar / folder, epoch 1", "<= 0.2"),
             ("stage", "cp_over_stage", "cp -r folder / hpcdl.stage tar", ">= 10"),
             ("local", "tar_over_folder", "images/s tar / folder", ">= 1.0"),
             ("local", "tar_over_webloader", "images/s tar / WebLoader", ">= 1.0"),
             ("local", "tar_over_wids", "images/s tar / wids + DataLoader", ">= 1.0")]  # fmt: skip
    for part, key, label, goal in goals:
        if key in results.get(part, {}):
            r = results[part][key]
            print(f"{label}: {r['min']:.2f}-{r['max']:.2f} (goal {goal})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        base = ensure_data(args)
    except (user_bench.CacheError, subprocess.CalledProcessError) as exc:
        print(f"{PROG}: cannot make the data set: {exc}", file=sys.stderr)
        return 2
    facts = data_facts(base)
    print(f"{PROG}: {facts['images']} JPEGs ({facts['image_bytes'] / 1e6:.1f} MB) and "
          f"{facts['shards']} shards ({facts['shard_bytes'] / 1e6:.1f} MB) in {base}; "
          f"{args.ranks} rank(s) x {args.workers} worker(s), batch {args.batch_size}, "
          f"{args.rounds} round(s)", flush=True)  # fmt: skip
    try:
        results = run_parts(args, base)
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    print_ratios(results)
    if args.json:
        skip = ("json", "slow_fs_options", "parts", "wh")
        config = {k: v for k, v in vars(args).items() if k not in skip}
        config["parts"] = sorted(args.parts)
        print(json.dumps({"config": config, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
