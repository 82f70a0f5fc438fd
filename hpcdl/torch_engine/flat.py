"""A torch.nn.Module whose parameters, float buffers and gradients are views of flat vectors
(NOTE [a module in flat vectors] in hpcdl/torch_engine/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hpcdl.config import TrainConfig
from hpcdl.nn.model import FLAG_OVERFLOW
from hpcdl.nn.user_models import model_name
from hpcdl.torch_engine import probe
from hpcdl.torch_engine.device import as_array
from hpcdl.torch_engine.sync_batch_norm import SyncBatchNorm

CPU = torch.device("cpu")


class FlatModule:
    """The module, its parameters in one (P,) float32 vector (`params`, NumPy view), its float
    buffers in one (S,) vector (`buffers`) and its gradients followed by the step's flags in
    `grads_and_flags`. What hpcdl.resume saves and restores (hpcdl.engine.Checkpointable)."""

    def __init__(
        self,
        module: Any,
        cfg: TrainConfig,
        input_shape: tuple[int, ...],
        num_classes: int,
        where: torch.device = CPU,
    ) -> None:
        probe.check_parameters(cfg.model, module)  # before .to(): a meta tensor cannot move
        if where.type != "cpu":  # before the views: .to() would give the tensors new memory
            module.to(where)
        self.module = module.train()
        self.device = where
        torchvision = cfg.model.startswith("torchvision:")
        self.name = cfg.model if torchvision else model_name(cfg.model)  # as checkpoints say
        named = list(module.named_parameters())[::-1]  # backward finishes the last first
        for name, tensor in [*named, *module.named_buffers()]:
            if tensor.is_floating_point() and tensor.dtype != torch.float32:
                raise ValueError(
                    f"--model {cfg.model}: {name} is {tensor.dtype}; the torch engine trains "
                    "float32 modules (leave the dtype to --precision)"
                )
        self.names = [name for name, _ in named]
        self.tensors = [p for _, p in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.offsets = _offsets([p.numel() for _, p in named])
        flat = _flatten([p for _, p in named], self.offsets, where)
        self.params = as_array(flat)  # NumPy on the CPU, CuPy on a GPU: the same memory
        floats = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
        self.counters = [(n, b) for n, b in module.named_buffers() if not b.is_floating_point()]
        sizes = _offsets([b.numel() for _, b in floats])
        self.buffers = as_array(_flatten([b for _, b in floats], sizes, where))
        total = self.offsets[-1]
        self.grads_and_flags = torch.zeros(
            total + FLAG_OVERFLOW + 1, dtype=torch.float32, device=where
        )
        self.grads = self.grads_and_flags[:total]
        self.grads_host = as_array(self.grads)  # shares memory: LossScaler.unscale divides it
        self.flags = self.grads_and_flags[total:]
        self.flags_host = as_array(self.flags)  # on a GPU: device scalars, read when logged
        for (_, p), lo, hi in zip(named, self.offsets, self.offsets[1:]):
            p.grad = self.grads_and_flags[lo:hi].view(p.shape)
        self._ready = _ReadyPrefix([p for _, p in named], self.offsets)
        probe.check_output(
            cfg.model, module, input_shape, num_classes, where, _probe_samples(cfg, module)
        )

    def layout(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(name, shape, offset in params) of every parameter, in the vector's order."""
        return list(zip(self.names, self.shapes, self.offsets, strict=False))

    def begin_backward(self, mark_ready: Callable[[int], None] | None) -> None:
        """The next backward hands every finished prefix of the gradients to mark_ready."""
        self._ready.begin(mark_ready)

    def seeded_rng_state(self, seed: int) -> dict[str, Any]:
        """The state a fresh run's rank starts from: torch's generator seeded with seed."""
        return {"torch": torch.Generator().manual_seed(seed).get_state().numpy().tobytes().hex()}

    def get_rng_state(self) -> dict[str, Any]:
        """torch's CPU generator (dropout) and the integer buffers (BatchNorm's batch counts)."""
        return {
            "torch": torch.get_rng_state().numpy().tobytes().hex(),
            "counters": {name: int(b) for name, b in self.counters if b.numel() == 1},
        }

    def set_rng_state(self, state: dict[str, Any]) -> None:
        raw = bytes.fromhex(state["torch"])
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        counters = state.get("counters", {})
        for name, b in self.counters:
            if name in counters:
                b.fill_(int(counters[name]))


class _ReadyPrefix:
    """Post-accumulate-grad hooks that report the longest prefix of final gradients."""

    def __init__(self, params: list[Any], offsets: list[int]) -> None:
        self.index = {p: i for i, p in enumerate(params)}
        self.offsets = offsets
        self.frozen = [not p.requires_grad for p in params]  # final at once: zero gradients
        self.ready = list(self.frozen)
        self.prefix = 0
        self.mark_ready: Callable[[int], None] | None = None
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def begin(self, mark_ready: Callable[[int], None] | None) -> None:
        self.ready = list(self.frozen)
        self.prefix = 0
        self.mark_ready = mark_ready

    def _hook(self, p: Any) -> None:
        self.ready[self.index[p]] = True
        while self.prefix < len(self.ready) and self.ready[self.prefix]:
            self.prefix += 1
        if self.mark_ready is not None:
            self.mark_ready(self.offsets[self.prefix])


def _offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def _flatten(tensors: list[Any], offsets: list[int], where: torch.device) -> Any:
    """One float32 vector on where holding tensors' values; each tensor becomes a view of its
    slice."""
    flat = torch.empty(offsets[-1], dtype=torch.float32, device=where)
    with torch.no_grad():
        for t, lo, hi in zip(tensors, offsets, offsets[1:]):
            flat[lo:hi].copy_(t.detach().reshape(-1))
            t.data = flat[lo:hi].view(t.shape)
    return flat


def _probe_samples(cfg: TrainConfig, module: Any) -> int:
    """The training-mode probe's batch: a rank's, up to 2; 2 where SyncBatchNorm normalises
    over several ranks (the probe's over this one alone)."""
    synced = any(isinstance(m, SyncBatchNorm) and m.reducer is not None for m in module.modules())
    return 2 if synced else min(cfg.batch_size, 2)
