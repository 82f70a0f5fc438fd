"""Where a run writes: never inside its data, and one run at a time in a --checkpoint-dir.

NOTE [a run's outputs]
- A --checkpoint-dir, --metrics, --timeline or --tensorboard that is, or lies inside, --data or
  --val-data (symlinks resolved; a tar pattern's or one .tar's root is the directory of its
  shards, hpcdl.staging.ownership.data_root) is refused at start: a checkpoint is an .h5 file,
  and beside HDF5 shards the next run reads it as one; in an image folder a directory becomes a
  class. An output that contains the data, or sits beside it, writes nothing into it.
- Rank 0, the only writer, holds an flock on <checkpoint-dir>/.hpcdl-checkpoint.lock from start
  to end, so a second run on the same directory is refused at start instead of replacing the
  first run's checkpoints of the same names. The kernel drops the lock when the process ends,
  however it ends, so a killed job never blocks the next one (a Slurm requeue or the next job of
  a chain starts after the last one ended). After --on-node-loss continue the new world's rank 0
  takes it again: the survivors left the old run's lock on their way out, and a killed rank 0
  holds none. On leaving, the holder removes the file (still holding it: a run that opened the
  old file finds on locking that the name is another file now, and opens it again) and the
  directories it created, when empty.
- NFS (v3 with lockd, v4) carries flock as a byte-range lock to the server, so two nodes see
  each other's; a client that crashed holds it until the server's lease ends (about 90 s).
  Lustre does so only when mounted with -o flock; with -o localflock only runs on the same node
  are seen, and without either flock fails: the run goes on unlocked, and says so in one line.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
from contextlib import ExitStack
from pathlib import Path

from hpcdl.comm.failure import SystemExitWithMessage
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.run import own

LOCK_NAME = ".hpcdl-checkpoint.lock"
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def inside_data_error(cfg: TrainConfig) -> str | None:
    """The one line for the first output (checkpoint dir, metrics, timeline, tensorboard) that is
    or lies inside --data or --val-data; None when every output keeps out of the data."""
    from hpcdl.staging.ownership import data_root  # noqa: PLC0415

    outputs = {"--checkpoint-dir": cfg.checkpoint_dir, "--metrics": cfg.metrics,
               "--timeline": cfg.timeline, "--tensorboard": cfg.tensorboard}  # fmt: skip
    for flag, data in (("--data", cfg.data), ("--val-data", cfg.val_data)):
        if not data:
            continue
        given = data_root(data)
        root = Path(os.path.realpath(given))
        named = f"{flag} {data}"
        if given != Path(data):  # a tar pattern's or one .tar's shards: their directory
            named = f"{given}, the directory of {named}"
        for out_flag, out in outputs.items():
            if not out:
                continue
            where = Path(os.path.realpath(out))
            how = "is" if where == root else "lies inside" if root in where.parents else None
            if how:
                return (
                    f"{out_flag} {out} {how} {named}: its files would be read as part of the "
                    "data set; choose a path outside the data"
                )
    return None


class CheckpointDirLock:
    """Rank 0's flock on its --checkpoint-dir (NOTE [a run's outputs]); release() on every exit."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = Path(directory) / LOCK_NAME
        self.fd: int | None = None  # held while not None
        # directories take() created (deepest first), removed by release() when empty
        self.made = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]

    def take(self) -> str | None:
        """Lock the directory: None when held (or when its file system has no flock: said on
        stderr); else the line that another run holds it. OSError when it cannot be created."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = os.read(fd, 200).decode(errors="replace").strip()
                os.close(fd)
                if exc.errno in _BUSY:
                    return self._busy_line(holder)
                print(self._unlocked_line(exc), file=sys.stderr, flush=True)
                return None
            if self._names(fd):
                break
            os.close(fd)  # the holder that just left removed this name: lock the new file
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self.fd = fd
        return None

    def _names(self, fd: int) -> bool:
        """The lock's name is still the file fd holds."""
        try:
            named, held = os.stat(self.path), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def _busy_line(self, holder: str) -> str:
        directory = self.path.parent
        by = f" ({holder}, " if holder else " ("
        return (
            f"--checkpoint-dir {directory} is in use by another run{by}which holds {self.path}); "
            "wait until it ends, or give this run another --checkpoint-dir"
        )

    def _unlocked_line(self, exc: OSError) -> str:
        return (
            f"hpcdl: warning: --checkpoint-dir {self.path.parent} cannot be locked "
            f"({exc.strerror or exc}: a file system without flock, e.g. Lustre without -o flock); "
            "training goes on, but a second run on this directory would not be refused"
        )

    def release(self) -> None:
        """Remove the lock file (held until closed) and the directories take() made when empty."""
        if self.fd is not None:
            if self._names(self.fd):
                self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None
        for d in self.made:
            try:
                d.rmdir()  # only an empty directory: no checkpoint was written there
            except OSError:
                break


def hold_checkpoint_dir(cfg: TrainConfig, world: World, stack: ExitStack) -> None:
    """Rank 0 locks --checkpoint-dir for the run, owned by stack; another run holding it stops
    every rank with one line. Collective; nothing without --checkpoint-dir."""
    if not cfg.checkpoint_dir:
        return
    error = None
    if world.is_root:
        lock = CheckpointDirLock(cfg.checkpoint_dir)
        try:
            error = lock.take()
        except OSError as exc:
            error = f"--checkpoint-dir {cfg.checkpoint_dir} cannot be locked: {exc.strerror or exc}"
        own(stack, lock.release, lock.release)
    error = world.comm.bcast(error, root=0)
    if error:
        raise SystemExitWithMessage(error if world.is_root else None)
