"""A slow, read-only FUSE file system that every reader pays for (benchmarks and tests).

    python -m tools.bench.slowfs SRC MOUNTPOINT --latency-ms 5 --mbps 200 [--stats FILE]

NOTE [how the slow file system behaves]. A passthrough of SRC, mounted read-only (`-o ro`: the
kernel answers every write, create, rename or unlink with EROFS before it reaches us), which
models the two costs of a parallel file system that staging exists to hide:

- Latency per open: every open(2) of a file sleeps `latency_ms` in the file system before it
  returns, whoever opens it: loader workers, the stager's copy threads, `cp -r`, PyTorch. Opens
  run concurrently (libfuse's multi-threaded loop, up to `threads` requests at once), so N
  concurrent openers see about N / latency opens/s, as on a metadata server with spare capacity.
  Metadata (lookup, stat, readdir) is not slowed, and the kernel caches it for 1 s.
- Shared bandwidth: every read of every file draws from one cap of `mbps` MB/s (1 MB = 1e6
  bytes) for the whole mount, whatever the number of readers: a read of n bytes is scheduled
  after the bytes before it and returns n / mbps later (a virtual-time queue, not a bucket with
  bursts). 0 = no cap.
- No page cache across opens: mounted without `kernel_cache`, so the kernel drops a file's
  cached pages when it is opened again; every epoch that reads the file pays again. (Reads
  within one open may be served from kernel read-ahead, which is charged when fetched.)
- Threads: libfuse's multi-threaded loop with `max_threads=threads` (default 64, libfuse's own
  default is 10, which would cap opens in flight at 10 / latency).
- Counters: opens, distinct files opened, the most opens of one file, bytes read, and (with
  `count_openers`, for tests: a /proc read per open) opens per opening process (thread group
  id), written as JSON to `--stats` every 0.2 s while they change and when the file system
  stops. `mounted()` returns them.
- The server is Python (mfusepy): about four callbacks per small file (lookup, open, read,
  release), serialised by the GIL. On the 2-core development VM it serves about 2,000 small
  files/s however many readers ask; above that the server, not the latency, is the limit
  (docs/PERFORMANCE.md, issue 14).

`mounted()` starts the server as a child process with `auto_unmount` (fusermount3 stays as a
watchdog and unmounts when the server dies, however it dies), the server exits when its parent
does, and leaving the `with` block unmounts and checks /proc/mounts: no mount is left behind.
`unavailable()` says in one sentence why FUSE cannot be used here (None when it can).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdl.helpformat import HelpFormatter

try:
    import mfusepy as fuse
except (ImportError, OSError) as _exc:  # no module, or no libfuse
    fuse = None
    _IMPORT_ERROR = str(_exc)

MOUNT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class SlowFSOptions:
    latency_ms: float = 5.0  # per open
    mbps: float = 200.0  # shared by all readers; 0 = no cap
    threads: int = 64  # libfuse max_threads: requests served at once
    count_openers: bool = False  # opens per process: costs a /proc read per open (tests)


class _Bandwidth:
    """One virtual-time queue of bytes for the whole mount."""

    def __init__(self, mbps: float) -> None:
        self._mutex = threading.Lock()
        self._bytes_per_s = mbps * 1e6
        self._next_free = 0.0

    def take(self, nbytes: int) -> None:
        if self._bytes_per_s <= 0 or nbytes <= 0:
            return
        with self._mutex:
            start = max(time.monotonic(), self._next_free)
            self._next_free = done = start + nbytes / self._bytes_per_s
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class _Counters:
    def __init__(self, path: Path | None) -> None:
        self._mutex = threading.Lock()
        self._path = path
        self._per_file: Counter[str] = Counter()
        self._per_opener: Counter[int] = Counter()
        self._bytes = 0
        self._changed = False

    def opened(self, path: str, tgid: int) -> None:
        with self._mutex:
            self._per_file[path] += 1
            self._per_opener[tgid] += 1
            self._changed = True

    def read(self, nbytes: int) -> None:
        with self._mutex:
            self._bytes += nbytes
            self._changed = True

    def snapshot(self) -> dict[str, Any]:
        with self._mutex:
            self._changed = False
            return {
                "opens": sum(self._per_file.values()),
                "files_opened": len(self._per_file),
                "max_opens_of_one_file": max(self._per_file.values(), default=0),
                "bytes_read": self._bytes,
                "opens_by_process": {str(k): v for k, v in sorted(self._per_opener.items())},
            }

    def write(self, force: bool = False) -> None:
        if self._path is None or not (self._changed or force):
            return
        tmp = self._path.with_name(self._path.name + ".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        os.replace(tmp, self._path)


def _thread_group(tid: int) -> int:
    """The process of a calling thread (FUSE reports the thread id)."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return tid


