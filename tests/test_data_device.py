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
