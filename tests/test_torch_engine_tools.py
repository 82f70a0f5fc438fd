"""The tools with a torch model (hpcdl.torch_engine): hpcdl.export of a torch engine's
checkpoint, and the flags the torch engine serves or refuses; real runs on the digits data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import mpi_env, read_events, run_train

from hpcdl import checkpoint

torch = pytest.importorskip("torch")

MODELS = Path(__file__).parent / "torch_models.py"
CNN = f"{MODELS}:small_cnn"


def args(digits: Path, *more) -> list:
    return ["--data", digits / "train", "--model", CNN, "--batch-size", 16, "--lr", 0.05,
            "--workers", 0, "--seed", 3, "--progress", "none", *more]  # fmt: skip


@pytest.fixture(scope="module")
def torch_ckpt(digits_dir, tmp_path_factory) -> Path:
    """The last checkpoint of a short torch-engine run of small_cnn (BatchNorm: buffers)."""
    ck = tmp_path_factory.mktemp("torch-ck")
    done = run_train(1, *args(digits_dir, "--epochs", 1, "--max-steps", 12,
                              "--checkpoint-every", 12, "--checkpoint-dir", ck),
                     timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return checkpoint.latest(ck)


def export(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.export", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def user_module(ckpt: Path) -> torch.nn.Module:
    """The user's own module, built from their file as they would, untrained."""
    import torch_models  # noqa: PLC0415 (tests/ is on the path)

    return torch_models.small_cnn((1, 8, 8), 10).eval()


def test_export_to_torch_is_the_state_dict_the_users_module_loads_strictly(torch_ckpt, tmp_path):
    out = tmp_path / "cnn.pth"
    done = export(torch_ckpt, "--to", "torch", out)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "10 classes" in done.stdout
    state = torch.load(out, weights_only=True)
    module = user_module(torch_ckpt)
    assert set(state) == set(module.state_dict())  # parameters AND buffers
    module.load_state_dict(state, strict=True)
    saved = checkpoint.load(torch_ckpt)
    assert int(state["norm.num_batches_tracked"]) == saved.global_step == 12
    assert not torch.equal(state["norm.running_mean"], torch.zeros(8))  # trained statistics
    flat = dict(zip([n for n, _ in saved.layout], np.cumsum([0] + [int(np.prod(s)) for _, s
                                                                   in saved.layout])))  # fmt: skip
    lo = int(flat["head.bias"])
    assert state["head.bias"].numpy().tobytes() == saved.params[lo : lo + 10].tobytes()
    again = export(torch_ckpt, "--to", "torch", out)  # never replaces a file
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr


