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
        ("hpcdl", "cpu", 4), ("hpcdl", "gpu", 4), ("decoder", "gpu", None),
    ]  # fmt: skip
    for r in rows[:-1]:
        assert set(r) == FIELDS
        assert r["batch"] == 8 and r["model"] == "linear" and r["device"] == "cpu"
        assert r["images_per_s"] > 0 and 0 <= r["data_wait_share"] < 1
    for hpcdl in rows[-3:-1]:
        assert hpcdl["slots_default"] and hpcdl["workers"] == 2
    decoder = rows[-1]  # the decoding alone: no workers, no step, the stand-in decoder on CPU
    assert set(decoder) == FIELDS | {"decode_images_per_s", "decoder"}
    assert decoder["workers"] == 0 and decoder["model"] == "-" and decoder["decoder"] == "pillow"
    assert decoder["images_per_s"] > 0 and decoder["decode_images_per_s"] > 0
    printed = capsys.readouterr().out
    assert printed.count("images/s, data wait") == 6
    assert "pillow alone:" in printed


def test_the_decoder_row_builds_what_the_gpu_decode_loader_hands_out(tmp_path, monkeypatch):
    """The decoder row times GpuBatchDecoder.build on byte slots that FileBytesReader filled:
    the batches it builds are the loader's own, same seed (so it times the real work)."""
    from hpcdl.bench.loader import make_jpegs
    from hpcdl.data.gpu_decode import GpuBatchDecoder
    from hpcdl.torch import Loader

    data = tmp_path / "jpegs"
    make_jpegs(data, 16, size=80)
    built = []
    real_build = GpuBatchDecoder.build

    def keep(self, *args, **kwargs):
        out = real_build(self, *args, **kwargs)
        built.append(out[0].copy())
        return out

    monkeypatch.setattr(GpuBatchDecoder, "build", keep)
    timing = bench_input.decoder_timing(str(data), 8, "rrc64+flip", False, warmup=1, steps=1)
    assert timing["decoder"] == "pillow" and len(built) == 2
    with Loader(str(data), 8, epochs=1, workers=1, augment="rrc64+flip", decode="gpu",
                handle_signals=False) as loader:  # fmt: skip
        loader.set_epoch(0)
        first = next(iter(loader))[0].numpy()
    assert first.shape == built[0].shape == (8, 3, 64, 64)
    assert (first == built[0]).all()


def test_the_decoder_row_needs_a_batch_of_images(tmp_path):
    from hpcdl.bench.loader import make_jpegs

    make_jpegs(tmp_path / "jpegs", 4, size=80)
    with pytest.raises(SystemExit, match="fewer than one batch of 8"):
        bench_input.decoder_timing(str(tmp_path / "jpegs"), 8, "rrc64", False, 1, 1)


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


def test_the_gpu_checks_summary_puts_each_goal_ratio_beside_the_rows():
    """scripts/gpu_check_summary.py's input lines: hpcdl with default slots over the better of
    the two DataLoader rows at the same workers, GPU decode over the step alone."""
    summary = script("gpu_check_summary")

    def row(loader, decode, workers, rate, model="resnet50", **extra):
        return dict(loader=loader, decode=decode, workers=workers, slots=None, model=model,
                    images_per_s=rate, data_wait_share=0.1, **extra)  # fmt: skip

    rows = [row("none", "-", None, 4000.0), row("dataloader", "cpu", 8, 1000.0),
            row("dataloader", "cpu", 8, 1600.0), row("hpcdl", "cpu", 8, 2000.0),
            row("hpcdl", "gpu", 2, 3000.0), row("decoder", "gpu", 0, 9000.0,
            decode_images_per_s=12000.0, decoder="nvimgcodec"),
            row("none", "-", None, 1000.0, "hpcdl resnet50"),
            row("hpcdl.train", "gpu", 2, 960.0, "hpcdl resnet50")]  # fmt: skip
    text = "\n".join(summary.input_lines(rows))
    assert "8 workers: hpcdl / best DataLoader 1.25" in text
    assert "hpcdl decode gpu, 2 workers: / the step alone 0.75" in text
    assert "hpcdl.train decode gpu, 2 workers: / the step alone 0.96" in text
    assert "nvimgcodec alone 12000" in text
    assert summary.input_lines([]) == ["input: no rows (see input.log)"]


