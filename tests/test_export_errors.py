"""`python -m hpcdl.export` refusals of an OUT that cannot be written (under /sys or /proc, below
a regular file), one line, exit status 2, nothing left behind, for either engine's checkpoint
(tests/export_checkpoints.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from export_checkpoints import assert_one_error_line, export, hpcdl_ckpt, torch_ckpt

__all__ = ["hpcdl_ckpt", "torch_ckpt"]  # the fixtures


@pytest.mark.parametrize("engine", ["hpcdl", "torch"])
@pytest.mark.parametrize("to", ["torch", "safetensors", "onnx"])
def test_an_out_under_sys_is_one_line_and_leaves_no_temporary_file(engine, to, request):
    ckpt = request.getfixturevalue(f"{engine}_ckpt")
    done = export(ckpt, "--to", to, f"/sys/m.{to}")
    assert_one_error_line(
        done, f"cannot write /sys/m.{to}: Permission denied; give a writable directory"
    )
    assert not list(Path("/sys").glob(f".m.{to}.*"))


@pytest.mark.parametrize("engine", ["hpcdl", "torch"])
def test_an_out_under_proc_is_one_line(engine, request):
    done = export(request.getfixturevalue(f"{engine}_ckpt"), "--to", "torch", "/proc/m.pth")
    assert_one_error_line(
        done, "cannot write /proc/m.pth: No such file or directory; give a writable directory"
    )


@pytest.mark.parametrize("engine", ["hpcdl", "torch"])
def test_an_out_below_a_regular_file_is_one_line_and_the_file_is_untouched(
    engine, request, tmp_path
):
    plain = tmp_path / "plain.txt"
    plain.write_text("a user's file\n")
    done = export(request.getfixturevalue(f"{engine}_ckpt"), "--to", "torch", plain / "m.pth")
    assert_one_error_line(
        done,
        f"cannot write {plain / 'm.pth'}: {plain} is not a directory; give a writable directory",
    )
    assert plain.read_text() == "a user's file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.txt"]
