"""`bench loader`'s hpcdl rate: every image of the measured pass is inside the timed interval."""

from __future__ import annotations

from hpcdl.bench import loader as bench_loader
from hpcdl.data import open_dataset


def test_the_timed_pass_counts_every_image_from_its_first_request(tmp_path):
    """The rate once started its clock after the first batch had arrived, while the other
    workers had finished theirs too: with 8 workers and 2 batches it timed almost nothing and
    reported hundreds of thousands of images/s. The timed pass now holds all n images."""
    bench_loader.make_jpegs(tmp_path, 64, size=40)
    ds = open_dataset(tmp_path)
    images, seconds = bench_loader.timed_pass(ds, workers=4, batch=16, augment="rcrop32", n=64)
    assert images == 64
    assert seconds > 0
