"""torchvision's own builders through hpcdl.train (`--model torchvision:NAME`): a fine-tune from
a torchvision state dict, and the export that torchvision's module loads back. Marked
`torchvision`: scripts/torchvision-tests.sh runs them where torchvision sits beside torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import make_folder, mpi_env, run_train

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

pytestmark = pytest.mark.torchvision


def test_a_fine_tune_from_torchvisions_weights_exports_what_torchvision_loads(tmp_path):
    """resnet18's weights saved by torchvision (1,000 classes) start a 2-rank run on 3 classes:
    the head is re-initialised, the rest starts from the file; the checkpoint's export loads
    into torchvision's resnet18(num_classes=3) strictly, and its body is still the file's up
    to the three steps taken."""
    folder = tmp_path / "imgs"
    make_folder(folder, per_class=8, size=(32, 32), classes=("a", "b", "c"))
    torch.manual_seed(0)
    start = torchvision.models.resnet18().state_dict()
    torch.save(start, tmp_path / "resnet18.pth")
    ckpt = tmp_path / "ckpt"
    done = run_train(2, "--data", folder, "--model", "torchvision:resnet18", "--init-from",
                     tmp_path / "resnet18.pth", "--batch-size", 4, "--workers", 0, "--epochs", 1,
                     "--lr", 0.001, "--checkpoint-dir", ckpt, "--progress",
                     "none", timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    saved = sorted(ckpt.glob("ckpt-*.h5"))[-1]
    out = tmp_path / "tuned.pth"
    export = subprocess.run([sys.executable, "-m", "hpcdl.export", str(saved), "--to", "torch",
                             str(out)], capture_output=True, text=True, env=mpi_env(),
                            timeout=300)  # fmt: skip
    assert export.returncode == 0, export.stderr[-3000:]
    tuned = torchvision.models.resnet18(num_classes=3)
    tuned.load_state_dict(torch.load(out, weights_only=True), strict=True)
    body = tuned.state_dict()["layer1.0.conv1.weight"]
    moved = (body - start["layer1.0.conv1.weight"]).abs().max().item()
    assert 0 < moved < 0.05 * start["layer1.0.conv1.weight"].abs().max().item()
    assert tuned.fc.weight.shape == (3, 512)
    assert torch.isfinite(tuned.eval()(torch.zeros(1, 3, 32, 32))).all()
