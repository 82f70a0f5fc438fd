"""`python -m hpcdl.bench input` on the CPU: every row runs and writes the issue's JSON fields
(issue 48 item 4). Its numbers are not checked here: speed lives in the benchmark's output."""

from __future__ import annotations

import json

import pytest

from hpcdl.bench import input as bench_input

FIELDS = {"loader", "decode", "workers", "slots", "slots_default", "batch", "model",
          "precision", "images_per_s", "data_wait_share", "device"}  # fmt: skip


def test_each_row_writes_one_json_line_with_the_issues_fields(tmp_path, capsys):
    out = tmp_path / "input.jsonl"
    args = ["--make-jpegs", "48", "--image-size", "96", "--augment", "rrc64+flip",
            "--batch-size", "8", "--workers", "2", "--steps", "3", "--warmup", "1",
            "--model", "linear", "--json", str(out)]  # fmt: skip
    assert bench_input.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["loader"], r["decode"], r["slots"]) for r in rows] == [
        ("none", "-", None), ("dataloader", "cpu", 4), ("dataloader", "cpu", 8),
        ("hpcdl", "cpu", 4), ("hpcdl", "gpu", 4),
    ]  # fmt: skip
    for r in rows:
        assert set(r) == FIELDS
        assert r["batch"] == 8 and r["model"] == "linear" and r["device"] == "cpu"
        assert r["images_per_s"] > 0 and 0 <= r["data_wait_share"] < 1
    for hpcdl in rows[-2:]:
        assert hpcdl["slots_default"] and hpcdl["workers"] == 2
    printed = capsys.readouterr().out
    assert printed.count("images/s, data wait") == 5


def test_an_explicit_slot_count_is_recorded_as_such(tmp_path):
    out = tmp_path / "input.jsonl"
    args = ["--make-jpegs", "24", "--image-size", "80", "--augment", "rrc64", "--batch-size",
            "8", "--workers", "1", "--steps", "2", "--warmup", "1", "--model", "sleep:1",
            "--rows", "hpcdl", "--prefetch", "3", "--json", str(out)]  # fmt: skip
    assert bench_input.main(args) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["slots"] == 3 and not row["slots_default"] and row["precision"] == "none"


def test_a_data_folder_that_does_not_exist_is_written_and_then_reused(tmp_path):
    data = tmp_path / "jpegs"
    args = ["--data", str(data), "--make-jpegs", "16", "--image-size", "80", "--augment",
            "rrc64", "--batch-size", "8", "--workers", "1", "--steps", "1", "--warmup", "1",
            "--model", "sleep:1", "--rows", "hpcdl"]  # fmt: skip
    assert bench_input.main(args) == 0
    files = sorted(data.rglob("*.jpg"))
    assert len(files) == 16
    stamps = [f.stat().st_mtime_ns for f in files]
    assert bench_input.main([*args[:3], "99", *args[4:]]) == 0  # kept, not rewritten
    assert sorted(data.rglob("*.jpg")) == files
    assert [f.stat().st_mtime_ns for f in files] == stamps


def test_the_gpu_rows_model_is_a_resnet50_with_1000_classes():
    """bench input's resnet50 (torchvision's, or the compute bench's peer without it): the
    model the GPU rows time; a wrong import here broke the first GPU run of the bench."""
    torch = pytest.importorskip("torch")
    from hpcdl.bench.input import torch_resnet50

    net = torch_resnet50()
    params = sum(p.numel() for p in net.parameters())
    assert 25_000_000 < params < 26_000_000  # resnet50: 25.6 M
    assert net(torch.zeros(1, 3, 64, 64)).shape == (1, 1000)
