"""`python -m hpcdl.export --model` naming another model than the checkpoint holds: one line
that names both, for either engine's checkpoint (tests/export_checkpoints.py)."""

from __future__ import annotations

from export_checkpoints import assert_one_error_line, export, hpcdl_ckpt, torch_ckpt

__all__ = ["hpcdl_ckpt", "torch_ckpt"]  # the fixtures


def test_a_torch_checkpoint_with_model_naming_an_hpcdl_model_names_both(torch_ckpt, tmp_path):
    done = export(torch_ckpt, "--to", "torch", tmp_path / "x.pth", "--model", "mlp")
    assert_one_error_line(
        done,
        f"checkpoint {torch_ckpt} holds model 'torch_models:small_cnn' but this run builds "
        "model 'mlp'",
    )
    assert not (tmp_path / "x.pth").exists()


def test_an_hpcdl_checkpoint_with_model_naming_another_hpcdl_model_names_both(hpcdl_ckpt, tmp_path):
    done = export(hpcdl_ckpt, "--to", "torch", tmp_path / "x.pth", "--model", "cnn")
    assert_one_error_line(
        done, f"checkpoint {hpcdl_ckpt} holds model 'mlp' but this run builds model 'cnn'"
    )
    assert not (tmp_path / "x.pth").exists()


def test_the_checkpoints_own_model_still_exports(hpcdl_ckpt, tmp_path):
    done = export(hpcdl_ckpt, "--to", "torch", tmp_path / "x.pth", "--model", "mlp")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "x.pth").is_file()
