"""Issue 48: the workers go on into the next epoch while the script takes the last batches of this
one (hpcdl.data.pool NOTE [the next epoch]). The control channel's message count says which
batches the workers were given: one TASK and one REPLY per batch built, one READY per worker."""

import numpy as np
import pytest

from hpcdl.data import Loader, open_dataset
from hpcdl.data.pool import Upcoming
from hpcdl.data.sampler import DistributedSampler

BATCH, SLOTS, WORKERS = 32, 4, 2


@pytest.fixture(scope="module")
def h5data(tmp_path_factory):
    import h5py

    d = tmp_path_factory.mktemp("next-epoch")
    rng = np.random.default_rng(1)
    with h5py.File(d / "part-0.h5", "w") as f:
        f["images"] = rng.integers(0, 256, (200, 12, 12, 3), dtype=np.uint8)
        f["labels"] = np.arange(200) % 10
    return open_dataset(d)


def order(ds, epoch):
    return DistributedSampler(len(ds), seed=5).batches(epoch, BATCH)


def reference(ds, epoch):
    with Loader(ds, BATCH, workers=0, seed=11, augment="crop3+flip") as loader:
        return [(x.copy(), y.copy()) for x, y in loader.iterate(order(ds, epoch), epoch)]


def loader(ds):
    return Loader(ds, BATCH, workers=WORKERS, prefetch=SLOTS, seed=11, augment="crop3+flip")


def same(got, want):
    return len(got) == len(want) and all(
        np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(got, want)
    )


def messages(batches_built: int) -> int:
    return 2 * batches_built + WORKERS


def test_the_workers_start_the_next_epoch_before_the_script_asks_for_it(h5data):
    n = len(order(h5data, 0))
    with loader(h5data) as ld:
        then = Upcoming(order(h5data, 1), 1, True)
        for _ in ld.iterate(order(h5data, 0), 0, then=then):
            pass
        # the last batch was taken: every slot but none is given to epoch 1's first batches
        assert ld.stats()["control_messages"] > messages(n)
        got = [(x.copy(), y.copy()) for x, y in ld.iterate(order(h5data, 1), 1)]
        # epoch 1's batches built ahead were used, none built twice
        assert ld.stats()["control_messages"] == messages(2 * n)
    assert same(got, reference(h5data, 1))


def test_an_epoch_other_than_the_one_expected_gets_its_own_batches(h5data):
    n = len(order(h5data, 0))
    with loader(h5data) as ld:
        for _ in ld.iterate(order(h5data, 0), 0, then=Upcoming(order(h5data, 1), 1, True)):
            pass
        got = [(x.copy(), y.copy()) for x, y in ld.iterate(order(h5data, 3), 3)]
        ahead = (ld.stats()["control_messages"] - messages(2 * n)) // 2
    assert 0 < ahead < SLOTS  # built for epoch 1 and dropped: at most the free slots
    assert same(got, reference(h5data, 3))


def test_leaving_an_epoch_early_drops_the_batches_built_ahead(h5data):
    with loader(h5data) as ld:
        then = Upcoming(order(h5data, 1), 1, True)
        for i, _ in enumerate(ld.iterate(order(h5data, 0), 0, then=then)):
            if i == len(order(h5data, 0)) - 2:  # all of epoch 0 given out, some of epoch 1
                break
        got = [(x.copy(), y.copy()) for x, y in ld.iterate(order(h5data, 1), 1)]
    assert same(got, reference(h5data, 1))


def test_a_bad_file_in_the_next_epoch_stops_that_epoch_not_this_one(tmp_path):
    """A batch built ahead for the next epoch that cannot be read is reported when that batch is
    asked for: this epoch ends whole (its checkpoint is written) before the error stops the run.
    The good images are big (slow to decode), the bad one is cut short before its header ends
    (fails at once), so its error reaches the pool while this epoch's last batches are awaited."""
    from helpers import make_folder  # noqa: PLC0415

    from hpcdl.data import DataError  # noqa: PLC0415

    make_folder(tmp_path / "d", per_class=8, size=(1200, 1200), fmt="jpg")
    cut = tmp_path / "d" / "dog" / "7.jpg"
    cut.write_bytes(cut.read_bytes()[:20])
    ds = open_dataset(tmp_path / "d")
    bad = [f.relpath for f in ds.files].index("dog/7.jpg")
    good = [i for i in range(len(ds)) if i != bad]
    this_epoch = [np.array(good[k : k + 2]) for k in range(0, 12, 2)]
    next_epoch = [np.array([bad, good[0]]), np.array(good[1:3])]
    for trial in range(3):  # the race is the pool's to lose, so give it three chances
        with Loader(ds, 2, workers=2, prefetch=4, augment="none") as ld:
            then = Upcoming(next_epoch, 1, True)
            got = [y.copy() for _, y in ld.iterate(this_epoch, 0, then=then)]
            assert len(got) == len(this_epoch), trial
            with pytest.raises(DataError, match=r"dog/7\.jpg"):
                list(ld.iterate(next_epoch, 1))
