"""hpcdl.nn.philox: Philox4x32-10 against Random123's known answers, and the dropout kernel
that uses it, on CPU and (marked gpu) the same mask from CuPy."""

import numpy as np
import pytest
from cuda_on_cpu import CpuKernel

from hpcdl import nn
from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.nn import kernels, philox
from hpcdl.nn.kernels import dropout as dropout_kernels
from hpcdl.nn.kernels.dropout import FED_KERNEL_SOURCE, KERNEL_SOURCE, KeyFeed

# Random123's tests/kat_vectors for philox4x32_10: (counter, key, expected words)
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS, ids=["zero", "ones", "pi"])
def test_philox4x32_10_gives_random123s_known_answers(counter, key, expected):
    got = philox.philox4x32([np.array([w], np.uint32) for w in counter], key)
    assert tuple(int(w) for w in got[:, 0]) == expected


def test_words_follow_the_counter_layout_and_any_prefix_is_the_same():
    seed = 0x123456789ABCDEF0
    n = 4 * 5 + 3
    got = philox.words(seed, n)
    block = 4  # element 17: word 1 of block 4
    one = philox.philox4x32(
        [np.array([block], np.uint32), np.zeros(1, np.uint32), np.zeros(1, np.uint32),
         np.zeros(1, np.uint32)],
        (seed & 0xFFFFFFFF, seed >> 32),
    )  # fmt: skip
    assert got[17] == one[1, 0] and got.dtype == np.uint32 and got.shape == (n,)
    np.testing.assert_array_equal(philox.words(seed, 7), got[:7])


def test_keep_threshold_drops_the_rate_of_uniform_words():
    words = philox.words(7, 200_000)
    kept = (words >= philox.keep_threshold(0.3)).mean()
    assert abs(kept - 0.7) < 0.005
    assert philox.keep_threshold(0.0) == 0


def philox_model(monkeypatch, seed=3):
    monkeypatch.setattr(kernels, "_enabled", True)
    model = nn.Model("d", [nn.Flatten(), nn.Dropout(0.25)], (2, 4, 8), 64, seed=seed)
    model.set_rng_state(nn.rank_rng_state(seed, 0))
    return model, model.body.layers[1]


def test_dropout_takes_philox_when_kernels_are_on_and_its_mask_is_the_words(monkeypatch):
    model, layer = philox_model(monkeypatch)
    x = np.random.default_rng(0).standard_normal((5, 2, 4, 8)).astype(np.float32)
    rng = np.random.default_rng()
    rng.bit_generator.state = model.get_rng_state()
    mask_seed = int(rng.integers(2**63))  # what the layer draws for this mask
    y = model.body.forward(x, train=True)
    assert isinstance(layer.seam.kernel, dropout_kernels.PhiloxDropout)
    keep = philox.words(mask_seed, y.size) >= philox.keep_threshold(0.25)
    scale = np.float32(1 / 0.75)  # inverted dropout, as the reference
    np.testing.assert_array_equal(y.reshape(-1), np.where(keep, x.reshape(-1) * scale, 0.0))
    dy = np.ones_like(y)
    np.testing.assert_array_equal(layer.backward(dy).reshape(-1), np.where(keep, scale, 0.0))


def test_philox_dropout_repeats_for_the_same_rng_state_and_moves_on_after(monkeypatch):
    model, _ = philox_model(monkeypatch)
    x = np.ones((4, 2, 4, 8), np.float32)
    state = model.get_rng_state()
    first = model.body.forward(x, train=True)
    second = model.body.forward(x, train=True)
    model.set_rng_state(state)
    np.testing.assert_array_equal(model.body.forward(x, train=True), first)
    assert not np.array_equal(first, second)


def test_the_kernels_cuda_source_run_on_the_cpu_gives_the_words_mask(tmp_path):
    """The dropout kernel's own CUDA (and philox.CUDA_SOURCE) built for the CPU
    (tests/cuda_on_cpu.py): its mask is NumPy's words >= threshold, its output x * mask."""
    kernel = CpuKernel(*KERNEL_SOURCE, philox.CUDA_SOURCE, tmp_path, types={"T": "float32"},
                       scalars=frozenset({"k0", "k1", "threshold", "scale"}))  # fmt: skip
    seed, rate, n = (0xDEADBEEF << 32) | 0x01234567, 0.3, 4099
    x = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    scale = np.float32(1 / (1 - rate))
    mask, y = np.empty_like(x), np.empty_like(x)
    kernel(x, seed & 0xFFFFFFFF, seed >> 32, philox.keep_threshold(rate), scale, mask, y, size=n)
    keep = philox.words(seed, n) >= philox.keep_threshold(rate)
    np.testing.assert_array_equal(mask, np.where(keep, scale, np.float32(0)))
    np.testing.assert_array_equal(y, x * mask)
    assert 0.25 < 1 - keep.mean() < 0.35


