"""Fast kernels for Dropout (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

PhiloxDropout: the mask is Philox4x32-10 words (hpcdl.nn.philox) under a 64-bit seed the layer
draws from the model's dropout generator per mask, as the reference draws its seed: no
generator is built per mask, and NumPy and CuPy give the same mask for the same seed (a word
kept when >= keep_threshold(rate)), so a CPU run and a GPU run drop the same elements. The
reference instead builds xp.random.default_rng(seed) per mask, whose streams differ between
NumPy and CuPy. On CuPy one ElementwiseKernel writes the mask and the output in one pass.
Backward multiplies by the kept mask, as the reference does.

NOTE [dropout keys in a graph]
A captured step cannot draw on the host, and a mask's key baked into a graph would repeat
every replay. So while a step is captured (KeyFeed.recording), each dropout layer's kernel
reads its key from a 2-word device array of the layer's (`fed_key`, made before the capture
with the caller's allocator, not the graph's pool, and without a kernel, so the graph holds no
write to it and no temporary of the graph shares its memory) and draws nothing; the feed
notes the layers in the order the forward reached them. Before each replay the step graph
calls KeyFeed.draw(), which draws each layer's seed from its generator on the host in that
order, as a plain step's forward would, and copies it into the layer's key on the caller's
stream, which the replay follows. The generators' states, the masks and so the steps are the
plain steps', bitwise. A dropout the kernel does not take (a non-contiguous input) cannot be
fed: its capture raises, and the step runs plainly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.nn import philox
from hpcdl.nn.threads import split_multiply

# (in_params, out_params, body) of the CuPy kernel, built with philox.CUDA_SOURCE
KERNEL_SOURCE = (
    "T x, uint32 k0, uint32 k1, uint32 threshold, T scale",
    "T mask, T y",
    "mask = hpcdl_philox_word(i, k0, k1) >= threshold ? scale : (T)0; y = x * mask;",
)
# the same with the key read from a layer's device array (NOTE [dropout keys in a graph])
FED_KERNEL_SOURCE = (
    "T x, raw uint32 key, uint32 threshold, T scale",
    "T mask, T y",
    "mask = hpcdl_philox_word(i, key[0], key[1]) >= threshold ? scale : (T)0; y = x * mask;",
)
_CUPY_KERNELS: dict[str, Any] = {}  # built on first use: compiling needs a GPU


def _cupy_kernel(cp: Any, fed: bool = False) -> Any:
    name = "hpcdl_philox_dropout_fed" if fed else "hpcdl_philox_dropout"
    if name not in _CUPY_KERNELS:
        source = FED_KERNEL_SOURCE if fed else KERNEL_SOURCE
        _CUPY_KERNELS[name] = cp.ElementwiseKernel(*source, name, preamble=philox.CUDA_SOURCE)
    return _CUPY_KERNELS[name]


class KeyFeed:
    """The dropout keys of a captured step: which layers read a fed key, in forward order, and
    the host draws that fill them before each replay (NOTE [dropout keys in a graph])."""

    def __init__(self) -> None:
        self.layers: list[Any] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Dropout layers' forwards read fed keys and are noted (a capture)."""
        global _FEED
        self.layers, _FEED = [], self
        try:
            yield
        finally:
            _FEED = None

    @staticmethod
    def make_keys(layers: list[Any], xp: Any) -> None:
        """Each layer's fed key, made once and before a capture, outside the graph's memory
        pool: a block allocated during the capture may be one an earlier kernel of the same
        graph used for a temporary, which each replay would write over after the host had
        written the key (cnn's graph and plain steps differed so on the H200, 2026-11-29)."""
        for layer in layers:
            if getattr(layer, "fed_key", None) is None:
                layer.fed_key = xp.empty(2, np.uint32)

    def note(self, layer: Any, xp: Any) -> Any:
        """The layer's fed key (make_keys made it), the layer noted."""
        if getattr(layer, "fed_key", None) is None:
            raise RuntimeError("a dropout layer's key was not made before the capture")
        self.layers.append(layer)
        return layer.fed_key

    def draw(self) -> None:
        """Each noted layer's next seed, drawn as its plain forward would, into its key."""
        for layer in self.layers:
            seed = int(layer.rng.integers(2**63))
            layer.fed_key[...] = array_module(layer.fed_key).asarray(_key_words(seed))


_FEED: KeyFeed | None = None  # the feed a capture records into; None outside a capture


def feeding() -> bool:
    """Whether a step is being captured with fed dropout keys."""
    return _FEED is not None


def _key_words(seed: int) -> np.ndarray:
    return np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32)


def _seed_of(key: Any) -> int:
    words = [int(word) for word in key]
    return words[0] | words[1] << 32


class PhiloxDropout:
    """Counter-based dropout on NumPy and CuPy (contiguous inputs)."""

    name = "philox"

    def applies(self, layer: Any, x: Any) -> bool:
        return bool(x.flags.c_contiguous)

    def forward(self, layer: Any, x: Any, train: bool) -> Any:
        xp = array_module(x)
        key = _FEED.note(layer, xp) if _FEED is not None else None
        threshold = philox.keep_threshold(layer.rate)
        scale = x.dtype.type(1.0 / (1.0 - layer.rate))
        if xp is np:  # a fed key is read when the kernel runs: here, now
            seed = int(layer.rng.integers(2**63)) if key is None else _seed_of(key)
            keep = philox.words(seed, x.size).reshape(x.shape) >= threshold
            mask = layer.mask = np.multiply(keep, scale, dtype=x.dtype)
            return split_multiply(x, mask)
        if key is not None:
            mask, y = _cupy_kernel(xp, fed=True)(x, key, np.uint32(threshold), scale)
        else:
            seed = int(layer.rng.integers(2**63))  # one draw per mask, as the reference's
            words = _key_words(seed)
            mask, y = _cupy_kernel(xp)(x, words[0], words[1], np.uint32(threshold), scale)
        layer.mask = mask
        return y

    def backward(self, layer: Any, dy: Any) -> Any:
        return split_multiply(dy, layer.mask)


KERNELS: list[Any] = [PhiloxDropout()]
