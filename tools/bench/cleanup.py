"""`python -m tools.bench cleanup`: how long the last job out waits for its staged copies to go.

The same generated tree is staged by hpcdl-stage three times (local source, one session, as in
training), and each copy is removed one way, in the same run:
- "rm -rf": `rm -rf` of the staged tree, the baseline;
- "manifest, in place": remove_created over the manifest where the copies are, what
  StageDirLease.release did before issue 29 while the job waited;
- "release": StageDirLease.release (NOTE [clean-up off the job's path]): the job waits only for
  the renames ("job waits"); the detached remover's time until the stage dir is gone is
  "until gone" (the stage dir empty: the bench made it, so hpcdl leaves it).
Every figure is wall seconds after os.sync(), so that writeback of the copies does not land in
the removal. The issue's goal: the job waits <= 10 s whatever was staged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from hpcdl.helpformat import HelpFormatter
from hpcdl.staging.layout import StageDir, remove_created
from hpcdl.staging.manifest import read_manifest
from hpcdl.staging.ownership import StageDirLease, data_key
from tools.bench.staging import make_tree, stager_command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench cleanup",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--files", type=int, default=126_000, help="files staged (default 126000)")
    p.add_argument("--size", type=int, default=1000, help="bytes per file (default 1000)")
    p.add_argument("--threads", type=int, default=8, help="hpcdl-stage copy threads")
    p.add_argument("--dir", help="scratch directory on the stage file system (default: $TMPDIR)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the remover")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    return p


def stage(src: Path, dst: Path, threads: int) -> None:
    subprocess.run(stager_command(src, dst, threads), check=True, stdout=subprocess.DEVNULL)
    os.sync()


def rm_rf(src: Path, dst: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    subprocess.run(["rm", "-rf", str(dst / data_key(src))], check=True)
    return {"job_waits_s": time.perf_counter() - t0}


def in_place(src: Path, dst: Path) -> dict[str, float]:
    records = read_manifest(StageDir(dst).manifest)
    t0 = time.perf_counter()
    remove_created(dst, records)
    return {"job_waits_s": time.perf_counter() - t0}


def release(src: Path, dst: Path, timeout: float) -> dict[str, float]:
    lease = StageDirLease.acquire(dst)  # the last (only) job on the stage dir
    t0 = time.perf_counter()
    lease.release(keep=False)
    waited = time.perf_counter() - t0
    while os.listdir(dst) and time.perf_counter() - t0 < timeout:  # the bench made dst
        time.sleep(0.05)
    gone = time.perf_counter() - t0
    if os.listdir(dst):
        raise RuntimeError(f"{dst} is not empty {timeout:.0f} s after the release")
    return {"job_waits_s": waited, "until_gone_s": gone}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    results: dict = {"files": a.files, "size": a.size, "rows": []}
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="hpcdl-bench-cleanup-") as tmp:
        base = Path(tmp)
        make_tree(base / "src", a.files, a.size)
        ways = [
            ("rm -rf", lambda d: rm_rf(base / "src", d)),
            ("manifest, in place (before)", lambda d: in_place(base / "src", d)),
            ("release (rename away)", lambda d: release(base / "src", d, a.timeout)),
        ]
        for i, (name, remove) in enumerate(ways):
            dst = base / f"stage{i}"
            stage(base / "src", dst, a.threads)
            figures = remove(dst)
            results["rows"].append({"way": name, **{k: round(v, 3) for k, v in figures.items()}})
    base_s = results["rows"][0]["job_waits_s"]
    print(f"clean-up of {a.files} staged files of {a.size} bytes (job waits / rm -rf):")
    for r in results["rows"]:
        gone = f", gone after {r['until_gone_s']:.2f} s" if "until_gone_s" in r else ""
        ratio = r["job_waits_s"] / max(base_s, 1e-9)
        r["vs_rm_rf"] = round(ratio, 3)
        print(f"  {r['way']:28s} job waits {r['job_waits_s']:8.2f} s ({ratio:6.3f} x){gone}")
    if a.json:
        print(json.dumps(results))
    return 0
