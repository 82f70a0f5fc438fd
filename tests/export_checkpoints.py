"""Checkpoints of both engines for the `python -m hpcdl.export` tests, and the command: real
checkpoints (hpcdl's mlp, the torch engine's small_cnn) written with hpcdl.checkpoint.save from
freshly built models, for what is checked is the export, not training."""

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
