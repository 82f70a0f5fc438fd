"""`python -m hpcdl.export --model FILE.py:FN` for a user's builder that moved or was renamed: the
checkpoint loads when the builder gives the same parameters (names and shapes) as the run's,
whatever the file is called now; another layout, or another kind of model (a built-in name), is
one line. Without --model a moved file is one line that says to give it. A file that is not a
checkpoint at all (a data shard) is said as such, in export's words, not training's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from export_checkpoints import SHAPE, TORCH_CNN, hpcdl_ckpt, save, torch_ckpt
from helpers import one_line_error

from hpcdl.data.convert import write_dataset
from hpcdl.nn.models import build_model

__all__ = ["hpcdl_ckpt", "torch_ckpt"]  # the fixtures
REPO = Path(__file__).resolve().parents[1]


def export(cwd: Path, *argv) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpcdl.export", *map(str, argv), "--input-shape", "1,8,8"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.fixture
def user_ckpt(tmp_path) -> Path:
    """A checkpoint of examples/my_model.py copied to mm.py, trained as `--model mm.py:build`
    from tmp_path; a reference export made while mm.py was still there; then mm.py is moved."""
    shutil.copy(REPO / "examples" / "my_model.py", tmp_path / "mm.py")
    model = build_model(f"{tmp_path / 'mm.py'}:build", SHAPE, 10, seed=3)
    ckpt = save(tmp_path / "uck", model, "mm.py:build")
    done = export(tmp_path, ckpt, "--to", "safetensors", "before.safetensors")
    assert done.returncode == 0, done.stderr
    (tmp_path / "mm.py").rename(tmp_path / "mm_moved.py")
    return ckpt


def test_a_moved_builder_with_the_same_parameters_exports_the_same_tensors(user_ckpt, tmp_path):
    from safetensors.numpy import load_file

    done = export(tmp_path, user_ckpt, "--to", "safetensors", "after.safetensors", "--model",
                  "mm_moved.py:build")  # fmt: skip
    assert done.returncode == 0, done.stderr
    before, after = (load_file(tmp_path / f"{w}.safetensors") for w in ("before", "after"))
    assert list(before) == list(after) and len(before) > 10
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])


def test_a_moved_builder_with_other_layers_names_the_first_parameter_that_differs(
    user_ckpt, tmp_path
):
    source = (tmp_path / "mm_moved.py").read_text()
    (tmp_path / "narrow.py").write_text(source.replace("(32, 64, 128, 256)", "(32, 64, 128, 128)"))
    done = export(tmp_path, user_ckpt, "--to", "torch", "x.pth", "--model", "narrow.py:build")
    line = one_line_error(done)
    assert f"checkpoint {user_ckpt} holds model 'mm:build'" in line, line
    assert "'narrow.py:build'" in line and "29.Linear.W" in line, line
    assert "(256, 10)" in line and "(128, 10)" in line, line
    assert not (tmp_path / "x.pth").exists()


def test_a_built_in_model_on_a_users_checkpoint_is_still_refused(user_ckpt, tmp_path):
    line = one_line_error(export(tmp_path, user_ckpt, "--to", "torch", "x.pth", "--model", "cnn"))
    assert line.endswith(
        f"checkpoint {user_ckpt} holds model 'mm:build' but this run builds model 'cnn'"
    ), line


def test_a_users_builder_on_a_built_in_models_checkpoint_is_still_refused(hpcdl_ckpt, tmp_path):
    shutil.copy(REPO / "examples" / "my_model.py", tmp_path / "mm.py")
    done = export(tmp_path, hpcdl_ckpt, "--to", "torch", "x.pth", "--model", "mm.py:build")
    line = one_line_error(done)
    assert line.endswith("holds model 'mlp' but this run builds model 'mm:build'"), line


def test_without_model_a_moved_file_says_to_give_model(user_ckpt, tmp_path):
    line = one_line_error(export(tmp_path, user_ckpt, "--to", "torch", "x.pth"))
    assert "mm.py is not a file" in line and "--model FILE.py:build" in line, line


def test_a_moved_torch_module_file_exports_with_model(torch_ckpt, tmp_path):
    shutil.copy(TORCH_CNN.rpartition(":")[0], tmp_path / "renamed.py")
    done = export(tmp_path, torch_ckpt, "--to", "torch", "m.pth", "--model", "renamed.py:small_cnn")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m.pth").stat().st_size > 0


def test_a_data_shard_is_not_an_hpcdl_checkpoint(tmp_path):
    write_dataset(tmp_path / "d", {"train": (np.zeros((4, 8, 8, 1), np.uint8), [0, 1, 0, 1])},
                  ["a", "b"])  # fmt: skip
    shard = next((tmp_path / "d" / "train").glob("*.h5"))
    line = one_line_error(export(tmp_path, shard, "--to", "torch", "x.pth"))
    assert f"{shard} is not an hpcdl checkpoint" in line and "--checkpoint-dir" in line, line
    assert "resume" not in line, line
    text = tmp_path / "notes.txt"
    text.write_text("not HDF5\n")
    line = one_line_error(export(tmp_path, text, "--to", "torch", "x.pth"))
    assert f"{text} is not an hpcdl checkpoint" in line and "resume" not in line, line