def test_export_of_a_torch_checkpoint_without_torch_installed_names_the_extra(torch_ckpt, tmp_path):
    """torch hidden from the process (as if not installed): one line, nothing written."""
    argv = [str(torch_ckpt), "--to", "torch", str(tmp_path / "cnn.pth")]
    code = ("import sys; sys.modules['torch'] = None; from hpcdl.export import main; "
            f"sys.exit(main({argv!r}))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "torch, which is not installed: pip install 'hpcdl[torch]'" in done.stderr
    assert not (tmp_path / "cnn.pth").exists()


def test_export_to_safetensors_holds_the_same_tensors(torch_ckpt, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file  # noqa: PLC0415

    done = export(torch_ckpt, "--to", "safetensors", tmp_path / "cnn.safetensors")
    assert done.returncode == 0, done.stderr
    module = user_module(torch_ckpt)
    module.load_state_dict(load_file(tmp_path / "cnn.safetensors"), strict=True)
    pth = tmp_path / "cnn.pth"
    assert export(torch_ckpt, "--to", "torch", pth).returncode == 0
    reference = torch.load(pth, weights_only=True)
    for key, tensor in module.state_dict().items():
        assert torch.equal(tensor, reference[key]), key


def test_export_to_onnx_computes_the_torch_modules_logits(torch_ckpt, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    out, pth = tmp_path / "cnn.onnx", tmp_path / "cnn.pth"
    done = export(torch_ckpt, "--to", "onnx", out)
    assert done.returncode == 0, done.stderr
    assert export(torch_ckpt, "--to", "torch", pth).returncode == 0
    module = user_module(torch_ckpt)
    module.load_state_dict(torch.load(pth, weights_only=True), strict=True)
    x = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = module(x).numpy()
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


OVERFLOWS = f"{Path(__file__).parent / 'torch_overflow_model.py'}:overflows_on_rank_1"


def summary_of(metrics: Path) -> dict:
    return read_events(metrics, "summary")[-1]


@pytest.mark.parametrize("sync", [[], ["--sync", "params:4"]], ids=["grads", "params4"])
def test_fp16_skips_on_every_rank_the_steps_whose_gradients_overflowed_on_one(
    digits_dir, tmp_path, sync
):
    """Rank 1's gradients are inf at its 2nd and 5th steps: both ranks skip those two updates
    (the overflow count rides the gradient allreduce; with --sync params:K one agreed
    allreduce decides), count them and halve the scale (rank 0's record and checkpoint)."""
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    done = run_train(2, *args(digits_dir, "--epochs", 1, "--max-steps", 8, "--model", OVERFLOWS,
                              "--precision", "fp16", "--metrics", metrics, "--metrics-every", 1,
                              "--checkpoint-every", 8, "--checkpoint-dir", ck, *sync),
                     env={**mpi_env(), "HPCDL_TORCH_OVERFLOW_STEPS": "2,5"},
                     timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hpcdl: precision fp16: forward and loss under torch.autocast" in done.stdout
    steps = read_events(metrics, "step")
    assert [s["applied"] for s in steps] == [True, False, True, True, False, True, True, True]
    # hpcdl's rule (the record holds the scale after the step): halved at each skip
    assert [s["loss_scale"] for s in steps] == [2.0**16] + [2.0**15] * 3 + [2.0**14] * 4
    assert summary_of(metrics)["skipped_steps"] == 2
    saved = checkpoint.load(checkpoint.latest(ck))
    assert saved.loss_scale == {"scale": 16384.0, "good_steps": 3}
    assert saved.optimizer["updates"][0] == 6  # two of eight steps skipped
    assert np.isfinite(saved.params).all()


def test_fp16_trains_a_torch_module_under_autocast_to_identical_parameters(digits_dir, tmp_path):
    digests = tmp_path / "digests"
    digests.mkdir()
    metrics = tmp_path / "m.jsonl"
    done = run_train(2, *args(digits_dir, "--epochs", 1, "--precision", "fp16", "--val-data",
                              digits_dir / "val", "--metrics", metrics),
                     env={**mpi_env(), "HPCDL_TORCH_DIGESTS": str(digests)},
                     timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.splitlines()[-1].split()[3]) > 0.5, done.stdout  # val_acc
    finals = [(digests / f"rank-{r}.txt").read_text().split()[-1] for r in range(2)]
    assert finals[0] == finals[1]
    assert summary_of(metrics)["precision"] == "fp16"


def run_python(code: str, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True,
                          text=True, timeout=300, env=mpi_env())  # fmt: skip


def job_toml(tmp_path: Path, digits: Path, model: str) -> Path:
    toml = tmp_path / "job.toml"
    toml.write_text(f'data = "{digits / "train"}"\nmodel = "{model}"\nepochs = 1\n'
                    'precision = "fp16"\n')  # fmt: skip
    return toml


@pytest.mark.parametrize("model", [CNN, "torchvision:resnet18"])
def test_stage_dry_run_of_a_torch_job_plans_without_importing_torch(digits_dir, tmp_path, model):
    toml = job_toml(tmp_path, digits_dir, model)
    code = ("import sys; from hpcdl.stage import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'imported torch'; sys.exit(rc)")  # fmt: skip
    done = run_python(code, "--dry-run", "--config", toml, "--nodes", 2)
    assert done.returncode == 0, done.stderr
    assert "samples reach the model as (1, 8, 8)" in done.stdout
    assert "node 1: 4 files" in done.stdout


@pytest.mark.parametrize("model", [CNN, "torchvision:resnet18"])
def test_jobs_render_train_of_a_torch_model_config(digits_dir, tmp_path, model):
    toml = job_toml(tmp_path, digits_dir, model)
    code = ("import sys; from hpcdl.jobs.__main__ import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'imported torch'; sys.exit(rc)")  # fmt: skip
    done = run_python(code, "render", "train", "--nodes", 2, "--time", "00:10:00", "--config",
                      toml, "--checkpoint-dir", tmp_path / "ck")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "hpcdl.train" in done.stdout and str(toml) in done.stdout


def test_doctor_says_which_torch_models_train_here_without_importing_torch():
    code = ("import sys; from hpcdl.doctor.__main__ import main; rc = main([]); "
            "assert 'torch' not in sys.modules, 'imported torch'; sys.exit(rc)")  # fmt: skip
    done = run_python(code)
    assert done.returncode in (0, 1), done.stderr  # 1: something else to fix on this machine
    line = next(x for x in done.stdout.splitlines() if x.strip().startswith("torch "))
    assert f"torch {torch.__version__}" in line and "--model FILE.py:FN" in line


def test_sync_bn_trains_and_its_checkpoint_exports_to_the_users_module(digits_dir, tmp_path):
    """--sync-bn swaps the module's BatchNorm layers for hpcdl.torch_engine.sync_batch_norm's,
    which keep their state-dict keys: the checkpoint's export loads strictly into the user's
    own module (plain BatchNorm2d), with the trained statistics, and --init-from takes it."""
    ck = tmp_path / "ck"
    done = run_train(2, *args(digits_dir, "--epochs", 1, "--max-steps", 12, "--sync-bn",
                              "--checkpoint-every", 12, "--checkpoint-dir", ck),
                     timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "cnn.pth"
    exported = export(checkpoint.latest(ck), "--to", "torch", out)
    assert exported.returncode == 0, exported.stderr
    state = torch.load(out, weights_only=True)
    module = user_module(ck)
    assert type(module.norm) is torch.nn.BatchNorm2d
    module.load_state_dict(state, strict=True)
    assert int(state["norm.num_batches_tracked"]) == 12
    assert not torch.equal(state["norm.running_mean"], torch.zeros(8))  # trained statistics
    again = run_train(2, *args(digits_dir, "--epochs", 1, "--max-steps", 1, "--sync-bn",
                               "--init-from", out), timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"hpcdl: weights from {out}" in again.stdout
