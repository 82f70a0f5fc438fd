"""One owner per Python<->C++ rule: the status-map layout, the capacity default, capacity 0.

hpcdl-stage owns the status map's layout (`--print-layout`) and the default capacity
(`--default-capacity DIR`); Python reads both from the binary. These tests check that what
Python reads agrees with what a real stager writes, and with the table in docs/staging.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from helpers import make_tree, start_session

from hpcdl.staging import (
    default_capacity,
    find_stager_binary,
    parse_capacity,
)
from hpcdl.staging import status as status_module
from hpcdl.staging.status import StatusView, status_layout

DOCS = Path(__file__).resolve().parent.parent / "docs" / "staging.md"


def binary_layout() -> dict:
    out = subprocess.run(
        [str(find_stager_binary()), "--print-layout"], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_python_reads_the_status_layout_the_binary_prints():
    raw = binary_layout()
    layout = status_layout()
    assert layout.magic == raw["status"]["magic"].encode()
    assert layout.header_size == raw["status"]["header_size"] == 256
    assert layout.version == raw["status"]["version"]
    assert {k: v[0] for k, v in layout.fields.items()} == {
        k: v["offset"] for k, v in raw["status"]["fields"].items()
    }
    assert layout.file_states == raw["status"]["file_states"]
    assert layout.run_states == raw["status"]["run_states"]
    assert layout.flags == raw["status"]["flags"]
    # The names Python code uses resolve to the binary's codes.
    assert status_module.READY == raw["status"]["file_states"]["READY"]
    assert status_module.RUN_STOPPED == raw["status"]["run_states"]["STOPPED"]
    assert status_module.FLAG_NOSPACE == raw["status"]["flags"]["NOSPACE"]
    assert layout.progress == raw["progress"]


def test_the_documented_status_table_matches_the_binary():
    raw = binary_layout()["status"]
    table = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\| (\d+)(?:, (\d+))? \| (\w+\[?\d*\]?) \| ", line)
        if m and int(m.group(1)) < raw["header_size"]:
            table[int(m.group(1))] = m.group(3)
            if m.group(2):
                table[int(m.group(2))] = m.group(3)
    binary = {f["offset"]: f["type"] for f in raw["fields"].values()}
    binary[0] = "char[8]"
    assert table == binary


def test_a_real_status_map_reads_back_what_the_stager_wrote(tmp_path):
    ds = make_tree(tmp_path / "pfs", 12, 3000)
    session = start_session(ds, tmp_path / "stage", epochs=(0, 1), threads=2, capacity=10**9)
    try:
        view = StatusView(session.meta / "status")
        h = view.header()
        assert h["pid"] == session.stager.proc.pid
        assert h["files"] == len(ds.files) and h["capacity"] == 10**9
        assert h["version"] == status_layout().version
        assert view.run_state() == "RUNNING"
        view.close()
    finally:
        session.close()


def test_the_default_capacity_comes_from_the_binary(tmp_path):
    usage = shutil.disk_usage(tmp_path)
    margin = max(usage.total // 20, 2**30)
    expected = max(usage.free - margin, 0)
    got = default_capacity(tmp_path)
    assert abs(got - expected) < 64 * 2**20  # free space moves while other jobs run
    assert parse_capacity(None, tmp_path) is None  # None: the stager decides
    assert parse_capacity("0", tmp_path) == 0 and parse_capacity(0, tmp_path) == 0


def test_a_session_without_capacity_lets_the_stager_pick_its_default(tmp_path):
    ds = make_tree(tmp_path / "pfs", 4, 1000)
    session = start_session(ds, tmp_path / "stage", epochs=(0, 1), threads=2, capacity=None)
    try:
        view = StatusView(session.meta / "status")
        assert abs(view.field("capacity") - default_capacity(tmp_path)) < 64 * 2**20
        view.close()
    finally:
        session.close()


def test_capacity_zero_stages_nothing_and_says_so_once(tmp_path, capfd):
    ds = make_tree(tmp_path / "pfs", 32, 2000)
    session = start_session(ds, tmp_path / "stage", epochs=(0, 1), threads=2, capacity=0)
    try:
        view = StatusView(session.meta / "status")
        assert view.field("capacity") == 0
        locate = session.locator()
        for fid, entry in enumerate(ds.files):
            assert locate(fid) == ds.root / entry.relpath
        session.consumed(0, 3)
        assert session.epoch_stats()["files_staged"] == 0
        view.close()
    finally:
        session.close()
    data = [p for p in (tmp_path / "stage").rglob("*") if ".hpcdl" not in p.parts and p.is_file()]
    assert data == []
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "capacity" in line and "staging" not in line]
    assert len(lines) == 1, err
    assert "32 of 32 planned files" in lines[0] and "--stage-capacity" in lines[0], lines[0]


def test_files_larger_than_the_capacity_are_one_summary_line(tmp_path, capfd):
    root = tmp_path / "pfs"
    ds = make_tree(root, 20, 1000)
    big = [e.relpath for e in ds.files[:5]]
    for rel in big:
        (root / rel).write_bytes(os.urandom(50_000))
    ds = type(ds)(root, [e.relpath for e in ds.files])
    session = start_session(ds, tmp_path / "stage", epochs=(0, 1), threads=2, capacity=20_000)
    try:
        session.consumed(0, 1)
    finally:
        session.close()
    err = capfd.readouterr().err
    assert "larger than the stage capacity" not in err  # no line per file
    lines = [line for line in err.splitlines() if "do not fit" in line]
    assert len(lines) == 1, err
    assert "5 of 20 planned files" in lines[0] and "--stage-capacity" in lines[0], lines[0]
    assert "50000" in lines[0] or "50 kB" in lines[0] or "0.05 MB" in lines[0], lines[0]
