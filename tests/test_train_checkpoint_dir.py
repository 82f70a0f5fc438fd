"""--checkpoint-dir at start: one that cannot be written is refused before anything trains, and
one that holds an earlier run's checkpoints is refused without --resume (it would be
overwritten and rotated away); a missing one is created, with nothing else left in it. Real
runs of `python -m hpcdl.train` on 2 ranks on the digits data."""

from __future__ import annotations

from pathlib import Path

from helpers import run_train

from hpcdl import checkpoint

BASE = ["--model", "mlp", "--batch-size", 32, "--workers", 0, "--seed", 3, "--quiet"]


def error_lines(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line]


def assert_refused(proc, line: str, metrics: Path) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    assert error_lines(proc) == [f"hpcdl.train: error: {line}"], output
    assert "Epoch" not in output and not metrics.exists()  # refused before anything trained


def test_an_unwritable_checkpoint_dir_is_refused_at_start_even_with_max_steps(digits_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run_train(2, "--data", digits_dir / "train", *BASE, "--max-steps", 2,
                     "--checkpoint-dir", "/sys/ck", "--metrics", metrics)  # fmt: skip
    assert_refused(
        proc,
        "--checkpoint-dir /sys/ck cannot be created: Operation not permitted; choose a writable "
        "--checkpoint-dir",
        metrics,
    )
    assert not Path("/sys/ck").exists()


def test_a_checkpoint_dir_below_a_regular_file_is_refused_and_the_file_kept(digits_dir, tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("a user's file\n")
    metrics = tmp_path / "m.jsonl"
    proc = run_train(2, "--data", digits_dir / "train", *BASE, "--max-steps", 2,
                     "--checkpoint-dir", plain / "ck", "--metrics", metrics)  # fmt: skip
    assert_refused(
        proc,
        f"--checkpoint-dir {plain / 'ck'} cannot be created: Not a directory; choose a writable "
        "--checkpoint-dir",
        metrics,
    )
    assert plain.read_text() == "a user's file\n"


def test_a_missing_checkpoint_dir_is_probed_and_holds_only_checkpoints(digits_dir, tmp_path):
    ckpt_dir = tmp_path / "new" / "ck"
    proc = run_train(2, "--data", digits_dir / "train", *BASE, "--max-steps", 2,
                     "--checkpoint-dir", ckpt_dir, "--batch-size", 5000)  # fmt: skip
    assert proc.returncode == 2 and "--batch-size 5000" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "new").exists()  # probed at start, removed: the start-up stopped
    proc = run_train(2, "--data", digits_dir / "train", *BASE, "--max-steps", 2,
                     "--checkpoint-every", 2, "--checkpoint-dir", ckpt_dir)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in ckpt_dir.iterdir()] == [checkpoint.checkpoint_name(0, 2)]


def test_a_fresh_run_into_an_earlier_runs_checkpoint_dir_is_refused(digits_dir, tmp_path):
    ckpt_dir = tmp_path / "ck"
    proc = run_train(2, "--data", digits_dir / "train", *BASE, "--max-steps", 3,
                     "--checkpoint-every", 3, "--checkpoint-dir", ckpt_dir)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (saved,) = checkpoint.list_checkpoints(ckpt_dir)
    before = saved.read_bytes()
    metrics = tmp_path / "m.jsonl"
    proc = run_train(2, "--data", digits_dir / "train", *BASE, "--model", "cnn", "--epochs", 1,
                     "--checkpoint-dir", ckpt_dir, "--metrics", metrics)  # fmt: skip
    assert_refused(
        proc,
        f"--checkpoint-dir {ckpt_dir} holds checkpoints of an earlier run (newest {saved.name}, "
        "model 'mlp'); add --resume auto to continue it, or give an empty --checkpoint-dir to "
        "start over",
        metrics,
    )
    assert checkpoint.list_checkpoints(ckpt_dir) == [saved] and saved.read_bytes() == before


def test_a_users_file_named_as_a_checkpoint_is_refused_and_kept(digits_dir, tmp_path):
    ckpt_dir = tmp_path / "ck"
    ckpt_dir.mkdir()
    mine = ckpt_dir / "ckpt-e00001-s000000009.h5"
    mine.write_text("my notes\n")
    metrics = tmp_path / "m.jsonl"
    proc = run_train(2, "--data", digits_dir / "train", *BASE, "--epochs", 1,
                     "--checkpoint-dir", ckpt_dir, "--metrics", metrics)  # fmt: skip
    assert_refused(
        proc,
        f"--checkpoint-dir {ckpt_dir} holds checkpoints of an earlier run (newest {mine.name}, "
        "not readable as a checkpoint); add --resume auto to continue it, or give an empty "
        "--checkpoint-dir to start over",
        metrics,
    )
    assert mine.read_text() == "my notes\n"


def test_a_resumed_chain_keeps_its_two_newest_and_leaves_other_files(digits_dir, tmp_path):
    """--resume auto continues the run: its own older checkpoints rotate away, the earlier job's
    included; a file it did not write, named as a checkpoint, stays."""
    ckpt_dir = tmp_path / "ck"
    first = run_train(2, "--data", digits_dir / "train", *BASE, "--epochs", 2,
                      "--checkpoint-dir", ckpt_dir)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    older = checkpoint.list_checkpoints(ckpt_dir)
    assert len(older) == 2
    mine = ckpt_dir / "ckpt-e00000-s000000001.h5"  # older than any: the first a rotation takes
    mine.write_text("my notes\n")
    again = run_train(2, "--data", digits_dir / "train", *BASE, "--epochs", 4,
                      "--checkpoint-dir", ckpt_dir, "--resume", "auto")  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    kept = checkpoint.list_checkpoints(ckpt_dir)
    assert kept[0] == mine and mine.read_text() == "my notes\n"
    assert [checkpoint.load(p).epoch for p in kept[1:]] == [3, 4]
    assert not set(older) & set(kept)
