"""Pieces: byte ranges of shards as plan entries of their own (issue 62, deliverable 3;
docs/staging.md, "Pieces"). Real hpcdl-stage processes on 127.0.0.1, as in
test_staging_peer_copy.py: a home stager stages the shards whole and serves them; a second
stager, whose hand-written plan lists pieces of them, fetches each piece's range from the home,
else copies it from the shard's PFS source."""

from __future__ import annotations

import hmac
import shutil
import socket
import struct
from pathlib import Path
from typing import NamedTuple

from helpers import make_tree, wait_until
from peer_stagers import (
    FILES,
    SESSION,
    ForgingPeer,
    ProvingPeer,
    client_proof,
    serving_home,
    start,
    status,
)

from hpcdl.staging.manifest import read_manifest

SHARDS = 6  # the first SHARDS files of the home's tree are the shards pieces are taken from
SLOTS = 2 * FILES  # the first piece slot: ids FILES .. SLOTS - 1 are shards no home holds


class Piece(NamedTuple):
    slot: int
    shard: int  # the shard's file id (its home's)
    source: Path  # the shard's PFS path
    shard_size: int
    offset: int
    length: int

    @property
    def dest(self) -> str:
        return f"k/shard{self.shard}.pieces/{self.offset}"

    def bytes(self) -> bytes:
        return self.source.read_bytes()[self.offset : self.offset + self.length]


def pieces_of(ds, shard_ids=None, away: bool = False, first: int = SLOTS) -> list[Piece]:
    """Three pieces of each shard (its start, its middle, its end), in slots from `first` on;
    with away, under a shard id its home does not hold (FILES + the file's index)."""
    pieces = []
    for f in shard_ids if shard_ids is not None else range(SHARDS):
        source, size = ds.root / ds.files[f].relpath, ds.files[f].size
        for offset, length in ((0, 100), (1000, 517), (size - 300, 300)):
            slot = first + len(pieces)
            pieces.append(Piece(slot, FILES + f if away else f, source, size, offset, length))
    return pieces


def write_piece_plan(stage: Path, pieces: list[Piece], peer: str | None) -> None:
    """A node's plan of `pieces` alone (one step each, in order), in stage's session dir; with
    peer ("ip:port"), each from node 0 at that address (the peer section), from step 0."""
    lines = ["hpcdl-plan 1", "fingerprint 00", "seed 0", "epochs 0 1"]
    lines += [f"steps_per_epoch {len(pieces)}", "local_ranks 1"]
    lines += [f"dataset_files {SLOTS + len(pieces)}", f"entries {len(pieces)}"]
    lines += [f"{p.slot}\t{p.length}\t{k}\t{p.dest}\t{p.source}" for k, p in enumerate(pieces)]
    if peer:
        lines += ["peers 1", f"0\t{peer}", f"peer_sources {len(pieces)}"]
        lines += [f"{p.slot}\t0\t0" for p in pieces]
    lines.append(f"pieces {len(pieces)}")
    lines += [f"{p.slot}\t{p.shard}\t{p.shard_size}\t{p.offset}" for p in pieces]
    meta = stage / ".hpcdl" / "sessions" / SESSION
    meta.mkdir(parents=True, mode=0o700, exist_ok=True)
    (meta / "plan").write_text("\n".join([*lines, "end", ""]))


def fetch_pieces(stage: Path, pieces: list[Piece], peer: str | None, secret: str, *flags: str):
    """A second node's stager, --once, over a plan of `pieces`: (its status, its log)."""
    write_piece_plan(stage, pieces, peer)
    proc = start(stage, secret, None, "--once", *flags)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return status(stage), err


def assert_pieces_are_the_ranges(stage: Path, pieces: list[Piece]) -> None:
    """Every piece file holds its shard's range, and is recorded in the manifest with the
    shard's identity; no temporary file is left."""
    records = {r.dest: r for r in read_manifest(stage / ".hpcdl" / "manifest")}
    for p in pieces:
        assert (stage / p.dest).read_bytes() == p.bytes(), p
        st = p.source.stat()
        identity = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        assert records[p.dest].source == str(p.source)
        assert records[p.dest].source_identity == identity
    assert not [q for q in (stage / ".hpcdl" / "sessions" / SESSION).iterdir() if "tmp." in q.name]


def served(stage: Path, files: int) -> tuple[int, int]:
    """The home's files and bytes served, once its heartbeat shows `files` served."""
    view = status(stage)
    wait_until(lambda: view.field("files_served") >= files, 10, "the home's files_served")
    return view.field("files_served"), view.field("bytes_served")


def test_pieces_come_from_the_home_as_ranges_and_are_never_reused(tmp_path):
    """Each piece's bytes are its shard's range; the home serves (and counts) the pieces' bytes,
    not the shards'; a later job on the same stage dir fetches them again (a piece is never
    reused: its size is not its source's)."""
    with serving_home(tmp_path) as (ds, address, secret, _):
        pieces = pieces_of(ds)
        view, err = fetch_pieces(tmp_path / "b", pieces, address, secret)
        piece_bytes = sum(p.length for p in pieces)
        assert view.field("peer_files") == len(pieces) and view.field("pfs_opens") == 0, err
        assert view.field("peer_bytes") == piece_bytes == view.field("bytes_staged"), err
        assert view.field("peer_fallbacks") == 0, err
        assert_pieces_are_the_ranges(tmp_path / "b", pieces)
        assert served(tmp_path / "a", len(pieces)) == (len(pieces), piece_bytes)
        assert piece_bytes < sum(ds.files[f].size for f in range(SHARDS)) / 2

        for p in pieces:  # damaged in place, size kept: a piece reused would keep this
            with open(tmp_path / "b" / p.dest, "r+b") as f:
                f.write(b"X" * p.length)
        shutil.rmtree(tmp_path / "b" / ".hpcdl" / "sessions" / SESSION)  # a later job
        view, err = fetch_pieces(tmp_path / "b", pieces, address, secret)
        assert view.field("files_reused") == 0 and view.field("peer_files") == len(pieces), err
        assert_pieces_are_the_ranges(tmp_path / "b", pieces)


