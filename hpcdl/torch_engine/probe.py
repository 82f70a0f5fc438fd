"""The start-up probe of a torch.nn.Module: what would otherwise fail as a traceback from
torch.optim or the first step, said at start-up in one line (ValueError) naming --model.

NOTE [probing without a trace]
Before the module is flattened, check_parameters refuses a module without values (built on the
meta device) or without a trainable parameter (torch.optim refuses an empty list). After,
check_output runs zero samples through it twice: one in eval mode without gradients (the
logits' shape), then min(--batch-size, 2) in training mode with gradients, where modules differ
(GoogLeNet's auxiliary outputs, BatchNorm's batch statistics of a lone sample, a detached or
integer output). The training-mode forward changes state the run starts from: BatchNorm's
running statistics and batch counts, and the generator dropout draws from. So every buffer is
copied back and the generators are forked (torch.random.fork_rng), so that a run starts, and
resumes, bit for bit as without the probe. No backward runs, so no gradient hook fires. A
SyncBatchNorm normalises over this rank alone during the probe (no collective: a rank that
failed earlier would leave the others waiting).
"""

from __future__ import annotations

from typing import Any

import torch

from hpcdl.torch_engine.sync_batch_norm import SyncBatchNorm

BATCH_NORM_ONE_SAMPLE = "Expected more than 1 value per channel when training"


def check_parameters(spec: str, module: Any) -> None:
    """ValueError of one line when the module's tensors have no values (the meta device) or it
    has no trainable parameter."""
    if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        raise ValueError(
            f"--model {spec}: its parameters are on the meta device (shapes, no values); build "
            "the module on the CPU, or call .to_empty(device='cpu') and initialise it in the "
            "builder"
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"--model {spec}: the module has no trainable parameters (none, or every "
            "requires_grad is False); give it at least one layer to train"
        )


def check_output(
    spec: str,
    module: Any,
    input_shape: tuple[int, ...],
    num_classes: int,
    where: torch.device,
    samples: int,
) -> None:
    """Zero samples through the module in eval mode (1, no gradient) and training mode
    (samples, with gradients): (samples, num_classes) float logits that gradients flow back
    through, else ValueError of one line. Leaves the module's buffers and torch's generators
    as they were (NOTE [probing without a trace])."""
    zeros = torch.zeros((1, *input_shape), dtype=torch.float32, device=where)
    module.eval()
    try:
        with torch.no_grad():
            out = _forward(spec, module, zeros, input_shape, samples)
    finally:
        module.train()
    _check_logits(spec, out, input_shape, num_classes, 1, "")
    zeros = torch.zeros((samples, *input_shape), dtype=torch.float32, device=where)
    out = _training_forward(spec, module, zeros, input_shape, samples)
    _check_logits(spec, out, input_shape, num_classes, samples, " in training mode")
    if not out.is_floating_point():
        raise ValueError(
            f"--model {spec}: the module returns {out.dtype} in training mode, not float "
            "logits; return the last layer's output"
        )
    if not out.requires_grad:
        raise ValueError(
            f"--model {spec}: no gradient flows back through the module's output (detached, "
            "or computed under torch.no_grad); return logits computed from its parameters"
        )


def _training_forward(
    spec: str, module: Any, zeros: Any, input_shape: tuple[int, ...], samples: int
) -> Any:
    """module(zeros) in training mode with gradients, its buffers, generators and SyncBatchNorm
    reducers as they were before."""
    buffers = [b.detach().clone() for b in module.buffers()]
    synced = [m for m in module.modules() if isinstance(m, SyncBatchNorm)]
    reducers = [m.reducer for m in synced]
    devices = [zeros.device] if zeros.device.type == "cuda" else []
    try:
        for m in synced:
            m.reducer = None
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            return _forward(spec, module, zeros, input_shape, samples)
    finally:
        for m, reducer in zip(synced, reducers):
            m.reducer = reducer
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers):
                b.copy_(saved)


def _forward(spec: str, module: Any, zeros: Any, input_shape: tuple[int, ...], samples: int) -> Any:
    try:
        return module(zeros)
    except Exception as exc:  # the user's module: one line, whatever it raised
        text = str(exc).strip().splitlines()
        if module.training and text and text[0].startswith(BATCH_NORM_ONE_SAMPLE):
            raise ValueError(
                f"--model {spec}: BatchNorm needs more than 1 sample per rank in training: "
                f"raise --batch-size (now {samples})"
            ) from None
        what = "one sample" if len(zeros) == 1 else f"{len(zeros)} samples"
        mode = " in training mode" if module.training else ""
        raise ValueError(
            f"--model {spec}: {what} of shape {tuple(input_shape)} through the module{mode} "
            f"raised {type(exc).__name__}: {text[0] if text else ''}"
        ) from None


def _check_logits(
    spec: str, out: Any, input_shape: tuple[int, ...], num_classes: int, n: int, mode: str
) -> None:
    if not isinstance(out, torch.Tensor):
        hint = (
            " (torchvision's googlenet and inception_v3: build them with aux_logits=False in "
            "your own FILE.py:FN)"
            if mode
            else ""
        )
        raise ValueError(
            f"--model {spec}: the module returns {type(out).__name__}{mode}, not a logits "
            f"tensor; return the logits alone{hint}"
        )
    if tuple(out.shape) != (n, num_classes):
        raise ValueError(
            f"--model {spec}: for input {tuple(input_shape)} the module returns "
            f"{tuple(out.shape)}{mode} per batch of {n}, not ({n}, {num_classes}) logits; end "
            f"it with {num_classes} outputs"
        )
