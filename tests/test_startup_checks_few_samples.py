"""A data set with fewer samples than ranks: the start-up message said "use a batch size <= 0
or fewer ranks". It now says the data set is smaller than the job and how many ranks it takes."""

from __future__ import annotations

from helpers import make_folder, one_line_error, run_train, stage_cli

from hpcdl.startup_checks import batch_size_error


def test_fewer_samples_than_ranks_names_the_ranks_it_takes():
    assert batch_size_error(32, 1, 2, "d") == (
        "d has fewer samples (1) than ranks (2), and every rank needs a batch of its own; use "
        "at most 1 rank(s) and --batch-size 1"
    )
    assert batch_size_error(2, 5, 8, "d").endswith("use at most 2 rank(s)")
    assert "<= 0" not in batch_size_error(4, 3, 4, "d")
    # a share that holds some samples but not a batch: the batch size is the fix, as before
    assert batch_size_error(8, 10, 2, "d").endswith("use a batch size <= 5 or fewer ranks")


def test_training_with_more_ranks_than_samples_says_so(tmp_path):
    make_folder(tmp_path / "imgs", per_class=1, classes=("a", "b"))
    done = run_train(3, "--data", tmp_path / "imgs", "--model", "mlp", "--epochs", "1",
                     "--workers", "0", timeout=300)  # fmt: skip
    assert one_line_error(done) == (
        f"hpcdl.train: error: {tmp_path / 'imgs'} has fewer samples (2) than ranks (3), and every "
        "rank needs a batch of its own; use at most 2 rank(s) and --batch-size 1"
    )


def test_the_dry_run_says_the_same(tmp_path):
    make_folder(tmp_path / "imgs", per_class=1, classes=("a", "b"))
    done = stage_cli("--dry-run", "--data", tmp_path / "imgs", "--nodes", 4, "--batch-size", 1)
    assert one_line_error(done) == (
        f"hpcdl.stage: error: {tmp_path / 'imgs'} has fewer samples (2) than ranks (4), and every "
        "rank needs a batch of its own; use at most 2 rank(s)"
    )