def test_image_size_is_a_side_or_width_by_height():
    import argparse

    assert bench_input.image_size("320") == (320, 320)
    assert bench_input.image_size("500x375") == (500, 375)
    for bad in ("500x", "x", "500x375x3", "4x4", "big"):
        with pytest.raises(argparse.ArgumentTypeError, match="SIDE or WIDTHxHEIGHT"):
            bench_input.image_size(bad)


def test_the_jpegs_are_written_by_several_processes_at_their_size_and_then_renamed(tmp_path):
    """--make-jpegs N --image-size 500x375: N files of that size in ten class folders, written
    into a .partial folder by several processes (the device makes 6,400 of them in seconds)."""
    from PIL import Image

    root = tmp_path / "jpegs"
    (tmp_path / "jpegs.partial" / "c0").mkdir(parents=True)  # an interrupted run's leftover
    bench_input.make_jpegs(root, 130, 96, 72, processes=2)
    files = sorted(root.rglob("*.jpg"))
    assert len(files) == 130 and len({f.parent.name for f in files}) == 10
    assert not (tmp_path / "jpegs.partial").exists()
    with Image.open(files[0]) as first, Image.open(files[-1]) as last:
        assert first.size == last.size == (96, 72)
        assert first.tobytes() != last.tobytes()
    assert (root / "c3" / "000013.jpg").exists()  # image i of class i % 10, named by i


def test_the_gpu_checks_goals_judge_each_worker_count_and_each_loader():
    """Issue 60's input goals in the summary: each worker count and each --decode gpu loader
    on a line of its own; the data wait judged only where DataLoader's own is <= 5 %."""
    summary = script("gpu_check_summary")

    def row(loader, decode, workers, rate, wait, model="resnet50"):
        return dict(loader=loader, decode=decode, workers=workers, slots=None, model=model,
                    images_per_s=rate, data_wait_share=wait, device="H100")  # fmt: skip

    rows = [
        row("none", "-", None, 3600.0, 0.0),
        row("dataloader", "cpu", 8, 1400.0, 0.5),
        row("dataloader", "cpu", 8, 1450.0, 0.5),
        row("hpcdl", "cpu", 8, 650.0, 0.8),
        row("dataloader", "cpu", 15, 2000.0, 0.03),
        row("hpcdl", "cpu", 15, 2100.0, 0.04),
        row("hpcdl", "gpu", 2, 3500.0, 0.01),
        row("none", "-", None, 250.0, 0.0, "hpcdl resnet50"),
        row("hpcdl.train", "gpu", 2, 200.0, 0.2, "hpcdl resnet50"),
        row("hpcdl.train", "gpu", 2, 3420.0, 0.02),
    ]  # fmt: skip  (the torch engine's)
    facts = {"compute": [], "input": rows, "train": [], "status": {}, "profiles": {}}
    text = "\n".join(summary.goal_lines(facts))
    assert "MISS input: default slots >= 1.0x DataLoader, 8 workers" in text
    assert "0.45 (650 vs 1450 images/s)" in text
    assert "met  input: default slots >= 1.0x DataLoader, 15 workers" in text
    assert "n/a  input: data wait <= 5 % where DataLoader's is, 8 workers" in text
    assert "80.0 %, DataLoader 50.0 % (> 5 %: not judged)" in text
    assert "met  input: data wait <= 5 % where DataLoader's is, 15 workers" in text
    assert "met  input: --decode gpu in hpcdl >= 0.95x the step alone" in text
    assert "MISS input: --decode gpu in hpcdl.train, hpcdl's model >= 0.95x the step alone" in text
    assert "0.80 (200 vs 250 images/s, 2 workers)" in text
    assert "met  input: --decode gpu in hpcdl.train, a torch model >= 0.95x the step" in text
    assert "0.95 (3420 vs 3600 images/s, 2 workers)" in text
    # hpcdl.train's 2 workers against DataLoader's with the fewest more (8; none with 2)
    assert "end to end: hpcdl.train rn50 bf16" in text
    assert "2 workers: hpcdl.train 200 vs DataLoader at 8 workers 1450 images/s" in text
    without = summary.goal_lines({**facts, "input": rows[:-1]})  # no torch engine row: no line
    assert not [ln for ln in without if "a torch model" in ln]
    # the same rows from a CPU dry run: every goal n/a but whether a phase failed
    cpu = [{**r, "device": "cpu"} for r in rows]
    lines = summary.goal_lines({**facts, "input": cpu})
    assert "a CPU dry run" in lines[0]
    assert "n/a  input: default slots >= 1.0x DataLoader, 15 workers" in "\n".join(lines)
    assert [ln for ln in lines[1:] if "met " in ln or "MISS" in ln] == [
        "  met  no phase failed" + " " * 46 + "all exit 0"
    ]


