"""hpcdl.torch.Loader: hpcdl's sampler -> worker pool -> shared-memory slots, and the node's
stager, for a PyTorch training script. The same start-up functions as hpcdl.train build it
(hpcdl.startup: open_datasets, sampler_spec; hpcdl.startup_input: open_input): there is no
second loader.

NOTE [slot lifetime]
A batch's images are a torch tensor over the shared-memory slot the loader worker wrote
(torch.from_numpy: no copy). The slot goes back to the workers when the script asks for the
next batch, so the images are valid until then, as in hpcdl.train; keep them longer (inputs
saved for later, a tensor kept across steps) with `.clone()`. The labels (B int64) are copied:
a script that collects them for epoch metrics needs no clone. With CUDA available (and
pin_memory left on), each batch is copied once into pinned memory instead, in a thread ahead of
the script (hpcdl.torch.pinning, NOTE [pinned hand-off]), as DataLoader's pin-memory thread
does: the slot goes back to the workers once its copy is done, and torch's pinned-memory
allocator keeps the block until an asynchronous `.to("cuda", non_blocking=True)` from it has
finished, so pinned batches stay valid as long as the script keeps them.

NOTE [closing the loader]
Like a Run (NOTE [closing a run] in hpcdl/run.py), the loader owns its resources on one
ExitStack: `close()` (or leaving a `with` block normally) closes them together with the other
ranks (the staging session's node barriers); leaving with an exception closes them on this rank
alone, with no collective (the workers stop, the stager stops and what it staged is removed
unless keep_staged). The workers ignore SIGINT and SIGTERM and follow their trainer; the
shared-memory file has no name to leak.

NOTE [process-wide handlers]
A library should not take over the process, so the Loader installs handlers only when the
script asks (docs/torch.md, "Signals and exit"): inside `with Loader(...)`, or for the loader's
whole life with `handle_signals=True` (`handle_signals=False`: never, not even in a `with`).
While installed: an exit that skips close() (an exception outside the `with`, SystemExit)
abandons the loader from atexit; SIGTERM (torchrun's and mpirun's way to stop a job, Slurm's
time limit) raises SystemExit(143) in the main thread, so that the clean-ups run, unless the
script has a SIGTERM handler of its own; and sys.excepthook prints hpcdl's own faults (a dead
loader worker, an unreadable sample) as one line. close() puts back what was there before; the
excepthook stays after a loader that ended with one of those faults, so that it prints as one
line. A loader used without either gets none of them and says so once, on rank 0, when it is
first iterated.
"""

from __future__ import annotations

import atexit
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

from hpcdl import messages, startup, startup_checks, startup_input
from hpcdl.comm.failure import SystemExitWithMessage
from hpcdl.config import STAGE_NICE, STAGE_THREADS, ConfigError, TrainConfig, validate
from hpcdl.data.dataset import DataError
from hpcdl.data.loader import LOADER_TIMEOUT_S
from hpcdl.data.pool import LoaderFault, Upcoming
from hpcdl.staging.ownership import StageDirError
from hpcdl.torch.pinning import PinnedAhead
from hpcdl.torch.world import NotInitialised, current_world

EXIT_SIGTERM = 128 + signal.SIGTERM


class LoaderStartError(SystemExit):
    """The loader cannot start (bad option, data, stage dir): rank 0 printed one line; every
    rank ends with status 2 unless the script catches this."""

    def __init__(self, message: str | None) -> None:
        super().__init__(2)
        self.message = message


