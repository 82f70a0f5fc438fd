"""Which kind of file system holds a path: shared between nodes ("network": NFS, Lustre, GPFS,
...), node-local memory, or a node-local disk. The doctor's stage-dir check and stage-only's
choice of copy threads both ask; the answer comes from the mount table (/proc/self/mounts),
the mount with the longest mount point that contains the path's real path. (Linux's statfs
f_type would say the same, but Python's os.statvfs does not carry it; the table's type names
also cover FUSE file systems by name.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hpcdl.config import STAGE_THREADS

# File system types that are shared between nodes (mount table names; fuse.* is by name).
NETWORK_FS = frozenset(
    "nfs nfs4 lustre gpfs beegfs fhgfs cifs smb3 smbfs ceph glusterfs panfs wekafs afs "
    "orangefs pvfs2 9p fuse.sshfs fuse.glusterfs fuse.ceph-fuse fuse.beegfs fuse.s3fs "
    "fuse.gcsfuse fuse.rclone fuse.juicefs".split()
)
MEMORY_FS = frozenset(("tmpfs", "ramfs"))


@dataclass(frozen=True)
class Mount:
    source: str
    point: str
    fstype: str
    options: str


def _unescape(field: str) -> str:
    """Mount table fields escape space, tab, newline and backslash as octal (\\040)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mounts(text: str) -> list[Mount]:
    """Lines of /proc/mounts (fstab format: source point type options dump pass)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            mounts.append(Mount(_unescape(fields[0]), _unescape(fields[1]), fields[2], fields[3]))
    return mounts


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding path (already absolute and resolved): the longest matching point;
    the last one listed wins a tie, as a later mount hides an earlier one there."""
    best: Mount | None = None
    for m in mounts:
        point = m.point.rstrip("/") or "/"
        inside = path == point or path.startswith(point if point == "/" else point + "/")
        if inside and (best is None or len(point) >= len(best.point.rstrip("/") or "/")):
            best = m
    return best


def classify(fstype: str) -> str:
    """'network' (shared between nodes), 'memory' (tmpfs: node-local RAM) or 'local'."""
    if fstype in NETWORK_FS:
        return "network"
    return "memory" if fstype in MEMORY_FS else "local"


def read_mounts() -> str:
    try:
        return Path("/proc/self/mounts").read_text()
    except OSError:
        return ""


def source_kind(fstype: str) -> str:
    """A data source's kind: classify's, except that a FUSE file system it does not know
    ("fuse", "fuse.<name>") counts as network: its opens cross a user-space server, often a
    remote one (sshfs, s3fs, the benches' slow FS), and are latency-bound. fuseblk (a local
    block device through FUSE, ntfs-3g) stays local."""
    if fstype == "fuse" or fstype.startswith("fuse."):
        return "network"
    return classify(fstype)


def path_kind(path: str | Path) -> tuple[str, str]:
    """(kind, file system type) of the deepest existing directory on the way to path, kind as
    source_kind gives it ("local" with type "unknown" when the mount table cannot be read)."""
    current = Path(path).absolute()
    while not current.exists() and current.parent != current:
        current = current.parent
    mount = mount_of(os.path.realpath(current), parse_mounts(read_mounts()))
    if mount is None:
        return "local", "unknown"
    return source_kind(mount.fstype), mount.fstype


LOCAL_THREADS_PER_CORE = 4  # 8 threads on 2 cores: 0.94x cp -r, where 32 took 1.2-1.9x


def copy_threads(kind: str, cores: int) -> int:
    """Copy threads for a source of this kind: a network or parallel file system's opens wait
    on servers, so many threads hide their latency (STAGE_THREADS, as MLPerf HPC stages); a
    local one is bound by the cores and the disk, where threads beyond a few per core only
    contend (docs/staging.md, "Copy threads")."""
    if kind == "network":
        return STAGE_THREADS
    return max(4, min(STAGE_THREADS, LOCAL_THREADS_PER_CORE * max(cores, 1)))
