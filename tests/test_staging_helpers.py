"""Shared fixtures of the staging tests: small real data sets on disk."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hpcdl.data.dataset import FileTable


class ShardDataset:
    """Minimal data set per docs/internals.md: `per_file` consecutive samples per file."""

    def __init__(self, root: Path, files: list[str], per_file: int = 1):
        self.root = Path(root)
        sizes = [(self.root / r).stat().st_size for r in files]
        self.files = FileTable.from_entries(files, sizes)
        self.per_file = per_file

    def __len__(self) -> int:
        return len(self.files) * self.per_file

    def file_ids(self, indices):
        return np.asarray(indices, dtype=np.int64) // self.per_file


def make_tree(root: Path, n: int, size: int, seed: int = 0, dirs: int = 4) -> ShardDataset:
    rng = np.random.default_rng(seed)
    names = []
    for i in range(n):
        rel = f"d{i % dirs}/f{i:05d}.bin"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.integers(0, 256, size + i % 7, dtype=np.uint8).tobytes())
        names.append(rel)
    return ShardDataset(root, names)


def temp_files(stage_dir: Path) -> list[str]:
    """The stager's temporary copies ('tmp.<thread>' in a session dir) anywhere below."""
    return [
        os.path.join(d, f)
        for d, _, fs in os.walk(stage_dir)
        for f in fs
        if f.startswith("tmp.") and Path(d).parent.name == "sessions"
    ]


def stage_bytes(stage: Path) -> int:
    """Bytes on disk in a stage dir: staged copies and the stager's temporaries, not .hpcdl's
    control files (files may vanish while it counts). Counted once per inode: a copy being
    published is linked under its temporary name and its destination for a moment."""
    seen: dict[tuple[int, int], int] = {}
    for d, _, names in os.walk(stage):
        meta = ".hpcdl" in Path(d).relative_to(stage).parts
        for name in names:
            if meta and not name.startswith("tmp."):  # temporaries live in session dirs
                continue
            try:
                st = os.lstat(os.path.join(d, name))
            except FileNotFoundError:
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())