class Loader:
    """Batches of (images (B, C, H, W) float32, labels (B,) int64) torch tensors for this rank.

    data: HDF5 shards or an image folder. epochs: how many the script trains (the stager plans
    the job's reading order ahead). The other options are hpcdl.train's flags of the same name
    (docs/training.md; error messages name those flags): workers (None: a fair share of the
    node's cores), prefetch (batch slots; None: two per worker within a memory bound,
    hpcdl.data.loader NOTE [default slots]; the count used is `slots`), seed and shuffle (the
    sampler: a pure function of seed, epoch, world size and rank), augment, stage_dir (None:
    read in place), stage_threads, stage_nice, stage_capacity, keep_staged, stage_verify,
    loader_timeout, skip_bad_samples, decode ("gpu": the workers read the files, this process
    decodes them, onto the GPU with nvImageCodec where torch has CUDA and CuPy and nvImageCodec
    are installed: images and labels are then CUDA tensors shared with CuPy through DLPack,
    each batch a new tensor; hpcdl.data.gpu_decode NOTE [GPU decode]).
    pin_memory: None pins when CUDA is available. handle_signals: None installs SIGTERM, atexit and
    excepthook handlers inside a `with` block only, True for the loader's life, False never
    (NOTE [process-wide handlers]). Rank and world come from torch.distributed, else MPI,
    else a world of one (hpcdl.torch.world). Valid batches: NOTE [slot lifetime]. The workers
    go on into the epoch the script will likely read next (_next_epoch).
    """

    def __init__(
        self,
        data: str,
        batch_size: int,
        *,
        epochs: int,
        workers: int | None = None,
        prefetch: int | None = None,
        seed: int = 0,
        shuffle: str = "global",
        augment: str = "none",
        stage_dir: str | None = None,
        stage_threads: int = STAGE_THREADS,
        stage_nice: str | int = STAGE_NICE,
        stage_capacity: str | None = None,
        keep_staged: bool = False,
        stage_verify: bool = False,
        loader_timeout: float = LOADER_TIMEOUT_S,
        skip_bad_samples: bool = False,
        decode: str = "cpu",
        pin_memory: bool | None = None,
        handle_signals: bool | None = None,
    ) -> None:
        import torch  # noqa: PLC0415

        self._torch = torch
        cfg = TrainConfig(
            data=str(data), batch_size=batch_size, epochs=epochs, workers=workers,
            prefetch="auto" if prefetch is None else str(prefetch), seed=seed, shuffle=shuffle,
            augment=augment,
            stage_dir=None if stage_dir is None else str(stage_dir),
            stage_threads=stage_threads, stage_nice=str(stage_nice), stage_capacity=stage_capacity,
            keep_staged=keep_staged, stage_verify=stage_verify,
            loader_timeout=loader_timeout, skip_bad_samples=skip_bad_samples, decode=decode,
        )  # fmt: skip
        self.cfg = cfg
        self.pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.epoch = 0
        self._epoch_given = False  # set_epoch since the last iteration: the next is epoch + 1
        self.closed = False
        self._iteration: Iterator | None = None
        self._previous_handlers: dict[int, Any] = {}
        self.handle_signals = handle_signals
        self._handling = False  # NOTE [process-wide handlers]: installed now
        self._told = False  # said once that none are installed
        self._leaving = False
        try:
            validate(cfg)
            self.world, self.launched_by = current_world()
        except (ConfigError, NotInitialised) as exc:
            raise _start_error(str(exc), messages.launcher_rank() == 0) from None
        # what hpcdl.train's start-up makes: the data set (opened once per job), this rank's
        # sampler, the node's staging session (None without stage_dir), the worker pool, and
        # the stack that owns the last two (NOTE [closing the loader])
        self.dataset, self.sampler, self.staging, self._loader, self._stack = self._start()
        if handle_signals:
            self._install_handlers()

    def _install_handlers(self) -> None:
        """atexit, SIGTERM and excepthook (NOTE [process-wide handlers]); once."""
        if self._handling or self.closed:
            return
        self._handling = True
        atexit.register(self._abandon)
        self._catch_signals()
        if sys.excepthook is not _one_line_errors:  # torch.distributed's, a script's: kept
            _one_line_errors.previous = sys.excepthook
            sys.excepthook = _one_line_errors

    def _start(self) -> tuple[Any, Any, Any, Any, ExitStack]:
        """Open the data set once per job, start the node's stager, start the workers;
        collective. (dataset, sampler, staging session or None, hpcdl Loader, their stack)."""
        cfg, world = self.cfg, self.world
        try:
            with ExitStack() as stack:  # an error half way closes what was made (this rank)
                startup_checks.check_workers(cfg, world)
                dataset, _ = startup.open_datasets(cfg, world)
                spec = startup.sampler_spec(cfg, world, len(dataset))
                xp = _decode_xp(self._torch) if cfg.decode == "gpu" else None
                staging, loader, _ = startup_input.open_input(
                    cfg, world, stack, (dataset, None), spec, 0, xp
                )
                return dataset, spec.for_rank(world.rank), staging, loader, stack.pop_all()
        except SystemExitWithMessage as exc:  # agreed by every rank; printed once
            raise _start_error(exc.message, world.rank == 0) from None

    # ------------------------------------------------------------------ what a script uses

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (its order and augmentation), as
        DistributedSampler.set_epoch."""
        if not 0 <= epoch < self.cfg.epochs:
            last = self.cfg.epochs - 1
            raise ValueError(f"epoch {epoch} is outside the loader's epochs 0..{last}")
        self.epoch = int(epoch)
        self._epoch_given = True

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the images it yields, after augment: the model's input shape."""
        return self._loader.sample_shape

    @property
    def slots(self) -> int:
        """Shared-memory batch slots of this rank (0 with workers=0)."""
        return self._loader.slots

    def __len__(self) -> int:
        """Batches per epoch on this rank (every rank the same; last partial batch dropped)."""
        return self.sampler.steps_per_epoch(self.cfg.batch_size)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if self.closed:
            raise RuntimeError("this hpcdl.torch.Loader was closed")
        if not self._handling and not self._told and self.handle_signals is None:
            self._told = True
            if self.world.rank == 0:
                messages.warn(
                    "hpcdl.torch.Loader used outside a `with` block installs no SIGTERM, atexit "
                    "or excepthook handlers: a SIGTERM or an uncaught exception skips its "
                    "clean-up; use `with Loader(...)`, or Loader(..., handle_signals=True) "
                    "(or False to silence this)"
                )
        if self._iteration is not None:
            self._iteration.close()  # an epoch left early: its batches in flight are drained
        self._iteration = self._batches(self.epoch, self._next_epoch())
        return self._iteration

    def stats(self) -> dict[str, Any]:
        """Figures to log: the node's files/bytes staged, this rank's local hits and PFS misses,
        whether the stager is alive (cumulative), and the loader's reads and bad samples."""
        out: dict[str, Any] = {"staging": self.staging is not None}
        if self.staging is not None:
            out.update(self.staging.epoch_stats())
        out.update(self._loader.stats())
        return out

    def close(self) -> None:
        """Every rank together (collective): stop the workers and the stager, clean up."""
        self._leave(None)

    def abandon(self) -> None:
        """This rank alone, no collective: as close, for a rank that fails."""
        self._leave(RuntimeError)

    def __enter__(self) -> Loader:
        if self.handle_signals is not False:  # the script asked for a managed lifetime
            self._install_handlers()
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self._leave(exc_type)

    # ------------------------------------------------------------------ internals

    def _next_epoch(self) -> int | None:
        """The epoch the iteration after this one will likely read, for the workers to go on
        into (hpcdl.data.pool NOTE [the next epoch]): a script that called set_epoch before
        this epoch calls it with epoch + 1 next; one that never does reads the same epoch
        again. None after the last epoch. A wrong guess costs the batches built ahead."""
        epoch = self.epoch + 1 if self._epoch_given else self.epoch
        self._epoch_given = False
        return epoch if epoch < self.cfg.epochs else None

    def _batches(self, epoch: int, next_epoch: int | None) -> Iterator[tuple[Any, Any]]:
        order = self.sampler.batches(epoch, self.cfg.batch_size)
        then = None
        if next_epoch is not None:
            then = Upcoming(self.sampler.batches(next_epoch, self.cfg.batch_size), next_epoch, True)
        host = self._loader.iterate(order, epoch, train=True, then=then)
        if self.cfg.decode == "gpu":  # decoded on the device (or in this process): no copy
            batches = (_as_tensors(self._torch, x, y) for x, y in host)
        elif self.pin:  # copied into pinned memory in a thread (NOTE [slot lifetime])
            batches = iter(PinnedAhead(host, self._torch))
        else:
            # images: a view of the slot, no copy; labels: B int64, copied, so that the
            # common `targets.append(y)` for epoch metrics stays right
            batches = ((self._torch.from_numpy(x), self._torch.tensor(y)) for x, y in host)
        try:
            for step, (x, y) in enumerate(batches, 1):
                yield x, y
                # The script asked for the next batch: it is done with this one.
                if self.staging is not None:
                    self.staging.consumed(epoch, step)  # the stager may evict behind it
        finally:
            batches.close()
            host.close()

    def _leave(self, exc_type: Any) -> None:
        """Close (exc_type None) or abandon (an exception), once; see NOTE [closing the loader]."""
        if self.closed:
            return
        self.closed = True
        self._leaving = True
        ended_cleanly = exc_type is None
        atexit.unregister(self._abandon)
        quiet = _ignore_interrupts()  # a second Ctrl-C or SIGTERM must not cut a clean-up short
        try:
            if self._iteration is not None:
                self._iteration.close()
            if exc_type is None and not self._world_usable():
                exc_type = RuntimeError  # torch.distributed already destroyed: no collective
            self._stack.__exit__(exc_type, None, None)  # run.own: close or abandon by type
        finally:
            _restore(quiet)
            _restore(self._previous_handlers)
            if self._handling and ended_cleanly and sys.excepthook is _one_line_errors:
                sys.excepthook = _one_line_errors.previous  # NOTE [process-wide handlers]

    def _abandon(self) -> None:
        self._leave(RuntimeError)

    def _world_usable(self) -> bool:
        if self.launched_by != "torch.distributed":
            return True
        return self._torch.distributed.is_initialized()

    def _catch_signals(self) -> None:
        """SIGTERM -> SystemExit(143) in the main thread, so the clean-ups run (module notes).
        Only where nobody else handles it (a script's own handler wins)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._previous_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum: int, frame: Any) -> None:
        if self._leaving:
            return
        self._leaving = True
        messages.say("stopped by signal SIGTERM", rank=self.world.rank)
        raise SystemExit(EXIT_SIGTERM)


def _decode_xp(torch: Any) -> Any:
    """The array module decode="gpu" decodes onto: CuPy on torch's current GPU, else NumPy."""
    import numpy as np  # noqa: PLC0415

    if not torch.cuda.is_available():
        return np
    try:
        import cupy  # noqa: PLC0415
    except ImportError:
        return np
    cupy.cuda.Device(torch.cuda.current_device()).use()
    return cupy


