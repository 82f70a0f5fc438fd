"""write_atomically: the one way hpcdl publishes a file that others read whole.

A reader sees the old file or the new one, never half of one, and a crash leaves no partial
file under the final name:
1. a temporary file is created beside the target (same directory, so same file system), named
   `.<name>.<random>.tmp` with O_EXCL (never a symlink followed), mode 0600, or with
   `mode=None` 0666 less the umask (and the directory's default ACL), as open() creates a file;
2. the caller writes it by path (`write(tmp)`: h5py, torch.save and onnx.save take a path);
3. its mode is set (`mode`, whatever the umask; for None the mode it was created with, as a
   writer may have replaced the file: safetensors writes its own 0600 file and renames it)
   and its contents fsync'ed;
4. it is published: renamed over the target (`replace=True`), or hard-linked to it
   (`replace=False`), which fails with FileExistsError when the target exists, so a user's
   file is never replaced even if it appears meanwhile;
5. the directory is fsync'ed, so the new name survives a crash too.
On any error, in the caller's write included, the temporary file is removed and the error
raised; the target is untouched. Writers: the calibration file, a node's staging plan, the
status map's first image, the image-folder index, checkpoints, exported weights. Files made for
the user to keep and share (checkpoints, exported weights) take `mode=None`: a colleague reads
them as they read the run's report.png, unless the user's umask says otherwise.

A write that fails is said in one line by its caller: `reason` (the OS's words) and
`out_of_space` (free space there) or not (choose a writable place: EACCES, EPERM, EROFS, ...).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from hpcdl.fsync import fsync_path


def write_atomically(
    path: str | os.PathLike,
    write: Callable[[str], None],
    replace: bool = True,
    mode: int | None = 0o600,
) -> None:
    """Publish path with the contents write(tmp_path) puts in a temporary file beside it.

    mode: the file's permission bits, whatever the umask; None: what open() would give it
    (0666 less the umask). replace=False: FileExistsError when path exists (it is never
    replaced). OSError from any step; the temporary file is gone either way."""
    path = Path(path)
    tmp, created = _create_temporary(path, 0o600 if mode is not None else 0o666)
    try:
        write(tmp)
        os.chmod(tmp, created if mode is None else mode)
        fsync_path(tmp)
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_path(path.parent)


def _create_temporary(path: Path, perms: int) -> tuple[str, int]:
    """A new empty `.<name>.<random>.tmp` beside path, made with O_EXCL (a name that exists,
    a symlink included, is never opened) and perms less the umask, as open() applies it; and
    the permission bits it got."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, flags, perms)
        except FileExistsError:
            continue
        try:
            return str(tmp), stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
    raise FileExistsError(errno.EEXIST, "no free temporary name beside it", str(path))


def write_bytes_atomically(
    path: str | os.PathLike, data: bytes, replace: bool = True, mode: int | None = 0o600
) -> None:
    """write_atomically of a byte string (text: encode it first)."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    write_atomically(path, write, replace=replace, mode=mode)


def reason(exc: OSError) -> str:
    """Why a write failed, in one line: strerror (h5py's report is many lines around it)."""
    return os.strerror(exc.errno) if exc.errno else str(exc).splitlines()[0]


def out_of_space(exc: OSError) -> bool:
    """The file system is full (or the quota spent): freeing space helps, another place too;
    any other failure (no permission, read-only, no such place) needs another place."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)
