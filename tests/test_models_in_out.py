"""Models in and out of hpcdl, end to end under mpirun: --init-from a PyTorch state dict, train
on 2 ranks, `python -m hpcdl.export`, reload in PyTorch; --tensorboard against the JSONL."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from helpers import read_events, run_train

from hpcdl import checkpoint, nn
from hpcdl.export import ExportRequest, model_of
from hpcdl.nn.weights_io import state_dict

torch = pytest.importorskip("torch")
from hpcdl.bench.torch_models import imagenet_resnet  # noqa: E402 (imports torch)


def export_cli(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpcdl.export", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_torch_weights_in_train_two_ranks_export_and_reload_strictly(digits_dir, tmp_path):
    torch.manual_seed(0)
    start = imagenet_resnet("resnet18", 1, 10)  # digits: 1x8x8, 10 classes
    with torch.no_grad():
        for module in start.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_var.uniform_(0.5, 1.5)
    torch.save(start.state_dict(), tmp_path / "init.pth")
    result = run_train(
        2,
        *("--data", digits_dir / "train", "--model", "resnet18", "--batch-size", 8),
        *("--init-from", tmp_path / "init.pth", "--max-steps", 2, "--lr", 1e-4),
        *("--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 2, "--workers", 0),
    )
    assert result.returncode == 0, result.stderr
    assert f"hpcdl: weights from {tmp_path / 'init.pth'}" in result.stdout
    (ckpt_path,) = checkpoint.list_checkpoints(tmp_path / "ck")
    trained = model_of(checkpoint.load(ckpt_path), ExportRequest(str(ckpt_path), "torch", ""))
    # Two small steps (lr 1e-4) from PyTorch's weights: near them, far from --seed's.
    conv1 = start.conv1.weight.detach().numpy().transpose(2, 3, 1, 0)
    ours = trained.body.layers[0].p["W"]
    seeded = nn.build_model("resnet18", (1, 8, 8), 10, seed=0).body.layers[0].p["W"]
    assert np.abs(ours - conv1).max() < 0.1 * np.abs(seeded - conv1).max()

    for to, name in (("torch", "out.pth"), ("safetensors", "out.safetensors"), ("onnx", "o.onnx")):
        done = export_cli(ckpt_path, "--to", to, tmp_path / name)  # shape from the run's --data
        assert done.returncode == 0, done.stderr
        assert f"wrote {tmp_path / name} ({to}, model resnet18, input (1, 8, 8), 10 classes)" in (
            done.stdout
        )
    reloaded = imagenet_resnet("resnet18", 1, 10)
    state = torch.load(tmp_path / "out.pth", weights_only=True)
    reloaded.load_state_dict(state, strict=True)
    assert int(reloaded.bn1.num_batches_tracked) == 2  # the checkpoint's global step
    x = np.random.default_rng(0).standard_normal((4, 1, 8, 8)).astype(np.float32)
    expected = trained.forward(x, train=False)
    with torch.no_grad():
        got = reloaded.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())

    from safetensors.numpy import load_file

    for key, value in load_file(str(tmp_path / "out.safetensors")).items():
        np.testing.assert_array_equal(value, state[key].numpy())
    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / "o.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input": x})
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())

    again = export_cli(ckpt_path, "--to", "torch", tmp_path / "out.pth")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"python -m hpcdl.export: error: {tmp_path / 'out.pth'} exists; give a new file name "
        "(hpcdl never replaces a file)"
    ]


def test_init_from_that_does_not_fit_stops_every_rank_with_one_line(digits_dir, tmp_path):
    state = imagenet_resnet("resnet18", 3, 10).state_dict()  # 3 input channels, digits have 1
    torch.save(state, tmp_path / "rgb.pth")
    result = run_train(
        2,
        *("--data", digits_dir / "train", "--model", "resnet18", "--batch-size", 8),
        *("--init-from", tmp_path / "rgb.pth", "--max-steps", 1, "--workers", 0),
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert lines == [
        f"hpcdl.train: error: --init-from {tmp_path / 'rgb.pth'}: key 'conv1.weight' has shape "
        "(64, 3, 7, 7) in the file but (64, 1, 7, 7) in model 'resnet18'; give weights of the "
        "same architecture (on rank 0)"
    ]


STEP_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "samples_per_s": "train/images_per_s",
    "loss_scale": "train/loss_scale",
    **{t: f"step_time/{t}" for t in ("t_data", "t_compute", "t_comm_exposed", "t_update")},
    "t_step": "step_time/t_step",
}
EPOCH_TAGS = {k: f"epoch/{k}" for k in ("loss", "acc", "val_loss", "val_acc", "images_per_s")}


def test_tensorboard_series_equal_the_jsonl_of_the_same_run(digits_dir, tmp_path):
    from tbparse import SummaryReader

    result = run_train(
        2,
        *("--data", digits_dir / "train", "--val-data", digits_dir / "val", "--model", "mlp"),
        *("--epochs", 2, "--batch-size", 32, "--precision", "fp16", "--metrics-every", 3),
        *("--stage-dir", tmp_path / "stage", "--workers", 1),
        *("--metrics", tmp_path / "m.jsonl", "--tensorboard", tmp_path / "tb"),
    )
    assert result.returncode == 0, result.stderr
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in read_events(tmp_path / "m.jsonl", "step"):
        for key, tag in STEP_TAGS.items():
            expected.setdefault(tag, []).append((record["step"], record[key]))
    for record in read_events(tmp_path / "m.jsonl", "epoch"):
        for key, tag in EPOCH_TAGS.items():
            expected.setdefault(tag, []).append((record["epoch"] + 1, record[key]))
        for node in record["staging_nodes"]:
            for key in ("hits", "misses"):
                tag = f"staging/{node['node']}/{key}"
                expected.setdefault(tag, []).append((record["epoch"] + 1, node[key]))
    assert len(expected["train/loss"]) >= 4 and len(expected["epoch/val_acc"]) == 2
    assert sum(v for _, v in expected[f"staging/{record['staging_nodes'][0]['node']}/hits"]) > 0

    scalars = SummaryReader(str(tmp_path / "tb")).scalars
    got = {
        tag: list(zip(rows["step"].tolist(), rows["value"].tolist()))
        for tag, rows in scalars.groupby("tag")
    }
    assert sorted(got) == sorted(expected)
    for tag, series in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in series], tag
        for (_, value), (_, want) in zip(got[tag], series):
            assert math.isclose(value, want, rel_tol=1e-6, abs_tol=1e-12), (tag, value, want)


def test_a_resumed_run_takes_the_checkpoint_not_the_init_file(digits_dir, tmp_path):
    misfit = nn.build_model("mlp", (1, 4, 4), 10, seed=0)  # an error if it were read: 16 inputs
    torch.save({k: torch.from_numpy(v) for k, v in state_dict(misfit).items()}, tmp_path / "w.pt")
    common = ("--data", digits_dir / "train", "--model", "mlp", "--workers", 0)
    first = run_train(
        1, *common, "--max-steps", 1, "--checkpoint-every", 1, "--checkpoint-dir", tmp_path / "ck"
    )
    assert first.returncode == 0, first.stderr
    again = run_train(
        1,
        *common,
        *("--max-steps", 2, "--checkpoint-dir", tmp_path / "ck", "--resume", "auto"),
        *("--init-from", tmp_path / "w.pt"),
    )
    assert again.returncode == 0, again.stderr
    assert f"hpcdl: --init-from {tmp_path / 'w.pt'} not read: resuming from" in again.stdout
