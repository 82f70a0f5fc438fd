"""--seed and --augment's crop sizes have upper bounds, said at start in one line: a seed of
2**64 was an OverflowError in a loader worker, crop99999999999999999999 an OverflowError, and
rrc99999 numpy's "Unable to allocate 18.6 TiB"."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import mpi_env, one_line_error, stage_cli

from hpcdl.config import MAX_SEED
from hpcdl.data.augment import MAX_CROP, Augment, parse_augment


def train(digits_dir, *flags) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--data", digits_dir / "train", "--model", "mlp",
         "--epochs", "1", "--workers", "1", *map(str, flags)],
        capture_output=True, text=True, env=mpi_env(), timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize(
    "flags,error",
    [
        (("--seed", 2**64), f"--seed must be 0..{MAX_SEED} (2**63 - 1), got {2**64}"),
        (("--augment", "crop99999999999999999999"), "--augment 'crop99999999999999999999': "
         f"crop99999999999999999999 is larger than {MAX_CROP}, the most crop takes; give "
         f"crop{MAX_CROP} or less"),
        (("--augment", "rrc99999+flip"), f"--augment 'rrc99999+flip': rrc99999 is larger than "
         f"{MAX_CROP}, the most rrc takes; give rrc{MAX_CROP} or less"),
    ],
)  # fmt: skip
def test_values_past_the_bounds_are_refused_in_one_line(digits_dir, flags, error):
    assert one_line_error(train(digits_dir, *flags)) == f"hpcdl.train: error: {error}"


def test_the_largest_seed_trains(digits_dir):
    """The bound is one every consumer of the seed takes: sampler, augmentation, initialisation."""
    done = train(digits_dir, "--seed", MAX_SEED, "--augment", "crop2+flip", "--max-steps", 3)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hpcdl.train: final" in done.stdout


def test_crop_sizes_up_to_the_bound_parse():
    assert parse_augment(f"rrc{MAX_CROP}+flip") == Augment(rrc=MAX_CROP, flip=True)
    assert parse_augment(f"crop{MAX_CROP}").pad == MAX_CROP
    with pytest.raises(ValueError, match=f"rcrop{MAX_CROP + 1} is larger than {MAX_CROP}"):
        parse_augment(f"rcrop{MAX_CROP + 1}")


def test_hpcdl_stage_takes_the_same_seed_range(digits_dir, tmp_path):
    done = stage_cli("--dry-run", "--data", digits_dir / "train", "--seed", 2**63)
    assert one_line_error(done) == (
        f"hpcdl.stage: error: --seed must be 0..{MAX_SEED} (2**63 - 1), got {2**63}"
    )