_Operations: Any = fuse.Operations if fuse is not None else object


class SlowFS(_Operations):
    """Read-only passthrough of a directory with a latency per open and a shared bandwidth cap.

    (No attribute may be named `lock`: it would shadow the FUSE operation of that name.)"""

    use_ns = True

    def __init__(self, source: Path, options: SlowFSOptions, counters: _Counters) -> None:
        self.source = str(Path(source).resolve())
        self.options = options
        self.counters = counters
        self.bandwidth = _Bandwidth(options.mbps)

    def _real(self, path: str) -> str:
        return self.source + path

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._real(path))
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_blocks")
        attrs = {k: getattr(st, k) for k in keys}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return attrs

    def readdir(self, path: str, fh: int) -> Iterator[tuple[str, dict[str, int], int]]:
        yield from ((".", {"st_mode": stat.S_IFDIR}, 0), ("..", {"st_mode": stat.S_IFDIR}, 0))
        with os.scandir(self._real(path)) as entries:
            for e in entries:  # the type from getdents: readers of the listing need no stat
                if e.is_symlink():
                    mode = stat.S_IFLNK
                elif e.is_dir(follow_symlinks=False):
                    mode = stat.S_IFDIR
                else:
                    mode = stat.S_IFREG
                yield e.name, {"st_mode": mode}, 0

    def readlink(self, path: str) -> str:
        return os.readlink(self._real(path))

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._real(path))
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree")
        return {k: getattr(sv, k) for k in keys} | {"f_namemax": sv.f_namemax}

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise fuse.FuseOSError(errno.EROFS)
        time.sleep(self.options.latency_ms / 1000.0)
        fd = os.open(self._real(path), os.O_RDONLY)
        opener = _thread_group(fuse.fuse_get_context()[2]) if self.options.count_openers else 0
        self.counters.opened(path, opener)
        return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        data = os.pread(fh, size, offset)
        self.bandwidth.take(len(data))
        self.counters.read(len(data))
        return data

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0


FLUSH_S = 0.2  # how often the server writes its changed counters to --stats


def _watch(counters: _Counters, parent: int) -> None:
    """Flush the counters while they change; stop the file system when the parent is gone."""
    while True:
        time.sleep(FLUSH_S)
        counters.write()
        if parent and os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)  # libfuse's handler ends its loop and unmounts
            return


def serve(source: Path, mountpoint: Path, options: SlowFSOptions, stats: Path | None,
          parent: int = 0) -> None:  # fmt: skip
    """Mount and serve until unmounted (or the parent process exits); blocks."""
    if fuse is None:
        raise RuntimeError(f"mfusepy cannot be used: {_IMPORT_ERROR}")
    counters = _Counters(stats)
    counters.write(force=True)
    threading.Thread(target=_watch, args=(counters, parent), daemon=True).start()
    try:
        fuse.FUSE(
            SlowFS(source, options, counters),
            str(mountpoint),
            foreground=True,
            ro=True,
            auto_unmount=True,
            default_permissions=True,
            fsname=f"slowfs:{source}",
            max_threads=options.threads,
        )
    finally:
        counters.write(force=True)


def is_mounted(path: Path) -> bool:
    """True when path is a mount point listed in /proc/mounts (also a dead FUSE mount)."""
    target = os.path.realpath(path)
    with open("/proc/mounts") as f:
        return any(_unescape(line.split()[1]) == target for line in f)


