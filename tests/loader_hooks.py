"""Test hooks that loader worker processes import (tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import random
import time
from pathlib import Path


class SlowLocate:
    """`locate` for a Loader: the PFS path of file i after a random 0..max_s seconds sleep, so
    workers finish their batches out of order (the loader must keep the order anyway)."""

    def __init__(self, ds, max_s: float) -> None:
        self.root = str(ds.root)
        self.relpaths = [f.relpath for f in ds.files]
        self.max_s = max_s

    def __call__(self, file_id: int) -> Path:
        time.sleep(random.uniform(0, self.max_s))
        return Path(self.root) / self.relpaths[file_id]