def test_the_gpu_checks_train_rows_take_the_later_epochs_and_the_start_lines_slots():
    """scripts/gpu_check_train_rows.py: hpcdl.train --decode gpu against hpcdl's step alone."""
    rows_of = script("gpu_check_train_rows").train_rows
    compute = {"model": "resnet50", "hpcdl_images_per_s": 1000.0}
    metrics = [
        {"event": "epoch", "images_per_s": 100.0, "seconds": 10.0},  # the first: start-up
        {"event": "epoch", "images_per_s": 900.0, "seconds": 2.0},
        {"event": "epoch", "images_per_s": 1000.0, "seconds": 2.0},
        {"event": "summary", "global_batch": 256, "world_size": 2, "precision": "bf16",
         "mean_step": {"t_data": 0.01, "t_step": 0.2}},
    ]  # fmt: skip
    log = "hpcdl: loader: 2 worker(s) per rank, 4 batch slots (auto), files decoded in the rank"
    alone, fed = rows_of(compute, metrics, log, 2, "H100")
    assert set(alone) == set(fed) == FIELDS
    assert alone["images_per_s"] == 1000.0 and alone["loader"] == "none"
    assert fed["images_per_s"] == pytest.approx(950.0)
    assert fed["data_wait_share"] == pytest.approx(0.05)
    assert (fed["slots"], fed["slots_default"], fed["batch"]) == (4, True, 128)
    assert fed["model"] == alone["model"] == "hpcdl resnet50"
    explicit = log.replace("(auto)", "(--prefetch)")
    assert rows_of(compute, metrics, explicit, 2, "H100")[1]["slots_default"] is False
    with pytest.raises(ValueError, match="no start line"):
        rows_of(compute, metrics, "", 2, "H100")
    with pytest.raises(ValueError, match="no epoch or summary"):
        rows_of(compute, metrics[-1:], log, 2, "H100")


def test_the_gpu_checks_train_rows_name_the_fast_kernels_when_the_step_ran_them():
    """The end-to-end row runs hpcdl's resnet50 with --gpu-kernels on a GPU (the plain path's
    0.14-0.18x is known from two lends); its rows say so, and the goal line names them."""
    rows_of = script("gpu_check_train_rows").train_rows
    compute = {"model": "resnet50", "hpcdl_images_per_s": 1000.0, "gpu_kernels": True}
    metrics = [{"event": "epoch", "images_per_s": 900.0, "seconds": 2.0},
               {"event": "summary", "global_batch": 128, "world_size": 1, "precision": "bf16",
                "mean_step": {"t_data": 0.01, "t_step": 0.2}}]  # fmt: skip
    log = "hpcdl: loader: 2 worker(s) per rank, 4 batch slots (auto), files decoded in the rank"
    alone, fed = rows_of(compute, metrics, log, 2, "H200")
    assert fed["model"] == alone["model"] == "hpcdl resnet50 --gpu-kernels"
    rows = [fed, {**fed, "loader": "dataloader", "decode": "cpu", "workers": 8,
                  "model": "resnet50", "images_per_s": 1800.0}]  # fmt: skip
    line = script("gpu_check_goals").end_to_end_goal(rows, {"input": "0 100"})
    assert "hpcdl.train --gpu-kernels 900 vs DataLoader at 8 workers 1800" in line.figure, line


