"""`bench compute --profile`: per-layer rows, totals, JSON; the torch side when installed."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.bench import compute, compute_setup, profile
from hpcdl.bench.profile import LayerTimes, pair_rows
from hpcdl.nn.step import train_step

TINY = ["--batch-size", "4", "--input-shape", "3,8,8", "--steps", "2"]
PARAM_KINDS = ("Conv2d", "BatchNorm", "Linear")


def tiny_args(model: str, *extra: str) -> argparse.Namespace:
    return compute.parse_args(["--model", model, *TINY, "--profile", *extra])


@pytest.mark.parametrize("model", ["cnn", "resnet20", "mlp"])
def test_hpcdl_rows_cover_every_leaf_with_positive_times(model):
    args = tiny_args(model)
    built = nn.build_model(model, args.shape, args.classes)
    names = profile.leaf_names(built.body)
    b = profile.profile_hpcdl(args)
    assert sorted(r.name for r in b.rows) == sorted(names.values())
    assert len(b.rows) == len(list(built.body.leaves()))
    assert all(r.forward_s > 0 for r in b.rows)
    assert all(r.backward_s > 0 for r in b.rows if r.kind in PARAM_KINDS)
    assert b.loss_s > 0 and b.update_s > 0


def test_hpcdl_rows_add_up_to_the_measured_step():
    b = profile.profile_hpcdl(tiny_args("resnet20"))
    parts = sum(r.forward_s + r.backward_s for r in b.rows) + b.loss_s + b.update_s
    # The rows are timed inside the step, so they cannot exceed it. How small the share left
    # outside the leaves is (input transpose, residual adds, bookkeeping) is a figure of
    # `bench compute --profile`, not a check: a ratio of times flakes under load.
    assert parts <= b.step_s
    assert b.other_s == pytest.approx(b.step_s - parts)


def test_the_original_methods_are_back_after_profiling():
    args = tiny_args("cnn")
    model = nn.build_model("cnn", args.shape, args.classes)
    with profile.timed_leaves(model, np):
        assert all("forward" in vars(leaf) for leaf in model.body.leaves())
    assert not any("forward" in vars(leaf) or "backward" in vars(leaf)
                   for leaf in model.body.leaves())  # fmt: skip


def test_profile_json_has_one_row_per_leaf(capsys):
    argv = ["--model", "cnn", *TINY, "--profile", "--json", "--no-torch"]
    assert compute.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("0.Conv2d") for line in out)
    result = json.loads(out[-1])
    ours = result["profile"]["hpcdl"]
    assert result["profile"]["torch"] is None
    assert len(ours["rows"]) == len(list(nn.build_model("cnn", (3, 8, 8), 10).body.leaves()))
    assert set(ours["rows"][0]) == {
        "name", "kind", "forward_ms", "backward_ms", "forward_gpu_ms", "backward_gpu_ms"
    }  # fmt: skip
    for key in ("loss_ms", "update_ms", "other_ms", "step_ms", "plain_step_ms", "layers_ms"):
        assert ours[key] > 0
    # off a GPU there is no device time: the columns are there, empty
    assert ours["layers_gpu_ms"] is None and ours["rows"][0]["forward_gpu_ms"] is None
    assert result["gpu_kernels"] is False


class _Event:
    """A stand-in CUDA event at a fixed device time (torch.cuda.Event's two methods)."""

    def __init__(self, t: float) -> None:
        self.t, self.waited = t, False

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, end: _Event) -> float:
        assert end.waited, "the end event is waited for before it is read"
        return (end.t - self.t) * 1e3  # ms, as CUDA reports


def test_device_times_from_events_fill_every_row_and_their_mean():
    """The GPU side's arithmetic on CPU: each forward / backward is bracketed by two events
    (a device clock that advances 2 ms per mark here), summed per step and averaged."""
    ticks = iter(range(10**6))
    clock = profile.GpuClock(lambda: _Event(next(ticks) * 2e-3))
    args = tiny_args("cnn")
    parts, x, y = compute_setup.hpcdl_setup(args)
    with profile.timed_leaves(parts.model, np, clock) as (rows, _):
        totals = profile.quiet_mean(
            rows, lambda: (0.0, 0.0, float(train_step(parts, x, y, 0.01).times.t_step)), 2
        )
    assert totals[2] > 0
    assert len(rows) == len(list(parts.model.body.leaves()))
    for row in rows:
        assert row.forward_gpu_s == pytest.approx(2e-3)  # one call a step: two marks apart
        if row.kind in PARAM_KINDS:
            assert row.backward_gpu_s == pytest.approx(2e-3)
    b = profile.Breakdown("hpcdl", rows, 0.0, 0.0, 1.0, 1.0)
    assert b.as_json()["layers_gpu_ms"] == pytest.approx(sum(
        (r.forward_gpu_s + (r.backward_gpu_s or 0)) * 1e3 for r in rows))  # fmt: skip