def test_pieces_a_home_does_not_hold_or_a_dead_home_come_from_the_pfs_range(tmp_path):
    """A piece whose home answers "not here" (a shard it does not hold), and every piece of a
    home that is down, is copied from its shard's PFS source: the range only, bytes right."""
    with serving_home(tmp_path) as (ds, address, secret, _):
        here = pieces_of(ds, [0, 1])
        away = pieces_of(ds, [2, 3], away=True, first=SLOTS + len(here))
        view, err = fetch_pieces(tmp_path / "b", here + away, address, secret)
        assert view.field("peer_files") == len(here), err
        assert view.field("pfs_opens") == view.field("peer_fallbacks") == len(away), err
        assert view.field("bytes_staged") == sum(p.length for p in here + away)
        assert_pieces_are_the_ranges(tmp_path / "b", here + away)

        probe = socket.create_server(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
        probe.close()  # nobody listens there now
        view, err = fetch_pieces(tmp_path / "c", here, dead, secret)
        assert view.field("peer_files") == 0 and view.field("pfs_opens") == len(here), err
        assert err.count("is not asked again") == 1, err
        assert_pieces_are_the_ranges(tmp_path / "c", here)


class ShortPeer(ProvingPeer):
    """A peer of the job that sends a served reply's header and all but the last byte of the
    range, then closes the connection."""

    hang_up = True

    def reply(self, request: bytes, number: int, nonces: bytes) -> bytes:
        header, body = self.header_and_body(request)
        return header + body[:-1]


def test_a_forged_or_short_range_reply_is_refused_and_the_pfs_range_used(tmp_path):
    """A range reply whose MAC is not its bytes', or that ends short, is never published: the
    piece comes from its shard's PFS range, bytes right."""
    ds = make_tree(tmp_path / "pfs", FILES, 3000)
    pieces = pieces_of(ds)
    for name, peer_class in (("forged", ForgingPeer), ("short", ShortPeer)):
        peer = peer_class(ds, "ab" * 32)
        try:
            view, err = fetch_pieces(tmp_path / name, pieces, peer.address, "ab" * 32)
        finally:
            peer.close()
        assert peer.requests >= 1, err
        assert view.field("peer_files") == 0 and view.field("pfs_opens") == len(pieces), err
        assert "is not asked again" in err, err
        assert_pieces_are_the_ranges(tmp_path / name, pieces)


def test_the_home_serves_a_range_within_the_file_only(tmp_path):
    """On the wire (docs/staging.md, "Handshake"): a request's range past the file's end, or
    whose offset overflows, is answered "not here" and the connection goes on; a range within
    it is served, its bytes and MAC the range's."""
    with serving_home(tmp_path) as (ds, address, secret, _):
        size = ds.files[0].size
        shard = (ds.root / ds.files[0].relpath).read_bytes()

        def request(offset: int, length: int) -> bytes:
            return b"HPCDLPQ3" + struct.pack("<IIQQQ", 0, 0, size, offset, length)

        with socket.create_connection(("127.0.0.1", int(address.split(":")[1])), timeout=5) as c:
            proof, nonces = client_proof(c, secret, address)
            for number, (offset, length) in enumerate(((size - 10, 11), (2**64 - 1, 2))):
                c.sendall((proof if number == 0 else b"") + request(offset, length))
                reply = c.recv(64, socket.MSG_WAITALL)
                assert reply[:8] == b"HPCDLPA3" and struct.unpack_from("<I", reply, 8) == (1,)
            c.sendall(request(size - 10, 10))
            reply = c.recv(64, socket.MSG_WAITALL)
            body, tag = c.recv(10, socket.MSG_WAITALL), c.recv(32, socket.MSG_WAITALL)
        assert struct.unpack_from("<IIQ", reply, 8) == (0, 0, size)  # the whole file's size
        assert body == shard[-10:]
        signed = b"hpcdl-peer reply\0" + nonces + struct.pack("<Q", 2) + request(size - 10, 10)
        want = hmac.new(bytes.fromhex(secret), signed + reply + body, "sha256").digest()
        assert hmac.compare_digest(tag, want)
        assert served(tmp_path / "a", 1) == (1, 10)


def test_stage_verify_takes_pieces_from_the_pfs_range_checked(tmp_path):
    """With --stage-verify a piece is copied from its shard's PFS range and checked against the
    checksum of the bytes read (a home holds the checksum of a whole file only, which no range
    can be checked against): the home is not asked, and no fallback is counted."""
    with serving_home(tmp_path) as (ds, address, secret, _):
        pieces = pieces_of(ds)
        view, err = fetch_pieces(tmp_path / "b", pieces, address, secret, "--verify")
        assert view.field("peer_files") == 0 and view.field("pfs_opens") == len(pieces), err
        assert view.field("peer_fallbacks") == 0 and view.field("failures") == 0, err
        assert_pieces_are_the_ranges(tmp_path / "b", pieces)
        assert status(tmp_path / "a").field("files_served") == 0
