"""Data sets, sampling, minibatch loading and conversion tools (docs/data.md)."""

from hpcdl.data.augment import parse_augment
from hpcdl.data.dataset import BadSample, DataError, FileEntry, FileTable
from hpcdl.data.kinds import open_dataset, open_listing
from hpcdl.data.loader import Loader, default_workers

__all__ = [
    "BadSample",
    "DataError",
    "DevicePrefetcher",
    "FileEntry",
    "FileTable",
    "Loader",
    "default_workers",
    "open_dataset",
    "open_listing",
    "parse_augment",
]


def __getattr__(name: str):
    if name == "DevicePrefetcher":  # CuPy is imported only by those who ask for the GPU path
        from hpcdl.data.device import DevicePrefetcher  # noqa: PLC0415

        return DevicePrefetcher
    raise AttributeError(name)
