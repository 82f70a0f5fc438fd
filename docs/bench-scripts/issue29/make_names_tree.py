"""An ImageNet-1k-sized tree of names: 1,000 class dirs x 1,281 hard links to one JPEG each."""

import os
import sys

import numpy as np
from PIL import Image

root = sys.argv[1]
os.makedirs(root, exist_ok=True)
src = os.path.join(root, ".src")
os.makedirs(src, exist_ok=True)
rng = np.random.default_rng(0)
for c in range(1000):
    name = f"n{c:08d}"
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    one = os.path.join(src, f"{name}.JPEG")
    h, w = 64 + c % 37, 64 + c % 53
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(one, quality=90)
    for i in range(1281):
        os.link(one, os.path.join(d, f"{name}_{i}.JPEG"))
print("done")
