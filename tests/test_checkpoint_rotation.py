"""checkpoint.save's keep-2 rotation deletes only the checkpoints of the run that saves (its
recorded run id): never another run's, one written before run ids, or a user's file that
happens to be named as a checkpoint. And a checkpoint that cannot be written says what to do
for its errno."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpcdl import checkpoint


def make(gstep: int = 10, run_id: str | None = None) -> checkpoint.Checkpoint:
    values = np.arange(20, dtype=np.float32)
    return checkpoint.Checkpoint(
        model="mlp", layout=[("fc.w", (2, 9)), ("fc.b", (2,))], params=values,
        buffers=np.zeros(0, np.float32), optimizer={"momentum": values}, epoch=1,
        step_in_epoch=0, global_step=gstep, rng_states=[{}], run_id=run_id,
    )  # fmt: skip


def saved(directory: Path, gstep: int, run_id: str | None) -> Path:
    return checkpoint.save(directory, make(gstep, run_id))


def test_rotation_deletes_only_this_runs_checkpoints(tmp_path):
    other = saved(tmp_path, 1, "run-b")
    before_run_ids = saved(tmp_path, 2, None)
    mine = tmp_path / checkpoint.checkpoint_name(1, 3)
    mine.write_text("my notes\n")
    ours = [saved(tmp_path, g, "run-a") for g in (10, 20, 30, 40)]
    assert checkpoint.list_checkpoints(tmp_path) == [other, before_run_ids, mine, *ours[2:]]
    assert mine.read_text() == "my notes\n"
    assert checkpoint.load(other).run_id == "run-b"
    assert checkpoint.load(before_run_ids).run_id is None
    assert [checkpoint.load(p).run_id for p in ours[2:]] == ["run-a", "run-a"]


def test_a_checkpoint_without_a_run_id_deletes_nothing(tmp_path):
    first = saved(tmp_path, 1, None)
    for g in (2, 3, 4):
        saved(tmp_path, g, None)
    assert len(checkpoint.list_checkpoints(tmp_path)) == 4 and first.exists()


def test_a_checkpoint_dir_without_permission_says_choose_a_writable_one():
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        checkpoint.save("/sys/ck", make())
    text = str(info.value)
    assert text.startswith("cannot write checkpoint /sys/ck/ckpt-"), text
    assert text.endswith(": Operation not permitted; choose a writable --checkpoint-dir"), text
    assert "free space" not in text and "\n" not in text
    assert not Path("/sys/ck").exists()
