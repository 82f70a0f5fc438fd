"""GPU path: DevicePrefetcher delivers the loader's batches unchanged on the device."""

import numpy as np
import pytest

from hpcdl.backend import cupy_or_none
from hpcdl.data import DevicePrefetcher, Loader, open_dataset

cp = cupy_or_none()


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason="needs CuPy and an NVIDIA GPU")
def test_device_batches_equal_host_batches(digits_dir):
    ds = open_dataset(digits_dir / "train")
    batches = [np.arange(i, i + 64) for i in range(0, 640, 64)] + [np.arange(5)]
    with Loader(ds, 64, workers=2, augment="crop1+flip") as loader:
        host = [(x.copy(), y.copy()) for x, y in loader.iterate(batches, 0)]
        dev = [
            (cp.asnumpy(x), cp.asnumpy(y))
            for x, y in DevicePrefetcher(loader.iterate(batches, 0), cp)
        ]
    assert len(dev) == len(host)
    for (a, b), (c, d) in zip(host, dev, strict=True):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)


class _Failing:
    """Host batches that raise after two, like a loader whose worker died."""

    def __iter__(self):
        for i in range(2):
            yield np.full((4, 1, 2, 2), i, np.float32), np.full(4, i, np.int64)
        raise RuntimeError("loader worker 1234 died while building batch 2")


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason="needs CuPy and an NVIDIA GPU")
def test_a_loader_error_reaches_the_consumer_and_the_feeder_thread_ends():
    import threading

    seen = []
    with pytest.raises(RuntimeError, match="worker 1234 died"):
        for x, _ in DevicePrefetcher(_Failing(), cp):
            seen.append(float(x[0, 0, 0, 0]))
    assert seen == [0.0, 1.0]
    assert not [t for t in threading.enumerate() if t.name == "hpcdl-device-prefetch"]


@pytest.mark.gpu
@pytest.mark.skipif(cp is None, reason="needs CuPy and an NVIDIA GPU")
def test_leaving_early_stops_the_feeder_and_closes_the_host_batches(digits_dir):
    import threading

    ds = open_dataset(digits_dir / "train")
    batches = [np.arange(i, i + 64) for i in range(0, 640, 64)]
    with Loader(ds, 64, workers=2) as loader:
        for k, _ in enumerate(DevicePrefetcher(loader.iterate(batches, 0), cp)):
            if k == 2:
                break
        assert not [t for t in threading.enumerate() if t.name == "hpcdl-device-prefetch"]
        # the loader is usable again: its generator was closed and its slots drained
        again = [cp.asnumpy(x) for x, _ in DevicePrefetcher(loader.iterate(batches[:3], 1), cp)]
    assert len(again) == 3