def _as_tensors(torch: Any, images: Any, labels: Any) -> tuple[Any, Any]:
    """torch tensors over decode="gpu"'s arrays: DLPack for CuPy (no copy), else from_numpy."""
    if hasattr(images, "__cuda_array_interface__"):
        return torch.from_dlpack(images), torch.from_dlpack(labels)
    return torch.from_numpy(images), torch.from_numpy(labels)


def _ignore_interrupts() -> dict[int, Any]:
    """Ignore SIGINT and SIGTERM (main thread only); returns the handlers to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore(handlers: dict[int, Any]) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    handlers.clear()


def _start_error(message: str | None, speak: bool) -> LoaderStartError:
    if speak and message:
        messages.error(message, rank=0)
    return LoaderStartError(message)


def _one_line_errors(exc_type, exc, tb) -> None:
    """sys.excepthook: hpcdl's mid-run faults that reach the top of a script (a dead or stalled
    loader worker, an unreadable sample, a stage dir refused) print one line `hpcdl: rank R:
    error: ...`, as hpcdl.train's do; other exceptions go to the hook that was there before
    (Python's traceback, or torch.distributed's with its rank prefix). Status 1."""
    if issubclass(exc_type, (LoaderFault, DataError, StageDirError)):
        messages.error(str(exc))
    else:
        _one_line_errors.previous(exc_type, exc, tb)


_one_line_errors.previous = sys.excepthook
