"""The manifest: the C++ stager writes it, Python's clean-up reads it; the two must agree."""

from __future__ import annotations

import os

from helpers import ShardDataset, start_session, wait_ready

from hpcdl.staging.layout import remove_created
from hpcdl.staging.manifest import decode_records, read_manifest
from hpcdl.staging.ownership import data_key

NAMES = ["plain/a.bin", "with space/b c.bin", "ünïcode/é.bin", "deep/er/still/d.bin"]


def stage_all(ds, stage, keep):
    session = start_session(ds, stage, batch=2, epochs=(0, 1), threads=2, keep=keep)
    wait_ready(session, len(ds.files))
    return session


def test_every_staged_file_and_created_directory_is_recorded_with_its_identity(tmp_path):
    for i, rel in enumerate(NAMES):
        (tmp_path / "pfs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pfs" / rel).write_bytes(bytes([i]) * (100 + i))
    ds = ShardDataset(tmp_path / "pfs", NAMES)
    stage = tmp_path / "stage"
    session = stage_all(ds, stage, keep=True)
    session.close()
    key = data_key(ds.root)
    records = read_manifest(stage / ".hpcdl" / "manifest")
    files = {r.dest: r for r in records if r.kind == "f"}
    assert set(files) == {f"{key}/{rel}" for rel in NAMES}
    for rel in NAMES:
        r = files[f"{key}/{rel}"]
        src, copy = os.stat(ds.root / rel), os.stat(stage / key / rel)
        assert r.source == str(ds.root / rel)
        assert r.source_identity == (
            src.st_size,
            src.st_mtime_ns,
            src.st_ctime_ns,
            src.st_ino,
            src.st_dev,
        )
        assert (r.copy_ino, r.copy_dev) == (copy.st_ino, copy.st_dev)
    dirs = {r.dest for r in records if r.kind == "d"}
    assert {key, f"{key}/deep/er/still", f"{key}/ünïcode"} <= dirs
    for d in dirs:
        st = os.stat(stage / d)
        assert any((r.copy_ino, r.copy_dev) == (st.st_ino, st.st_dev) for r in records)
    # Clean-up from the records removes exactly those files and directories.
    assert remove_created(stage, records) == len(NAMES)
    assert not (stage / key).exists()


def test_a_torn_tail_is_ignored_and_never_misread():
    payload = b"f\0a\nb\0/src\0" + b"\0".join(str(v).encode() for v in range(1, 8))
    record = b"R1 %d\n" % len(payload) + payload
    whole = decode_records(record + record)
    assert len(whole) == 2 and whole[0].dest == "a\nb" and whole[0].copy_dev == 7
    for cut in range(1, len(record)):
        assert len(decode_records(record + record[:cut])) == 1
    assert decode_records(b"R1 99999999\n" + record) == []
    assert decode_records(b"garbage" + record) == []
