"""hpcdl.nn.weight_names + weights_io: PyTorch state dicts in and out of hpcdl models, checked
against the repo's written-out torchvision ResNets and torch.nn.Sequential equivalents."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn.weights_io import load_state, read_state, state_dict, write_state

torch = pytest.importorskip("torch")
from hpcdl.bench.torch_models import imagenet_resnet  # noqa: E402 (imports torch)


def trained_like_buffers(model: nn.Model, seed: int) -> None:
    """BatchNorm statistics as after training (means near 0, variances near 1), so that an
    exchanged mean or variance changes the logits."""
    rng = np.random.default_rng(seed)
    for leaf in model.body.leaves():
        if "running_mean" in leaf.b:
            leaf.b["running_mean"][...] = rng.normal(0, 0.2, leaf.b["running_mean"].shape)
            leaf.b["running_var"][...] = rng.uniform(0.5, 1.5, leaf.b["running_var"].shape)


def to_torch(state: dict[str, np.ndarray]) -> dict:
    return {k: torch.from_numpy(v) for k, v in state.items()}


def assert_logits_close(got, expected, tol):
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * np.abs(expected).max())


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_export_loads_strictly_into_torchvisions_resnet_with_the_same_logits(name):
    ours = nn.build_model(name, (3, 32, 32), 5, seed=1)
    trained_like_buffers(ours, 2)
    exported = state_dict(ours, batches_tracked=7)
    theirs = imagenet_resnet(name, 3, 5)
    assert list(exported) == list(theirs.state_dict())  # torchvision's keys, in its order
    theirs.load_state_dict(to_torch(exported), strict=True)
    assert (
        int(theirs.bn1.num_batches_tracked) == 7 and exported["bn1.num_batches_tracked"].ndim == 0
    )
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    expected = ours.forward(x, train=False)
    with torch.no_grad():
        got = theirs.eval()(torch.from_numpy(x)).numpy()
    assert np.ptp(expected, axis=0).max() > 1e-3  # the samples' logits differ: a real check
    assert_logits_close(got, expected, 1e-5)


def test_import_of_torchvision_weights_gives_torchs_logits():
    torch.manual_seed(3)
    theirs = imagenet_resnet("resnet18", 1, 6)
    with torch.no_grad():  # trained-looking statistics, as a pretrained file has
        for module in theirs.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.2)
                module.running_var.uniform_(0.5, 1.5)
    ours = nn.build_model("resnet18", (1, 24, 24), 6, seed=0)
    notes = load_state(ours, {k: v.numpy() for k, v in theirs.state_dict().items()}, "w.pth")
    assert notes == []
    x = np.random.default_rng(1).standard_normal((2, 1, 24, 24)).astype(np.float32)
    with torch.no_grad():
        expected = theirs.eval()(torch.from_numpy(x)).numpy()
    assert_logits_close(ours.forward(x, train=False), expected, 1e-5)


def keras_cnn_in_torch(k: int) -> torch.nn.Sequential:
    """hpcdl's cnn on 3x32x32 as the nn.Sequential of the same layers (docs/models.md)."""
    t = torch.nn
    return t.Sequential(
        t.Conv2d(3, 32, 3, padding=1), t.ReLU(), t.Conv2d(32, 32, 3), t.ReLU(), t.MaxPool2d(2),
        t.Dropout(0.25), t.Conv2d(32, 64, 3, padding=1), t.ReLU(), t.Conv2d(64, 64, 3), t.ReLU(),
        t.MaxPool2d(2), t.Dropout(0.25), t.Flatten(), t.Linear(64 * 6 * 6, 512), t.ReLU(),
        t.Dropout(0.5), t.Linear(512, k),
    )  # fmt: skip


def test_cnn_and_mlp_names_are_those_of_the_same_torch_sequential():
    """The dense layer after Flatten takes PyTorch's (C, H, W) order: its rows are permuted."""
    x = np.random.default_rng(2).standard_normal((2, 3, 32, 32)).astype(np.float32)
    t = torch.nn
    mlp = t.Sequential(t.Flatten(), t.Linear(3 * 32 * 32, 512), t.ReLU(), t.Dropout(0.2))
    mlp.append(t.Linear(512, 4))
    for name, theirs in (("cnn", keras_cnn_in_torch(4)), ("mlp", mlp)):
        ours = nn.build_model(name, (3, 32, 32), 4, seed=5)
        theirs.load_state_dict(to_torch(state_dict(ours)), strict=True)
        with torch.no_grad():
            expected = theirs.eval()(torch.from_numpy(x)).numpy()
        assert_logits_close(ours.forward(x, train=False), expected, 1e-5)
        back = nn.build_model(name, (3, 32, 32), 4, seed=6)  # other values, then the file's
        load_state(back, {k: v.numpy() for k, v in theirs.state_dict().items()}, "f")
        np.testing.assert_array_equal(back.params, ours.params)


