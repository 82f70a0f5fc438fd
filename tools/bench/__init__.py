"""Harnesses and issue reproductions: `python -m tools.bench NAME ...` (tools/bench/__main__.py).

What a user runs on a cluster is `python -m hpcdl.bench`; these need root (the emulated
cluster, the FUSE file system), a checkout, or PyTorch as the peer, or they reproduce one
issue's figures (docs/PERFORMANCE.md). The emulated cluster (cluster.py) and the slow file
system (slowfs.py) are also fixtures of the tests.
"""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The harnesses start some of their own modules in child processes (`python -m
# tools.bench.slowfs`, `.torch_ddp`, `.torch_folder`, `.memory`), from whatever directory the
# caller is in: the children find `tools` through PYTHONPATH, which every child inherits.
_path = os.environ.get("PYTHONPATH", "")
if str(REPO) not in _path.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), _path) if p)
