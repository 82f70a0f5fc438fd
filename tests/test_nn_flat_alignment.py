"""The flat parameter, gradient and statistics buffers start each layer's views on a 16-byte
boundary where one shift of the whole buffer can (hpcdl.nn.model.bind_flat): cuDNN declares
every tensor 16-byte aligned, and a misaligned view (BatchNorm's gamma, beta, running
statistics and their gradients, behind a 10-class Linear bias of 40 bytes) went through an
aligned copy in and out on every run of its graph (NOTE [cuDNN graphs]): some 10 small copies
per BatchNorm and step. The buffers' sizes and offsets are unchanged (checkpoints, the reducer,
export read them), only where the allocation starts."""

import numpy as np
import pytest
from fake_cudnn import Module, install

from hpcdl import nn
from hpcdl.nn import kernels
from hpcdl.nn.kernels import cudnn_graphs

ALIGN = 16


def misaligned(arrays):
    return [a.shape for a in arrays if a.__array_interface__["data"][0] % ALIGN]


@pytest.mark.parametrize("classes", [10, 7, 1000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_batchnorm_view_of_a_resnet_starts_on_a_16_byte_boundary(classes, dtype):
    model = nn.build_model("resnet20", (3, 8, 8), classes, seed=1, dtype=dtype)
    norms = [leaf for leaf in model.body.leaves() if isinstance(leaf, nn.BatchNorm)]
    arrays = [a for bn in norms for a in (*bn.p.values(), *bn.g.values(), *bn.b.values())]
    assert len(arrays) == 6 * len(norms) > 0
    assert misaligned(arrays) == []
    # the buffers keep their sizes: the shift is before them, inside their allocation
    assert model.params.size == sum(int(np.prod(s)) for _, s, _ in model.layout())
    assert model.grads.size == model.params.size and model.params.flags.c_contiguous


def test_a_resnet_step_with_the_kernels_makes_no_aligned_copies(monkeypatch):
    """The stand-in cuDNN refuses a misaligned address as a GPU does; the runtime copies such an
    array into an aligned workspace of its own (cudnn_aligned:*): none is made now."""
    install(monkeypatch, Module(), enable=True)
    model = nn.build_model("resnet20", (3, 8, 8), 10, seed=1)
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    model.backward(nn.softmax_cross_entropy(model.forward(x), np.array([1, 7]))[1])
    work = cudnn_graphs.runtime().work
    assert not [name for name in work._arrays if name.startswith("cudnn_aligned:")]


def test_a_view_no_shift_can_align_still_runs_through_an_aligned_copy(monkeypatch):
    """5 channels: gamma at 0 and beta at 5 floats cannot both start on a boundary; beta goes
    through the runtime's aligned copy and the layer still gives the reference."""
    install(monkeypatch, Module(), enable=True)
    layers = []
    for _ in range(2):
        bn = nn.BatchNorm(5)
        nn.Model("b", [bn], (5, 6, 6), 10, seed=2)
        layers.append(bn)
    fast, ref = layers
    x = np.random.default_rng(0).standard_normal((4, 6, 6, 5)).astype(np.float32)
    y = fast.forward(x)
    work = cudnn_graphs.runtime().work
    assert [name for name in work._arrays if name.startswith("cudnn_aligned:")]
    monkeypatch.setattr(kernels, "_enabled", False)
    np.testing.assert_allclose(y, ref.forward(x), rtol=1e-5, atol=1e-5)