def test_another_class_count_reinitialises_only_the_classifier():
    source = nn.build_model("resnet18", (3, 16, 16), 1000, seed=1)
    trained_like_buffers(source, 3)
    model = nn.build_model("resnet18", (3, 16, 16), 4, seed=9)
    fresh_head = model.params[: 512 * 4 + 4].copy()  # offset 0: the classifier (last layer)
    notes = load_state(model, state_dict(source), "--init-from r18.pth")
    assert notes == [
        "--init-from r18.pth: fc.weight is (1000, 512) there, (4, 512) here: the final layer is "
        "re-initialised for 4 classes"
    ]
    np.testing.assert_array_equal(model.params[: fresh_head.size], fresh_head)
    np.testing.assert_array_equal(
        model.params[fresh_head.size :], source.params[512 * 1000 + 1000 :]
    )
    np.testing.assert_array_equal(model.buffers, source.buffers)


def test_a_file_that_does_not_fit_is_one_line_naming_the_key_and_leaves_the_model_alone():
    model = nn.build_model("resnet18", (3, 16, 16), 4, seed=0)
    before = model.params.copy()
    good = state_dict(nn.build_model("resnet18", (3, 16, 16), 4, seed=1))

    def error(state):
        with pytest.raises(ValueError) as info:
            load_state(model, state, "w.pth")
        np.testing.assert_array_equal(model.params, before)
        return str(info.value)

    missing = dict(good)
    del missing["layer3.1.bn2.running_var"]
    assert error(missing) == (
        "w.pth: missing key 'layer3.1.bn2.running_var': model 'resnet18' needs shape (256,), "
        "the file has none"
    )
    assert error({**good, "layer5.0.conv1.weight": np.zeros((2, 3, 3, 3), np.float32)}).startswith(
        "w.pth: unexpected key 'layer5.0.conv1.weight' (2, 3, 3, 3): model 'resnet18' has no such"
    )
    wrong = {**good, "layer2.0.conv1.weight": np.zeros((128, 64, 1, 1), np.float32)}
    assert error(wrong) == (
        "w.pth: key 'layer2.0.conv1.weight' has shape (128, 64, 1, 1) in the file but "
        "(128, 64, 3, 3) in model 'resnet18'; give weights of the same architecture"
    )
    assert "\n" not in error(missing)
    no_counts = {k: v for k, v in good.items() if not k.endswith("num_batches_tracked")}
    load_state(model, no_counts, "w.pth")  # accepted without them, as PyTorch's old files
    np.testing.assert_array_equal(
        model.params, nn.build_model("resnet18", (3, 16, 16), 4, seed=1).params
    )


@pytest.mark.parametrize("suffix,to", [(".pth", "torch"), (".safetensors", "safetensors")])
def test_files_round_trip_and_are_never_replaced(tmp_path, suffix, to):
    model = nn.build_model("resnet20", (3, 8, 8), 10, seed=4)
    path = tmp_path / f"w{suffix}"
    write_state(state_dict(model), path, to)
    back = read_state(path)
    for key, value in state_dict(model).items():
        np.testing.assert_array_equal(back[key], value)
    with pytest.raises(ValueError, match="exists; give a new file name"):
        write_state(state_dict(model), path, to)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left


def test_pth_is_read_with_weights_only(tmp_path):
    """A pickle that would build an arbitrary object is refused, in one line."""
    path = tmp_path / "evil.pth"
    torch.save({"fc.weight": torch.zeros(2), "extra": Exception("not a tensor")}, path)
    with pytest.raises(ValueError) as info:
        read_state(path)
    assert str(info.value).startswith(f"{path} cannot be read as a PyTorch state dict")
    assert "weights_only=True" in str(info.value) and "\n" not in str(info.value)


def test_without_pytorch_both_formats_are_read_and_pth_is_written(tmp_path):
    """.pth is PyTorch's zip format, which hpcdl.nn.pth reads and writes itself: no torch."""
    model = nn.build_model("mlp", (1, 8, 8), 10, seed=0)
    write_state(state_dict(model), tmp_path / "w.safetensors", "safetensors")
    torch.save(to_torch(state_dict(model)), tmp_path / "w.pth")
    script = f"""
import sys
sys.modules["torch"] = None  # PyTorch not installed: importing it raises ImportError
from hpcdl import nn
from hpcdl.nn.weights_io import load_state, read_state, state_dict, write_state
for name in ("w.safetensors", "w.pth"):
    model = nn.build_model("mlp", (1, 8, 8), 10, seed=1)
    load_state(model, read_state({str(tmp_path)!r} + "/" + name), "w")
    print(float(model.params.sum()))
write_state(state_dict(model), {str(tmp_path / "out.pth")!r}, "torch")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    totals = [float(v) for v in out.stdout.split()]
    assert totals == pytest.approx([float(model.params.sum())] * 2, rel=1e-6)
    back = torch.load(tmp_path / "out.pth", weights_only=True)  # PyTorch reads what we wrote
    for key, value in state_dict(model).items():
        np.testing.assert_array_equal(back[key].numpy(), value)
        assert tuple(back[key].shape) == value.shape
