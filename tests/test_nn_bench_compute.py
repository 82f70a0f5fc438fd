"""`python -m hpcdl.bench compute` runs and ends with one JSON object (tiny shape, no torch)."""

from __future__ import annotations

import json

import pytest

from hpcdl.backend import gpu_available
from hpcdl.bench import compute
from hpcdl.nn import kernels


def test_compute_benchmark_prints_json_last(capsys):
    argv = ["--model", "cnn", "--batch-size", "4", "--input-shape", "1,8,8", "--steps", "2"]
    assert compute.main([*argv, "--no-torch", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["hpcdl_ms_per_step"] > 0
    assert result["torch_ms_per_step"] is None and result["ratio"] is None
    assert result["step_graph"] is None  # no --gpu-kernels: no graph asked for
    assert result["torch_channels_last"] is None  # torch did not run


def test_compute_benchmark_says_whether_its_step_was_a_cuda_graph(monkeypatch, capsys):
    """With --gpu-kernels the row says whether the steps replayed a graph (the issue's graph
    goal reads it); on a CPU they cannot, and the row says why."""
    monkeypatch.setattr(kernels, "_enabled", kernels.enabled())  # --gpu-kernels turns them on
    argv = ["--model", "cnn", "--batch-size", "4", "--input-shape", "1,8,8", "--steps", "2"]
    assert compute.main([*argv, "--gpu-kernels", "--no-torch", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["step_graph"] == "off: not on a GPU"
    assert "  CUDA graph of the step: off: not on a GPU" in out


def test_compute_benchmark_takes_the_imagenet_resnets(capsys):
    argv = ["--model", "resnet18", "--batch-size", "2", "--input-shape", "3,16,16", "--steps", "1"]
    assert compute.main([*argv, "--no-torch", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["model"] == "resnet18" and result["hpcdl_ms_per_step"] > 0


def test_compute_benchmark_rejects_a_bad_input_shape(capsys):
    try:
        compute.main(["--input-shape", "3,32"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "--input-shape must be C,H,W" in capsys.readouterr().err


def test_compute_benchmark_runs_reduced_precision_and_says_so(capsys):
    argv = ["--model", "cnn", "--batch-size", "4", "--input-shape", "1,8,8", "--steps", "2"]
    for precision in ("bf16", "fp16"):
        assert compute.main([*argv, "--precision", precision, "--no-torch", "--json"]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["precision"] == precision and result["hpcdl_ms_per_step"] > 0


def test_compute_benchmark_profiles_fp32_and_bf16_not_fp16(capsys):
    with pytest.raises(SystemExit) as exc:
        compute.main(["--profile", "--precision", "fp16", "--no-torch"])
    assert exc.value.code == 2
    assert "--profile times fp32 and bf16 steps" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "env", "tf32"), [(False, False, False), (True, False, True),
                                                  (False, True, True)])  # fmt: skip
def test_compute_benchmark_gives_both_frameworks_the_same_float32_arithmetic(
    monkeypatch, capsys, flag, env, tf32
):
    """NOTE [TF32]: hpcdl's kernels and torch's convolutions and matmuls are set alike, TF32
    with --tf32 (or HPCDL_TF32=1, read at import), else IEEE float32 (PyTorch's own default
    would run its convolutions in TF32 against hpcdl's IEEE float32), and the row says which."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(kernels, "_tf32", env)
    monkeypatch.setattr(kernels, "_enabled", kernels.enabled())  # --gpu-kernels turns them on
    backends = (torch.backends.cudnn.conv, torch.backends.cudnn.rnn, torch.backends.cuda.matmul)
    saved = [b.fp32_precision for b in backends]
    argv = ["--model", "cnn", "--batch-size", "4", "--input-shape", "1,8,8", "--steps", "2"]
    try:
        gk = ["--gpu-kernels", "--tf32"] if flag else []  # --tf32 needs --gpu-kernels
        assert compute.main([*argv, *gk, "--json"]) == 0
        row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert row["tf32"] is tf32 and row["torch_ms_per_step"] > 0
        assert row["torch_channels_last"] is False  # on a CPU: the engine's layout stays
        assert kernels.tf32() is tf32
        assert [b.fp32_precision for b in backends] == ["tf32" if tf32 else "ieee"] * 3
    finally:
        for backend, value in zip(backends, saved, strict=True):
            backend.fp32_precision = value


def test_compute_benchmark_refuses_tf32_without_the_kernels_that_take_it(capsys):
    """hpcdl's plain kernels compute IEEE float32: a --tf32 row without --gpu-kernels would set
    PyTorch's TF32 against it. One line, exit 2."""
    with pytest.raises(SystemExit) as stopped:
        compute.main(["--tf32", "--no-torch"])
    assert stopped.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith("--tf32 needs --gpu-kernels: hpcdl's plain kernels compute IEEE float32")
    )


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
def test_on_a_gpu_the_torch_baseline_runs_channels_last(capsys):
    """PyTorch's convolutions in channels_last on a GPU: NHWC as hpcdl's arrays are, and its
    fast layout on tensor cores, as the end-to-end baseline runs them."""
    pytest.importorskip("torch")
    argv = ["--model", "cnn", "--batch-size", "8", "--input-shape", "3,32,32", "--steps", "2"]
    assert compute.main([*argv, "--device", "gpu", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["torch_channels_last"] is True and row["torch_ms_per_step"] > 0


def test_the_row_says_how_many_engines_both_frameworks_time(monkeypatch, capsys):
    """HPCDL_CUDNN_AUTOTUNE (NOTE [engine autotuning]) reaches the row and PyTorch's benchmark
    mode; off, PyTorch's stays off."""
    import torch  # noqa: PLC0415

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    argv = ["--model", "mlp", "--batch-size", "4", "--input-shape", "1,8,8", "--steps", "1"]
    for engines, benchmark in ((8, True), (0, False)):
        monkeypatch.setattr(kernels, "_autotune", engines)
        assert compute.main([*argv, "--json"]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["cudnn_autotune"] == engines and result["cudnn_plans"] is None
        assert torch.backends.cudnn.benchmark is benchmark


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
def test_a_captured_steps_peak_memory_counts_the_graphs_own_pool(monkeypatch, capsys):
    """The capture allocates from the graph's own pool, which CuPy's default pool does not
    count: the row's hpcdl peak holds it (the second lend's gk rows did not)."""
    monkeypatch.setattr(kernels, "_enabled", kernels.enabled())
    argv = ["--model", "cnn", "--batch-size", "64", "--input-shape", "3,32,32", "--steps", "2"]
    assert compute.main([*argv, "--device", "gpu", "--gpu-kernels", "--no-torch", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step_graph"] == "captured"
    assert result["hpcdl_graph_pool_mib"] > 0
    assert result["hpcdl_peak_mib"] >= result["hpcdl_graph_pool_mib"]