def _unescape(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def unavailable() -> str | None:
    """One sentence saying why a FUSE file system cannot be mounted here; None when it can."""
    if fuse is None:
        return f"FUSE is unavailable: mfusepy or libfuse3 cannot be loaded ({_IMPORT_ERROR})"
    if not os.path.exists("/dev/fuse"):
        return "FUSE is unavailable: /dev/fuse does not exist"
    if shutil.which("fusermount3") is None:
        return "FUSE is unavailable: fusermount3 is not installed (apt-get install fuse3)"
    with tempfile.TemporaryDirectory(prefix="hpcdl-slowfs-probe-") as tmp:
        (Path(tmp) / "src").mkdir()
        (Path(tmp) / "mnt").mkdir()
        try:
            with mounted(Path(tmp) / "src", Path(tmp) / "mnt", SlowFSOptions(0, 0)):
                pass
        except RuntimeError as exc:
            return f"FUSE is unavailable: {exc}"
    return None


@dataclass
class SlowMount:
    """A mounted SlowFS. `stats()`: its counters, up to 0.2 s old while mounted, final after
    the `with` block."""

    source: Path
    mountpoint: Path
    options: SlowFSOptions
    stats_path: Path
    final: dict[str, Any] | None = None

    def stats(self, settle: bool = False) -> dict[str, Any]:
        """settle: wait for the server's next flush first, so that every open and read that
        has returned to its caller is counted."""
        if self.final is not None:
            return self.final
        if settle:
            time.sleep(2.5 * FLUSH_S)
        return json.loads(self.stats_path.read_text())


@contextmanager
def mounted(
    source: Path, mountpoint: Path, options: SlowFSOptions = SlowFSOptions()
) -> Iterator[SlowMount]:
    """Mount SlowFS(source) on mountpoint (an existing empty directory) for the `with` block.

    RuntimeError with the server's message when it does not mount within MOUNT_TIMEOUT_S."""
    mountpoint = Path(mountpoint)
    scratch = Path(tempfile.mkdtemp(prefix="hpcdl-slowfs-"))
    mount = SlowMount(Path(source), mountpoint, options, scratch / "stats.json")
    cmd = [sys.executable, "-m", "tools.bench.slowfs", str(source), str(mountpoint),
           "--latency-ms", str(options.latency_ms), "--mbps", str(options.mbps),
           "--threads", str(options.threads), "--stats", str(mount.stats_path),
           "--parent-pid", str(os.getpid())]  # fmt: skip
    cmd += ["--count-openers"] if options.count_openers else []
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not is_mounted(mountpoint):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"cannot mount a FUSE file system on {mountpoint}: "
                    f"{_last_line(server) or 'timed out'}"
                )
            time.sleep(0.02)
        yield mount
    finally:
        _unmount(server, mountpoint)
        try:
            mount.final = json.loads(mount.stats_path.read_text())
        except (OSError, ValueError):
            mount.final = {}
        shutil.rmtree(scratch, ignore_errors=True)


def _last_line(server: subprocess.Popen) -> str:
    if server.poll() is None:
        return ""
    lines = (server.stderr.read() if server.stderr else "").strip().splitlines()
    return lines[-1] if lines else f"the server exited with status {server.returncode}"


def _unmount(server: subprocess.Popen, mountpoint: Path) -> None:
    """Unmount (lazily if busy), stop the server, and make sure no mount is left."""
    if is_mounted(mountpoint):
        done = subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
        if done.returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    if server.stderr:
        server.stderr.close()
    deadline = time.monotonic() + 5
    while is_mounted(mountpoint) and time.monotonic() < deadline:
        time.sleep(0.05)  # auto_unmount's watchdog unmounts after the server is gone
    if is_mounted(mountpoint):
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
    if is_mounted(mountpoint):
        raise RuntimeError(f"{mountpoint} is still mounted; unmount it with fusermount3 -u")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench.slowfs",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("source", help="directory whose files the mount serves, read-only")
    ap.add_argument("mountpoint", help="empty directory to mount the slow file system on")
    ap.add_argument(
        "--latency-ms", type=float, default=SlowFSOptions.latency_ms, help="milliseconds per open"
    )
    ap.add_argument(
        "--mbps", type=float, default=SlowFSOptions.mbps, help="read bandwidth in MB/s, shared"
    )
    ap.add_argument(
        "--threads", type=int, default=SlowFSOptions.threads, help="requests served at once"
    )
    ap.add_argument("--stats", help="JSON file the counters are written to (default: none)")
    ap.add_argument("--count-openers", action="store_true", help="count opens per process")
    ap.add_argument(
        "--parent-pid", type=int, default=0, help="exit when this process exits (0: never)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    options = SlowFSOptions(a.latency_ms, a.mbps, a.threads, a.count_openers)
    serve(Path(a.source), Path(a.mountpoint), options, Path(a.stats) if a.stats else None,
          a.parent_pid)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
