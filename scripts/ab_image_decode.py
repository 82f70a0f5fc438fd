"""A/B of the one image decode: `decode_image` at a git revision (from hpcdl/data/imagefolder.py,
where it lived until image_file.py) against the checkout's hpcdl.data.image_file.decode_image,
on the same in-memory JPEGs, rounds alternated; prints the medians and new/old per round.

    python scripts/ab_image_decode.py c60236f [ROUNDS]
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from hpcdl.data.image_file import BadSampleAt
from hpcdl.data.image_file import decode_image as new_decode

REPO = Path(__file__).resolve().parents[1]


def old_decode(rev: str) -> Any:
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:hpcdl/data/imagefolder.py"],
                            check=True, capture_output=True, text=True).stdout  # fmt: skip
    found = re.search(r"^def decode_image\(.*?^    return arr, scale$", source, re.S | re.M)
    if found is None:
        sys.exit(f"{rev}: hpcdl/data/imagefolder.py holds no decode_image")
    space = {"Any": Any, "np": np, "BadSampleAt": BadSampleAt}
    exec("from __future__ import annotations\n" + found.group(0), space)  # noqa: S102
    return space["decode_image"]


def jpegs(n: int = 200) -> list[bytes]:
    rng, out = np.random.default_rng(0), []
    for _ in range(n):
        buf = io.BytesIO()
        pixels = rng.integers(0, 256, (375, 500, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def seconds(decode: Any, blobs: list[bytes]) -> float:
    t0 = time.perf_counter()
    for i, blob in enumerate(blobs):
        where = BadSampleAt(Path("x"), i)
        decode(io.BytesIO(blob), "RGB", (375, 500), (224, 224), (10, 20, 300, 400), where)
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    rev, rounds = argv[0], int(argv[1]) if len(argv) > 1 else 9
    old, blobs = old_decode(rev), jpegs()
    times: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(rounds):
        pair = [("old", old), ("new", new_decode)]
        for name, decode in pair if r % 2 == 0 else pair[::-1]:
            times[name].append(seconds(decode, blobs))
    a, b = float(np.median(times["old"])), float(np.median(times["new"]))
    ratios = [round(n / o, 3) for n, o in zip(times["new"], times["old"], strict=True)]
    print(f"200 JPEGs of 500x375, draft 224, a box crop; median s: {rev} {a:.4f}, checkout "
          f"{b:.4f}; checkout/{rev} {b / a:.3f}; per round {ratios}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