def test_profile_with_gpu_kernels_times_the_layers_eagerly(capsys):
    """--gpu-kernels builds a CUDA graph of the step; the instrumented steps run without it
    (a replay calls no layer), so every row is still timed."""
    argv = ["--model", "cnn", *TINY, "--profile", "--json", "--no-torch", "--gpu-kernels"]
    try:
        assert compute.main(argv) == 0
    finally:
        nn.kernels.enable(False)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["gpu_kernels"] is True
    assert all(row["forward_ms"] > 0 for row in result["profile"]["hpcdl"]["rows"])


def test_pair_rows_pairs_by_kind_and_leaves_functional_layers_blank():
    ours = [LayerTimes(n, k) for n, k in [("c", "Conv2d"), ("r", "ReLU"), ("l", "Linear")]]
    theirs = [LayerTimes(n, k) for n, k in [("tc", "Conv2d"), ("tp", "Pad"), ("tl", "Linear")]]
    pairs = [(a and a.name, b and b.name) for a, b in pair_rows(ours, theirs)]
    assert pairs == [("c", "tc"), (None, "tp"), ("r", None), ("l", "tl")]


@pytest.mark.parametrize("model", ["cnn", "resnet20"])
def test_torch_rows_pair_with_hpcdl_rows(model):
    pytest.importorskip("torch")
    args = tiny_args(model)
    ours, theirs = profile.profile_hpcdl(args), profile.profile_torch(args)
    assert theirs is not None
    pairs = pair_rows(ours.rows, theirs.rows)
    # Every torch module has its hpcdl layer, but for the Flatten hpcdl's global pool does.
    assert {b.kind for a, b in pairs if a is None} <= {"Flatten"}
    assert sum(b is not None for _, b in pairs) == len(theirs.rows)
    assert all(r.forward_s > 0 for r in theirs.rows)
    # The first convolution's input needs no gradient: its weight gradient still counts.
    assert theirs.rows[0].kind == "Conv2d" and theirs.rows[0].backward_s > 0
    assert 0 < theirs.loss_s and 0 < theirs.update_s
    assert sum(r.forward_s + r.backward_s for r in theirs.rows) <= theirs.step_s


def test_a_bf16_profile_times_both_sides_in_bf16(monkeypatch):
    """resnet50's goal rows are bf16: hpcdl's step in its bf16 format, PyTorch's under autocast
    (as bench compute times them)."""
    torch = pytest.importorskip("torch")
    args = tiny_args("cnn", "--precision", "bf16")
    ours = profile.profile_hpcdl(args)
    assert all(r.forward_s > 0 for r in ours.rows)
    seen = []
    real = torch.autocast

    def spy(*a, **kw):
        seen.append(kw.get("dtype"))
        return real(*a, **kw)

    monkeypatch.setattr(torch, "autocast", spy)
    theirs = profile.profile_torch(args)
    assert theirs is not None and all(r.forward_s > 0 for r in theirs.rows)
    assert seen and set(seen) == {torch.bfloat16}


def test_torch_side_profiles_a_model_with_in_place_relus():
    """torchvision's ResNets use ReLU(inplace=True), which PyTorch forbids on the output of a
    module with a full backward hook; the profile times them out of place (the same math)."""
    torch = pytest.importorskip("torch")
    args = tiny_args("resnet18")
    theirs = profile.profile_torch(args)
    assert theirs is not None
    kinds = [row.kind for row in theirs.rows]
    assert kinds.count("ReLU") >= 1 and all(row.forward_s > 0 for row in theirs.rows)
    assert torch.is_grad_enabled()


