"""`hpcdl.train --precision bf16|fp16` end to end on digits under mpirun (real MPI and HDF5)."""

import statistics

from helpers import read_events, run_train

from hpcdl import checkpoint

SEEDS = (0, 1, 2)


def train_digits(digits_dir, tmp_path, precision: str, seed: int, *extra) -> dict:
    metrics = tmp_path / f"{precision}-{seed}-{len(list(tmp_path.glob('*.jsonl')))}.jsonl"
    proc = run_train(
        2,
        *("--data", digits_dir / "train", "--val-data", digits_dir / "val"),
        *("--model", "cnn", "--epochs", 15, "--batch-size", 32),
        *("--optimizer", "adam", "--lr", 0.001, "--workers", 0, "--progress", "none"),
        *("--seed", seed, "--precision", precision, "--metrics", metrics),
        *extra,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if precision != "fp32":
        assert f"hpcdl: precision {precision}:" in proc.stdout
    assert "RuntimeWarning" not in proc.stderr
    return {"summary": read_events(metrics, "summary")[0], "steps": read_events(metrics, "step")}


def test_bf16_reaches_the_fp32_accuracy_band_within_one_point(digits_dir, tmp_path):
    """The issue's criterion, over three seeds (one seed's validation accuracy moves by a
    sample, 0.28 points, between any two runs that differ in rounding)."""
    acc = {
        p: [train_digits(digits_dir, tmp_path, p, s)["summary"]["val_accuracy"] for s in SEEDS]
        for p in ("fp32", "bf16")
    }
    assert abs(statistics.mean(acc["bf16"]) - statistics.mean(acc["fp32"])) <= 0.01, acc
    assert min(acc["bf16"]) >= 0.95, acc


def test_fp16_trains_with_loss_scaling_and_resumes_its_scale(digits_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = train_digits(
        digits_dir,
        tmp_path,
        "fp16",
        0,
        "--max-steps",
        7,
        "--checkpoint-every",
        7,
        "--checkpoint-dir",
        ckpt,
    )
    assert first["summary"]["precision"] == "fp16"
    saved = checkpoint.load(checkpoint.latest(ckpt)).loss_scale
    assert saved == {"scale": 65536.0, "good_steps": 7 - first["summary"]["skipped_steps"]}

    resume = ("--resume", "auto", "--checkpoint-dir", ckpt, "--metrics-every", 1)
    rest = train_digits(digits_dir, tmp_path, "fp16", 0, *resume)
    assert rest["summary"]["val_accuracy"] >= 0.95, rest["summary"]
    # The scaler's rule replayed from the saved state over every step's record: the resumed
    # run continued from it (scale and applied steps in a row), and saved where it ended.
    scale, good = saved["scale"], saved["good_steps"]
    assert rest["steps"][0]["step"] == 8
    for record in rest["steps"]:
        scale, good = (scale, good + 1) if record["applied"] else (scale / 2, 0)
        assert record["loss_scale"] == scale, record
    skipped = sum(not r["applied"] for r in rest["steps"])
    assert rest["summary"]["skipped_steps"] == skipped
    assert checkpoint.load(checkpoint.latest(ckpt)).loss_scale == {
        "scale": scale,
        "good_steps": good,
    }
