"""Read a minibatch's compressed image files, undecoded, into a byte slot (`--decode gpu`).

The loader workers only move bytes; the rank decodes (hpcdl.data.gpu_decode). A file (or a
shard's image member: one pread) goes in whole, from its staged copy if there is one, else from
the PFS (counted as the decoding reader counts them). A file that cannot be read is left empty
(length 0) under skip_bad, so that the rank's bad-sample rules handle it with the files it
cannot decode; otherwise BadSample.
"""

from __future__ import annotations

import numpy as np

from hpcdl.data.dataset import BadSample, DataError, Locate


def byte_capacity(ds, batch_size: int) -> int:
    """Bytes a byte slot needs: batch_size times the data set's largest image file (in shards
    of files, tar or encoded HDF5: largest_sample_bytes)."""
    largest = getattr(ds, "largest_sample_bytes", None)
    if largest is None:
        sizes = np.asarray(ds.files.sizes)
        largest = sizes.max() if len(sizes) else 0
    return int(batch_size * largest) or 1


def check_gpu_decode(ds) -> None:
    """--decode gpu decodes RGB image files (a folder's, or the image members of tar shards or
    of encoded HDF5 shards); anything else is refused in one line."""
    if ds.kind == "hdf5":
        raise DataError(
            f"--decode gpu decodes image files; {ds.source} holds decoded pixels (HDF5): "
            "use --decode cpu"
        )
    if ds.sample_shape[0] != 3:
        raise DataError(f"--decode gpu decodes RGB images; {ds.source} is greyscale")


class FileBytesReader:
    """Reads files of ds into byte slots for one process; owns its reader (and counts)."""

    def __init__(self, ds, locate: Locate | None = None, skip_bad: bool = False) -> None:
        self.ds, self.skip_bad = ds, skip_bad
        self.reader = ds.reader(locate)

    @property
    def counts(self):
        return self.reader.counts

    def read(self, indices: np.ndarray, labels: np.ndarray, offsets: np.ndarray, data) -> None:
        """Fill labels[:n], offsets[:n + 1] and data for n = len(indices) (file i of the batch
        is data[offsets[i]:offsets[i + 1]])."""
        offsets[0] = 0
        for i, index in enumerate(np.asarray(indices, np.int64)):
            start = int(offsets[i])
            offsets[i + 1] = start + self._read_one(int(index), data[start:])
        labels[: len(indices)] = self.ds.labels[indices]

    def _read_one(self, index: int, into: np.ndarray) -> int:
        try:
            f, path = self.reader._open(index)
            with f:
                n = f.readinto(memoryview(into))
                if f.read(1):
                    raise OSError("the file grew beyond its indexed size; rebuild the index")
            return n
        except BadSample:
            if not self.skip_bad:
                raise
            return 0
        except OSError as exc:
            if not self.skip_bad:
                raise BadSample(path, index, exc.strerror or str(exc)) from None
            return 0

    def close(self) -> None:
        self.reader.close()
