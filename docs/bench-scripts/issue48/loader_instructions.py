"""Issue 48's loader A/B by instruction count (docs/PERFORMANCE.md, "The loader's work, counted"):
hpcdl.data.Loader over a JPEG folder (2 workers, 4 slots, rcrop224+flip, batches of 32), run
under valgrind's cachegrind with its children traced, once for FEW and once for MANY batches of
epoch 0; the difference divided by the extra images is each process's work per image: the
instructions, data reads and writes, and (with --cache-sim) simulated cache misses. These do not
depend on what else runs on the machine, where images/s on a shared VM do.

    python docs/bench-scripts/issue48/loader_instructions.py DATA [--cache-sim]

DATA: bench loader's 2048 JPEGs (/tmp/jpegs-fresh). To compare two trees, run it with each
side's interpreter from a directory that holds no hpcdl tree, as loader_ab.py says; each line
names the hpcdl it ran. Needs valgrind (Debian: apt-get install valgrind); takes about a minute
(three with --cache-sim).
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

FEW, MANY, BATCH = 2, 18, 32
COUNTERS = ("I refs", "D refs", "D1 misses", "LLd misses")


def load(data: str, batches: int) -> None:
    """The measured process: the loader gives `batches` batches of epoch 0."""
    import hpcdl  # noqa: PLC0415
    from hpcdl.data import open_dataset  # noqa: PLC0415
    from hpcdl.data.loader import Loader  # noqa: PLC0415
    from hpcdl.data.sampler import DistributedSampler  # noqa: PLC0415

    ds = open_dataset(data)
    order = DistributedSampler(len(ds), seed=0).batches(0, BATCH)[:batches]
    total = 0.0
    opts = dict(workers=2, prefetch=4, seed=0, augment="rcrop224+flip", timeout_s=600)
    with Loader(ds, BATCH, **opts) as loader:
        for x, _ in loader.iterate(order, 0):
            total += float(x.sum())
    print(f"{Path(hpcdl.__file__).parent}: {batches} batches, pixel sum {total:.6g}")


def counted(data: str, batches: int, cache_sim: bool) -> dict[str, list[int]]:
    """Counter -> values, per role ("rank", "worker"), of one run under cachegrind."""
    with tempfile.TemporaryDirectory() as logs:
        cmd = [
            "valgrind",
            "--tool=cachegrind",
            f"--cache-sim={'yes' if cache_sim else 'no'}",
            "--cachegrind-out-file=/dev/null",
            "--trace-children=yes",
            f"--log-file={logs}/%p.log",
            sys.executable,
            __file__,
            "--load",
            data,
            str(batches),
        ]
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip())
        found: dict[str, list[int]] = {}
        for log in sorted(Path(logs).glob("*.log")):
            text = log.read_text()
            role = "worker" if "hpcdl.data.worker" in text else "rank" if "--load" in text else ""
            for name in COUNTERS if role else ():
                m = re.search(rf"{name.replace(' ', ' +')}: +([\d,]+)", text)
                if m:
                    found.setdefault(f"{role} {name}", []).append(int(m[1].replace(",", "")))
        return found


def main(data: str, cache_sim: bool) -> None:
    few, many = counted(data, FEW, cache_sim), counted(data, MANY, cache_sim)
    images = (MANY - FEW) * BATCH
    for key in many:
        extra = sum(many[key]) - sum(few[key])
        print(f"{key} per image: {extra / images:,.0f}")


if __name__ == "__main__":
    if sys.argv[1] == "--load":
        load(sys.argv[2], int(sys.argv[3]))
    else:
        main(sys.argv[1], "--cache-sim" in sys.argv[2:])