def test_the_fed_kernel_reads_its_key_from_memory_and_gives_the_same_mask(tmp_path):
    """The graph's variant (NOTE [dropout keys in a graph]): the key is two words in device
    memory, read when the kernel runs; the mask is the by-value kernel's for the same seed."""
    kernel = CpuKernel(*FED_KERNEL_SOURCE, philox.CUDA_SOURCE, tmp_path, types={"T": "float32"},
                       scalars=frozenset({"threshold", "scale"}))  # fmt: skip
    x = np.ones(1000, np.float32)
    key, mask, y = np.empty(2, np.uint32), np.empty_like(x), np.empty_like(x)
    threshold = philox.keep_threshold(0.5)
    for seed in (7, (0xDEADBEEF << 32) | 0x01234567):
        key[...] = [seed & 0xFFFFFFFF, seed >> 32]  # what KeyFeed.draw writes, between replays
        kernel(x, key, threshold, np.float32(2.0), mask, y, size=x.size)
        expected = np.where(philox.words(seed, x.size) >= threshold, np.float32(2.0), 0)
        np.testing.assert_array_equal(mask, expected)


def test_fed_keys_drawn_before_each_replay_give_the_plain_steps_masks_and_generator(monkeypatch):
    """A capture draws nothing and notes the layers in forward order; each replay's draw()
    then fills the keys from the generators as the plain forwards draw, so the masks and the
    generator's state are the plain run's, step for step."""
    monkeypatch.setattr(kernels, "_enabled", True)
    (plain, _), (fed, _) = philox_model(monkeypatch), philox_model(monkeypatch)
    x = np.random.default_rng(0).standard_normal((5, 2, 4, 8)).astype(np.float32)
    keys, state = KeyFeed(), fed.get_rng_state()
    with keys.recording(), pytest.raises(RuntimeError, match="not made before the capture"):
        fed.body.forward(x, train=True)  # keys are made before, outside the graph's pool
    KeyFeed.make_keys([fed.body.layers[1]], np)  # as StepGraph does before its capture
    with keys.recording():  # the capture
        fed.body.forward(x, train=True)
    assert keys.layers == [fed.body.layers[1]] and fed.get_rng_state() == state
    for _ in range(3):
        keys.draw()
        with keys.recording():  # what the replayed kernel computes from the key it reads
            got = fed.body.forward(x, train=True)
        np.testing.assert_array_equal(got, plain.body.forward(x, train=True))
        assert fed.get_rng_state() == plain.get_rng_state()


def test_a_dropout_the_kernel_does_not_take_cannot_be_captured(monkeypatch):
    monkeypatch.setattr(kernels, "_enabled", True)
    x = np.ones((4, 6), np.float32)[:, ::2]  # not contiguous: the reference would draw
    with KeyFeed().recording(), pytest.raises(RuntimeError, match="cannot be captured"):
        nn.Dropout(0.5).forward(x, train=True)
    assert nn.Dropout(0.5).forward(x, train=True).shape == x.shape  # outside a capture: fine


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
def test_the_gpu_mask_is_the_cpu_mask_bit_for_bit(monkeypatch):
    cp = cupy_or_none()
    monkeypatch.setattr(kernels, "_enabled", True)
    layer = nn.Dropout(0.4)
    x = np.random.default_rng(1).standard_normal((33, 7, 5, 3)).astype(np.float32)
    layer.rng = np.random.default_rng(11)
    on_cpu = layer.forward(x, train=True)
    layer.rng = np.random.default_rng(11)
    on_gpu = layer.forward(cp.asarray(x), train=True)
    np.testing.assert_array_equal(cp.asnumpy(on_gpu), on_cpu)
    np.testing.assert_array_equal(
        cp.asnumpy(layer.backward(cp.ones_like(on_gpu))) != 0, on_cpu != 0
    )
