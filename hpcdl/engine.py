"""The seam between a training run and the engine that computes its model: what the loop needs.

NOTE [the engine seam]
hpcdl.train's loop, its start-up (hpcdl.startup) and its checkpoints (hpcdl.resume) talk to
the model only through an Engine. Two implement it:
- hpcdl.array_engine: hpcdl's own NumPy/CuPy models (hpcdl.nn), the step hpcdl.nn.step runs;
- hpcdl.torch_engine: a torch.nn.Module (`--model FILE.py:FN` returning one, or
  `--model torchvision:NAME`), stepped by torch.optim; the only one that imports torch.
hpcdl.engines.build_engine picks one from --model (a torch model is told apart by its type)
and no other module of the run asks which it got. Both engines average the gradients with
hpcdl.comm.reducer.GradientReducer (bucketed, overlapped with backward), keep the step's
non-finite-loss flag after the gradients (so the gradient allreduce carries it), and present
their state for checkpoints as flat float32 vectors (Checkpointable), so hpcdl.checkpoint's one
file format, its compatibility checks and `--resume auto` serve both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from hpcdl.nn.step import StepResult


class Checkpointable(Protocol):
    """The model as hpcdl.resume saves and restores it: flat vectors and per-rank RNG state."""

    name: str  # recorded in the checkpoint; a resume must build the same
    params: Any  # (P,) float32, writable in place (on the engine's device)
    buffers: Any  # (S,) float32 running statistics (BatchNorm), writable in place

    def layout(self) -> list[tuple[str, tuple[int, ...], Any]]: ...
    def get_rng_state(self) -> Any: ...  # JSON-able
    def set_rng_state(self, state: Any) -> None: ...


class Engine(Protocol):
    """What hpcdl.train's loop needs of the engine that runs its model."""

    kind: str  # "hpcdl" or "torch": the start record names it
    xp: Any  # array module of StepResult.loss and .nonfinite_ranks (hpcdl.nn.loss_watch)
    model: Checkpointable
    optimizer: Any  # state_dict() / load_state_dict() of flat arrays, for checkpoints
    scaler: Any  # --precision fp16: hpcdl.nn.precision.LossScaler; else None

    @property
    def precision_line(self) -> str:
        """What --precision bf16 or fp16 does in this engine: said at start."""
        ...

    @property
    def tf32_line(self) -> str | None:
        """Where --tf32 changes nothing in this engine on this device, the start-up line that
        says so (tf32_unused); None where it takes effect."""
        ...

    @property
    def flags_agreed(self) -> bool:
        """The gradient allreduce carries every rank's non-finite-loss flag (no collective of
        its own is needed to agree on a NaN loss)."""
        ...

    def batches(self, host: Iterable, decoded: bool = False) -> Iterable:
        """The loader's batches (images (B, C, H, W) float32, labels (B,) int64) as the step
        takes them: NumPy from the workers, or decoded: decoded in the rank (--decode gpu)
        onto the run's array module (CuPy on a GPU), labels possibly NumPy."""
        ...

    def step(
        self, images: Any, labels: Any, lr: float, mix_params: bool, waited_since: float,
        timed: bool,
    ) -> StepResult:  # fmt: skip
        """One data-parallel step at learning rate lr (hpcdl.nn.step.train_step's contract):
        forward, loss, backward handing gradient buckets to the reducer, the update."""
        ...

    def correct(self, logits: Any, labels: Any) -> Any:
        """How many rows' arg-max is the label (a scalar int() reads)."""
        ...

    def evaluate(self, images: Any, labels: Any) -> tuple[float, int]:
        """(mean loss, right answers) of one validation batch, in inference mode."""
        ...

    def average_buffers(self) -> None:
        """Collective: the running statistics (BatchNorm) become their mean over the ranks."""
        ...


def tf32_unused(where: str) -> str:
    """The start-up line of a --tf32 that changes nothing on `where` (NOTE [TF32])."""
    return f"hpcdl: --tf32 changes nothing on {where}: float32 stays IEEE float32"