def summary_script(name: str = "gpu_check_summary"):
    """scripts/gpu_check_summary.py (or its gpu_check_goals.py; not a package), from its file."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(name, kind, fwd, bwd, gfwd=None, gbwd=None):
    return dict(name=name, kind=kind, forward_ms=fwd, backward_ms=bwd,
                forward_gpu_ms=gfwd, backward_gpu_ms=gbwd)  # fmt: skip


def test_the_gpu_checks_summary_says_where_device_and_host_time_go():
    ours = {"rows": [_row("0.Conv2d", "Conv2d", 2.0, 3.0, 0.5, 1.0),
                     _row("1.ReLU", "ReLU", 0.4, 0.4, 0.1, 0.1)],
            "layers_ms": 5.8, "layers_gpu_ms": 1.7, "plain_step_ms": 9.7}  # fmt: skip
    theirs = {"rows": [_row("conv", "Conv2d", 1.0, 1.0, 0.4, 0.6),
                       _row("relu", "ReLU", 0.1, 0.1, 0.1, 0.1)],
              "layers_ms": 2.2, "layers_gpu_ms": 1.2, "plain_step_ms": 3.4}  # fmt: skip
    lines = summary_script().profile_lines(
        "gk-cnn-fp32", {"profile": {"hpcdl": ours, "torch": theirs}}
    )
    assert "hpcdl layers 5.80 ms, device 1.70; step 9.70" in lines[0]
    assert "torch layers 2.20, device 1.20; step 3.40" in lines[0]
    assert lines[1] == "    most host time: 0.Conv2d 3.50, 1.ReLU 0.60"
    assert lines[2] == "    most device time over torch: 0.Conv2d +0.50, 1.ReLU +0.00"
    # off a GPU: no device figures, no gap lines
    cpu = {**ours, "rows": [_row("0.Conv2d", "Conv2d", 2.0, 3.0)], "layers_gpu_ms": None}
    assert summary_script().profile_lines("cnn", {"profile": {"hpcdl": cpu, "torch": None}}) == [
        "  cnn                hpcdl layers 5.80 ms, device -; step 9.70"
    ]


def test_the_gpu_checks_summary_puts_every_goal_beside_its_figure():
    compute = [
        dict(model="cnn", precision="fp32", gpu_kernels=True, ratio=2.84,
             hpcdl_peak_mib=430.0, torch_peak_mib=418.0),
        dict(model="cnn", precision="fp32", gpu_kernels=False, ratio=0.9,
             hpcdl_peak_mib=1219.0, torch_peak_mib=418.0),
        dict(model="resnet50", precision="bf16", gpu_kernels=False, ratio=0.95),
    ]  # fmt: skip
    status = {"compute-cnn-fp32": ("0", "9"), "tests": ("0", "50"), "loader": ("124", "90"),
              "input": ("skipped", "0")}  # fmt: skip
    train = [{"run": "cnn-gpu-1", "val_accuracy": 0.95},
             {"run": "ref-cnn-cpu-1", "val_accuracy": 0.955}]  # fmt: skip
    facts = {"compute": compute, "input": [], "train": train, "status": status, "profiles": {}}
    lines = summary_script().goal_lines(facts)
    text = "\n".join(lines)
    assert lines[0] == "goals (issue 60)" and len(lines) <= 20  # one screen
    assert "MISS compute: every ratio hpcdl/torch <= 1.0" in text
    assert "worst 2.84 (cnn fp32 gk); 1 of 3 miss" in text
    assert "MISS compute, graph on (gk): cnn, resnet20 <= 0.8" in text
    assert "worst 2.92 (cnn fp32); 1 of 2 miss" in text  # memory: 1219 / 418
    assert "n/a  input: default slots" in text
    assert "met  seeded run: val acc within 1 point" in text
    assert "n/a  cnn slowdown with graphs: per-op device time" in text  # its profile: not run
    assert "not recorded (profile-gk-cnn-fp32 not run)" in text
    assert "MISS no phase failed" in text and "loader" in text.splitlines()[-2]
    assert text.splitlines()[-1].startswith("  MISS every goal answered in this call")


def test_a_graph_row_whose_step_ran_plainly_does_not_meet_the_graph_goal():
    """The graph goal counts only rows whose step replayed a CUDA graph (bench compute's
    step_graph): a fast row that ran plainly is a MISS that says why."""
    compute_goals = summary_script("gpu_check_goals").compute_goals

    rows = [dict(model=m, precision=p, gpu_kernels=True, ratio=0.7, step_graph="captured")
            for m in ("cnn", "resnet20") for p in ("fp32", "bf16")]  # fmt: skip
    captured = compute_goals(rows, {})[1]
    assert captured.mark == "met " and "graph not on" not in captured.figure
    rows[3]["step_graph"] = "off: dropout draws its seed on the host"
    off = compute_goals(rows, {})[1]
    assert off.mark == "MISS" and "resnet20 bf16 gk: off: dropout draws" in off.figure
