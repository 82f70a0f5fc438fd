"""Batch slots that follow the workers (issue 48 item 1; hpcdl.data.loader NOTE [default
slots]): the default count, its memory bound, an explicit count winning, `--prefetch auto` in
the configuration, and where the start line and the doctor say it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from hpcdl.backend import gpu_available
from hpcdl.config import ConfigError, TrainConfig, parse_args, validate
from hpcdl.data import Loader, open_dataset
from hpcdl.data.loader import (
    MIN_SLOTS,
    SHM_SHARE,
    SLOT_MEMORY_BYTES,
    SLOTS_PER_WORKER,
    default_slots,
    slot_warning,
)
from hpcdl.data.slots import SlotLayout
from hpcdl.doctor import probes
from hpcdl.startup_input import loader_line

MIB = 1 << 20
PLENTY = 1 << 40  # free shared memory that bounds nothing


@pytest.fixture(scope="module")
def h5(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("slots") / "d.h5"
    with h5py.File(path, "w") as f:
        f["images"] = np.zeros((64, 8, 8, 3), np.uint8)
        f["labels"] = np.arange(64) % 4
    return path


@pytest.mark.parametrize("workers", [1, 2, 3, 8, 15, 40])
def test_the_default_gives_two_slots_per_worker_and_at_least_four(workers):
    got = default_slots(workers, 1 * MIB, PLENTY)
    assert got == max(MIN_SLOTS, SLOTS_PER_WORKER * workers)
    assert got >= workers + 1  # every worker can build while the trainer holds one slot


def test_the_default_stays_within_its_memory_bound():
    slot = 77 * MIB  # 128 rrc224 float32 images
    assert default_slots(40, slot, PLENTY) == SLOT_MEMORY_BYTES // slot  # 4 GiB: 53 of 80
    # a quarter of the free shared memory, split over the node's 8 ranks
    free = 64 << 30
    bounded = default_slots(15, slot, free, ranks_per_node=8)
    assert bounded == free // (SHM_SHARE * 8) // slot == 26
    assert bounded * slot * 8 <= free / SHM_SHARE
    assert default_slots(15, slot, 10 * MIB) == 2  # never fewer than 2


def test_the_loader_uses_the_default_and_an_explicit_count_wins(h5):
    ds = open_dataset(h5)
    with Loader(ds, 8, workers=3) as loader:
        one = SlotLayout(1, 8, loader.sample_shape).slot_bytes
        assert loader.slots == default_slots(3, one) == 6 and loader.slots_default
        assert loader._pool.layout.count == 6
        assert sum(len(y) for _, y in loader.iterate([np.arange(8)] * 10, 0)) == 80
    with Loader(ds, 8, workers=3, prefetch=2) as loader:
        assert loader.slots == 2 and not loader.slots_default
        assert loader._pool.layout.count == 2
    with Loader(ds, 8, workers=0) as loader:
        assert loader.slots == 0


def test_fewer_slots_than_workers_is_warned_about():
    assert slot_warning(8, 16) is None and slot_warning(8, 8) is None
    assert slot_warning(0, 2) is None
    text = slot_warning(8, 4)
    assert "4 batch slots for 8 loader workers" in text and "--prefetch 16" in text


def test_prefetch_is_auto_by_default_and_takes_a_number_or_auto():
    assert TrainConfig(data="x").prefetch == "auto"
    cfg = parse_args(["--data", "x", "--prefetch", "12"])
    assert cfg.prefetch == "12"
    validate(cfg)
    for bad in ("0", "-3", "many", "1.5"):
        with pytest.raises(ConfigError, match="--prefetch must be auto or an integer >= 1"):
            validate(TrainConfig(data="x", prefetch=bad))


def test_prefetch_from_toml_as_a_number(tmp_path):
    (tmp_path / "job.toml").write_text('data = "x"\nprefetch = 24\n')
    cfg = parse_args(["--config", str(tmp_path / "job.toml")])
    assert cfg.prefetch == "24"


def test_the_start_line_says_the_slots_and_warns():
    auto = SimpleNamespace(workers=8, slots=16, slots_default=True, decode="cpu", cores=None)
    assert loader_line(auto) == "hpcdl: loader: 8 worker(s) per rank, 16 batch slots (auto)"
    few = SimpleNamespace(workers=8, slots=4, slots_default=False, decode="cpu", cores=None)
    few = loader_line(few)
    assert "4 batch slots (--prefetch); warning: 4 batch slots for 8 loader workers" in few
    here = SimpleNamespace(workers=0, slots=0, slots_default=True, decode="cpu", cores=None)
    assert "--workers 0" in loader_line(here)
    gpu = SimpleNamespace(workers=2, slots=4, slots_default=True, decode="gpu",
                          decoder_name="nvimgcodec", cores=None)  # fmt: skip
    assert loader_line(gpu).endswith("(auto), files decoded in the rank (nvimgcodec)")


def test_the_doctor_reports_the_slots_and_warns_where_they_are_too_few():
    facts, problems = probes.loader(8, "auto", 128, (3, 224, 224), 1)
    assert facts["workers"] == 8 and facts["slots_default"]
    assert facts["slots"] == default_slots(8, facts["slot_bytes"], facts["shm_free_bytes"])
    assert facts["slot_bytes"] >= 128 * 3 * 224 * 224 * 4
    assert (problems == []) == (facts["slots"] >= 8)
    if not gpu_available():
        assert facts["gpu_decode"] is False and "CuPy" in facts["gpu_decode_reason"]
    facts, problems = probes.loader(8, "4", 128, (3, 224, 224), 1)
    assert facts["slots"] == 4 and not facts["slots_default"]
    assert len(problems) == 1 and "fix: give --prefetch 16" in problems[0].message
