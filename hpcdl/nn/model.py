"""A model: a layer sequence bound to ONE flat parameter buffer and ONE flat gradient buffer.

Layout is back-to-front: the leaf layers are laid out in the order backward finishes them, so
the last layer's parameters sit at offset 0 and `grad_ready(n)` reports a growing prefix
grads[:n] as final. Layers see their parameters as reshaped views (`layer.p[name]`), so an
optimizer that updates `model.params` in place updates every layer at once.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.backend import array_module, is_device_array
from hpcdl.nn import kernels
from hpcdl.nn.blocks import Sequential
from hpcdl.nn.dtypes import StepDtypes, step_dtypes
from hpcdl.nn.init import initial_values
from hpcdl.nn.layers import Dropout, Layer
from hpcdl.nn.norm import BatchNorm
from hpcdl.nn.precision import check_precision, rounding

# Elements after the gradients in Model.grads_and_flags, written by each step (hpcdl.nn.step):
# [0] ranks whose loss was not finite, [1] gradient ranges that overflowed. The gradient
# allreduce sums them with the gradients, so the ranks agree on both without a collective of
# their own.
STEP_FLAGS = 2
FLAG_LOSS, FLAG_OVERFLOW = 0, 1
ALIGN_BYTES = 16  # where each layer's views start, as far as one shift allows (aligned_zeros)


class Model:
    """Layers + flat buffers. Input (N, C, H, W); logits (N, num_classes); dtype of the buffers."""

    def __init__(
        self,
        name: str,
        layers: list[Layer],
        input_shape: tuple[int, int, int],
        num_classes: int,
        seed: int = 0,
        xp: ModuleType = np,
        dtype: Any = np.float32,
    ) -> None:
        self.name = name
        self.input_shape = tuple(int(d) for d in input_shape)
        self.num_classes = num_classes
        self.dtype = np.dtype(dtype)
        self.body = Sequential(layers)
        self._rng = np.random.default_rng(seed)
        for leaf in self.body.leaves():
            if isinstance(leaf, Dropout):
                leaf.rng = self._rng
        # grads_and_flags (P + STEP_FLAGS,): the gradients, then the step's flags
        # (hpcdl.nn.step), one buffer so the gradient allreduce carries the flags too.
        self.params, self.grads_and_flags, self.buffers, self._layout = bind_flat(
            self.body, xp, self.dtype, seed, spare=STEP_FLAGS
        )
        self.grads = self.grads_and_flags[: self.params.size]  # (P,) what backward writes
        self.step_flags = self.grads_and_flags[self.params.size :]  # (STEP_FLAGS,)
        # What the layers compute with: the params themselves, or a rounded copy of them
        # (set_precision).
        self._compute_params = self.params
        self.precision = "fp32"
        self.dtypes: StepDtypes = step_dtypes("fp32", real=False)  # what the step's arrays hold
        self._round: Callable[[Any], None] | None = None
        # The first parameterised layer's input is data: skip its input gradient (and any
        # parameter-free layers before it) in backward.
        self._first = 0
        for i, layer in enumerate(layers):
            if any(True for leaf in layer.leaves() if leaf.param_specs):
                if layer.param_specs:
                    self._first = i
                    layer.input_grad = False
                break

    def layout(self) -> list[tuple[str, tuple[int, ...], int]]:
        """[(param_name, shape, offset), ...] in buffer order (offset 0 = last layer)."""
        return list(self._layout)

    @property
    def num_params(self) -> int:
        return int(self.params.size)

    def set_precision(self, precision: str, real: bool | None = None) -> None:
        """Compute in bf16 or fp16 (hpcdl.nn.precision); fp32: as built.

        self.params becomes a new float32 array, the master the optimizer updates (so call this
        before an optimizer takes self.params); the layers keep their views of the old buffer,
        which every forward refills with the masters rounded to the format.

        real: activations and their gradients are arrays of the format from layer to layer
        (hpcdl.nn.dtypes), not float32 rounded to it. None: real with the fast kernels
        (--gpu-kernels) on a device, emulated otherwise; True on NumPy runs the same dtype
        logic through ml_dtypes (tests)."""
        check_precision(precision)
        if precision == self.precision:
            return
        if self.precision != "fp32" or self.dtype != np.float32:
            raise ValueError(
                f"precision {precision} needs a float32 model at fp32, got {self.dtype} at "
                f"{self.precision}"
            )
        if real is None:
            real = kernels.enabled() and is_device_array(self.params)
        self.dtypes = step_dtypes(precision, real)
        self.precision, self._round = precision, rounding(precision)
        self.params = self._compute_params.copy()  # the float32 master the optimizer updates
        for leaf in self.body.leaves():  # a fast kernel may take the format's arrays
            leaf.precision = precision
        for layer in _containers(self.body):
            if isinstance(layer, Sequential):  # real arrays hold the format: nothing to round
                layer.rounding = None if self.dtypes.real else self._round

    def forward(self, x: Any, train: bool = True) -> Any:
        """x (N, C, H, W) -> logits (N, num_classes) in the model's dtype (float32 logits with
        real half arrays: the loss sums in float32)."""
        if x.ndim != 4 or tuple(x.shape[1:]) != self.input_shape:
            c, h, w = self.input_shape
            raise ValueError(
                f"model {self.name!r} expects input of shape (N, {c}, {h}, {w}), "
                f"got {tuple(x.shape)}"
            )
        xp = array_module(x)
        held = self.dtypes.activations if self.dtypes.real else self.dtype
        h = xp.ascontiguousarray(x.transpose(0, 2, 3, 1), dtype=held)  # (N, H, W, C)
        if self._round is not None:
            if h.dtype == self.dtype and xp.may_share_memory(h, x):  # never round the
                h = h.copy()  # caller's batch in place
            if h.dtype == self.dtype:
                self._round(h)
            self._compute_params[...] = self.params  # this step's weights, rounded
            self._round(self._compute_params)
        logits = self.body.forward(h, train)
        return logits.astype(self.dtype, copy=False)

    def backward(self, dlogits: Any, grad_ready: Callable[[int], None] | None = None) -> None:
        """Write d(loss)/d(params) into self.grads; grad_ready(n) when grads[:n] are final."""
        if self.dtypes.real:  # (N, K): the format's array from here down
            dy = dlogits.astype(self.dtypes.activations)
            self.body.backward_from(self._first, dy, grad_ready)
            return
        dy = dlogits.astype(self.dtype, copy=False)
        if self._round is not None:
            dy = dy.copy() if dy is dlogits else dy  # the caller's array stays as it was
            self._round(dy)
        self.body.backward_from(self._first, dy, grad_ready)

    def decay_mask(self) -> Any:
        """(P,) array on the params' backend, in their dtype: 0 for biases and BatchNorm, else 1.

        Multiplies the weight decay when biases and norms are excluded from it."""
        names = leaf_names(self.body)
        offsets = {name: off for name, _, off in self._layout}
        host = np.ones(self.num_params, dtype=self.dtype)
        for leaf in self.body.leaves():
            for spec in leaf.param_specs:
                if not spec.decay:
                    off = offsets[f"{names[id(leaf)]}.{spec.name}"]
                    host[off : off + int(np.prod(spec.shape))] = 0
        return array_module(self.params).asarray(host)

    def set_stat_reducer(self, reduce: Callable[[Any], None] | None) -> None:
        """Make every BatchNorm sum its batch statistics over ranks (SyncBatchNorm); None: local.

        `reduce(buf)` must sum the small flat array `buf` (on the model's backend) over all
        ranks in place, and every rank must call the model the same way (it is collective).
        """
        for leaf in self.body.leaves():
            if isinstance(leaf, BatchNorm):
                leaf.stat_reducer = reduce

    def get_rng_state(self) -> dict:
        """Dropout RNG state (JSON-able)."""
        return self._rng.bit_generator.state

    def set_rng_state(self, state: dict) -> None:
        self._rng.bit_generator.state = state


def bind_flat(
    root: Layer, xp: ModuleType = np, dtype: Any = np.float32, seed: int = 0, spare: int = 0
) -> tuple[Any, Any, Any, list[tuple[str, tuple[int, ...], int]]]:
    """Allocate flat (params, grads, buffers) for root's leaf layers and bind views into them.

    Returns the three (P,), (P + spare,), (S,) arrays on xp and the layout [(name, shape,
    offset)]; the spare elements after the gradients belong to the caller (Model.step_flags).
    Leaves are laid out in backward order; values are initialised in forward order from seed.
    """
    leaves = list(root.leaves())
    names = leaf_names(root)
    p_sizes = [int(np.prod(s.shape)) for leaf in leaves for s in leaf.param_specs]
    s_sizes = [int(np.prod(shape)) for leaf in leaves for _, shape, _ in leaf.buffer_specs]
    p_total, s_total = sum(p_sizes), sum(s_sizes)
    host_params = np.zeros(p_total, dtype=dtype)
    host_buffers = np.zeros(s_total, dtype=dtype)
    params = aligned_zeros(xp, p_total, dtype, p_sizes)
    grads = aligned_zeros(xp, p_total + spare, dtype, p_sizes)
    buffers = aligned_zeros(xp, s_total, dtype, s_sizes)
    layout: list[tuple[str, tuple[int, ...], int]] = []
    offset = b_offset = 0
    placed = []
    for leaf in leaves:
        p, g, b = {}, {}, {}
        for spec in leaf.param_specs:
            size = int(np.prod(spec.shape))
            layout.append((f"{names[id(leaf)]}.{spec.name}", spec.shape, offset))
            p[spec.name] = params[offset : offset + size].reshape(spec.shape)
            g[spec.name] = grads[offset : offset + size].reshape(spec.shape)
            offset += size
        for buf_name, shape, fill in leaf.buffer_specs:
            size = int(np.prod(shape))
            host_buffers[b_offset : b_offset + size] = fill
            b[buf_name] = buffers[b_offset : b_offset + size].reshape(shape)
            b_offset += size
        placed.append((leaf, p, g, b, offset))
    # Initialise in forward order so the values do not depend on the layout.
    init_rng = np.random.default_rng(seed)
    by_name = {name: off for name, _, off in layout}
    for leaf in reversed(leaves):
        for spec in leaf.param_specs:
            off = by_name[f"{names[id(leaf)]}.{spec.name}"]
            size = int(np.prod(spec.shape))
            host_params[off : off + size] = initial_values(init_rng, spec).ravel()
    params[...] = xp.asarray(host_params)
    buffers[...] = xp.asarray(host_buffers)
    for leaf, p, g, b, end in placed:
        leaf.bind(p, g, b, end)
    return params, grads, buffers, layout


def aligned_zeros(xp: ModuleType, size: int, dtype: Any, sizes: list[int]) -> Any:
    """xp.zeros(size) whose views of `sizes` (laid out back to back from 0) start on an
    ALIGN_BYTES boundary where one shift can put them there: a view into a slightly larger
    allocation, starting `pad` elements in, pad chosen for the most aligned views. cuDNN
    declares every tensor 16-byte aligned, and the runtime copies a misaligned one in and out
    on every run (NOTE [cuDNN graphs]): behind a 10-class Linear bias (40 bytes) every view of
    a ResNet was. Sizes and offsets stay those of the layout (checkpoints, the reducer and
    export read them); the allocation is assumed aligned (NumPy's and CuPy's are)."""
    per = max(1, ALIGN_BYTES // np.dtype(dtype).itemsize)
    starts = np.cumsum([0, *sizes[:-1]]) if sizes else np.zeros(0, np.int64)
    pad = max(range(per), key=lambda p: (int(((starts + p) % per == 0).sum()), -p))
    return xp.zeros(size + pad, dtype=dtype)[pad:]


def rank_rng_state(seed: int, rank: int) -> dict:
    """A dropout RNG state distinct per rank and reproducible from (seed, rank)."""
    seq = np.random.SeedSequence(entropy=seed, spawn_key=(rank,))
    return np.random.PCG64(seq).state


def leaf_names(root: Layer) -> dict[int, str]:
    """Stable readable names: '<index>.<Class>' paths in forward order, e.g. '3.branch.0.Conv2d'."""
    names: dict[int, str] = {}

    def walk(layer: Layer, prefix: str) -> None:
        children = layer.named_children()
        if not children:
            names[id(layer)] = f"{prefix}{type(layer).__name__}"
        for key, child in children:
            walk(child, f"{prefix}{key}.")

    walk(root, "")
    return names


def _containers(root: Layer) -> list[Layer]:
    """root and every layer below it that has children (named_children), in forward order."""
    found = [root]
    for _, child in root.named_children():
        if child.named_children():
            found.extend(_containers(child))
    return found
