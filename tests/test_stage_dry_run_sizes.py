"""`python -m hpcdl.stage --dry-run` prints byte sizes in binary units, as hpcdl-stage does
(hpcdl.units.binary_size; `human_bytes` in staging/src/common.h)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import make_folder, make_tree, stage_cli
from tarshards_helpers import shards_of_folder

from hpcdl.units import binary_size


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """tmp_path/shards: 4 tar shards of 12 images of 3 classes (48 samples)."""
    make_folder(tmp_path / "imgs", per_class=16, classes=("a", "b", "c"), fmt="jpg")
    shards_of_folder(tmp_path / "imgs", tmp_path / "shards", 12)
    return tmp_path / "shards"


def test_sizes_are_in_binary_units_as_the_stager_prints_them(shards):
    dry = stage_cli(
        *("--dry-run", "--data", shards / "shard-{000000..000003}.tar", "--nodes", 2),
        *("--batch-size", 4, "--stage-capacity", 50000, "--json"),
    )
    assert dry.returncode == 0, dry.stderr
    nodes = json.loads(dry.stdout.splitlines()[-1])["nodes"]
    lines = [line for line in dry.stdout.splitlines() if line.startswith("  node ")]
    for node, line in zip(nodes, lines, strict=True):
        fits = "fits" if node["fits"] else "does NOT fit"
        assert f"files, {binary_size(node['bytes'])}, {fits} in 48.8 KiB;" in line, line
        assert f"(run: {node['run_files']} files, {binary_size(node['run_bytes'])})" in line
    assert not re.search(r"\b(MB|GB)\b(?!/s)", dry.stdout), dry.stdout  # MB/s: the PFS speed


@pytest.mark.parametrize(
    "nbytes,text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (50000, "48.8 KiB"), (5 << 30, "5.0 GiB")],
)
def test_binary_size_reads_as_the_stagers_human_bytes(nbytes, text):
    assert binary_size(nbytes) == text


def test_the_stager_prints_a_capacity_as_binary_size_does(tmp_path):
    data = make_tree(tmp_path / "data", 4, 100).root
    out = stage_cli(
        *("--data", data, "--files-only", "--batch-size", 1, "--stage-dir", tmp_path / "s"),
        *("--stage-capacity", 50000),
    )
    assert out.returncode == 0, out.stderr
    assert f"capacity {binary_size(50000)}\n" in out.stderr, out.stderr