def test_the_gpu_checks_train_row_times_the_steps_after_six_as_the_input_rows_do():
    """With step records (--metrics-every 1), the hpcdl.train row's rate is that of the steps
    after the first 6, across the epoch boundary, as `bench input` times its rows (50 steps
    after 6, one boundary inside), not the later epochs' (20 steps right after a boundary)."""
    rows_of = script("gpu_check_train_rows").train_rows
    compute = {"model": "resnet50", "hpcdl_images_per_s": 1000.0}
    steps = [
        {"event": "step", "step": k, "time": 100.0 + (5.0 if k > 1 else 0) + 0.1 * k}
        for k in range(1, 57)
    ]  # step 1 takes 5 s more (start-up); then 0.1 s each
    metrics = [*steps[:50], {"event": "epoch", "images_per_s": 100.0, "seconds": 10.0},
               *steps[50:], {"event": "epoch", "images_per_s": 50.0, "seconds": 2.0},
               {"event": "summary", "global_batch": 128, "world_size": 1, "precision": "bf16",
                "mean_step": {"t_data": 0.01, "t_step": 0.1}}]  # fmt: skip
    log = "hpcdl: loader: 2 worker(s) per rank, 4 batch slots (auto), files decoded in the rank"
    _, fed = rows_of(compute, metrics, log, 2, "H100")
    assert fed["images_per_s"] == pytest.approx(128 / 0.1)  # steps 7-56, not the epochs' 50


def test_the_torch_engines_decode_row_is_set_beside_the_input_phases_step_alone(tmp_path):
    """gpu_check_train_rows --alone-input (issue 61): `hpcdl.train --model torchvision:resnet50
    --decode gpu` as one row under the input phase's step-alone row's model and device, so the
    summary judges it against torchvision's step alone; no step-alone row: one line, exit 1."""
    main = script("gpu_check_train_rows").main
    none = {"loader": "none", "decode": "-", "workers": None, "images_per_s": 2000.0,
            "model": "resnet50", "device": "NVIDIA H200", "batch": 128}  # fmt: skip
    inputs = tmp_path / "input.jsonl"
    own = {**none, "model": "hpcdl resnet50", "images_per_s": 250.0}  # appended after it
    inputs.write_text("".join(json.dumps(r) + "\n" for r in ({**none, "loader": "dataloader"},
                                                           none, own)))  # fmt: skip
    metrics = tmp_path / "train.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [
        {"event": "epoch", "images_per_s": 500.0, "seconds": 9.0},
        {"event": "epoch", "images_per_s": 1900.0, "seconds": 4.0},
        {"event": "summary", "global_batch": 128, "world_size": 1, "precision": "bf16",
         "mean_step": {"t_data": 0.002, "t_step": 0.067}},
    ]))  # fmt: skip
    log = tmp_path / "train.log"
    log.write_text("hpcdl: loader: 2 worker(s) per rank, 4 batch slots (auto), files decoded")
    out = tmp_path / "out.jsonl"
    assert main(["--alone-input", str(inputs), str(metrics), str(log), str(out), "2"]) == 0
    (row,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert set(row) == FIELDS and (row["loader"], row["decode"], row["workers"]) == (
        "hpcdl.train", "gpu", 2)  # fmt: skip
    assert (row["model"], row["device"], row["batch"]) == ("resnet50", "NVIDIA H200", 128)
    assert row["images_per_s"] == pytest.approx(1900.0)
    inputs.write_text(json.dumps({**none, "loader": "dataloader"}) + "\n" + json.dumps(own) + "\n")
    assert main(["--alone-input", str(inputs), str(metrics), str(log), str(out), "2"]) == 1
    assert len(out.read_text().splitlines()) == 1  # nothing appended


def script(name: str):
    """A module of scripts/ (not a package), loaded from its file."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
