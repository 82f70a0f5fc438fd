"""`python -m hpcdl.export` refusals of an OUT that cannot be written (under /sys or /proc, below
a regular file), one line, exit status 2, nothing left behind. Real
checkpoints of both engines (hpcdl's mlp, the torch engine's small_cnn), written with
hpcdl.checkpoint.save from freshly built models: what is checked is the export, not training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl import checkpoint
from hpcdl.nn.models import build_model
from hpcdl.resume import shapes

TORCH_CNN = f"{Path(__file__).parent / 'torch_models.py'}:small_cnn"
SHAPE = (1, 8, 8)


def save(directory: Path, model, spec: str) -> Path:
    ckpt = checkpoint.Checkpoint(
        model=model.name, layout=shapes(model), params=model.params.copy(),
        buffers=model.buffers.copy(), optimizer={}, epoch=1, step_in_epoch=0, global_step=3,
        rng_states=[{}], config={"model": spec, "data": ""},
    )  # fmt: skip
    return checkpoint.save(directory, ckpt)


@pytest.fixture(scope="module")
def hpcdl_ckpt(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("hpcdl-ck"), build_model("mlp", SHAPE, 10), "mlp")


@pytest.fixture(scope="module")
def torch_ckpt(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    import torch_models  # noqa: PLC0415 (tests/ is on the path; imports torch)

    from hpcdl.config import TrainConfig  # noqa: PLC0415
    from hpcdl.torch_engine.flat import FlatModule  # noqa: PLC0415

    cfg = TrainConfig(data="", model=TORCH_CNN)
    flat = FlatModule(torch_models.small_cnn(SHAPE, 10), cfg, SHAPE, 10)
    return save(tmp_path_factory.mktemp("torch-ck"), flat, TORCH_CNN)


def export(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.export", *map(str, argv), "--input-shape", "1,8,8"],
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )


def assert_one_error_line(done: subprocess.CompletedProcess, line: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [f"python -m hpcdl.export: error: {line}"]


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
