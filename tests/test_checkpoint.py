import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hpcdl import checkpoint


def make(model="cnn", epoch=1, step=0, gstep=10, n=1000):
    rng = np.random.default_rng(gstep)
    return checkpoint.Checkpoint(
        model=model,
        layout=[("fc.w", (10, 90)), ("fc.b", (10,))],
        params=rng.standard_normal(n).astype(np.float32),
        buffers=rng.standard_normal(4).astype(np.float32),
        optimizer={"momentum": rng.standard_normal(n).astype(np.float32)},
        epoch=epoch,
        step_in_epoch=step,
        global_step=gstep,
        rng_states=[{"state": 1}, {"state": 2}],
        config={"lr": 0.1},
        world_size=2,
    )


def test_round_trip_is_bitwise(tmp_path):
    ck = make()
    path = checkpoint.save(tmp_path, ck)
    back = checkpoint.load(path)
    assert back.params.tobytes() == ck.params.tobytes()
    assert back.buffers.tobytes() == ck.buffers.tobytes()
    assert back.optimizer["momentum"].tobytes() == ck.optimizer["momentum"].tobytes()
    assert (back.epoch, back.step_in_epoch, back.global_step) == (1, 0, 10)
    assert back.rng_states == ck.rng_states and back.layout == ck.layout
    assert checkpoint.latest(tmp_path) == path


def test_keeps_newest_two_and_orders_by_step(tmp_path):
    for g in (5, 50, 500):
        checkpoint.save(tmp_path, make(gstep=g))
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path)]
    assert names == [checkpoint.checkpoint_name(1, 50), checkpoint.checkpoint_name(1, 500)]


def test_other_models_checkpoint_names_both(tmp_path):
    path = checkpoint.save(tmp_path, make(model="cnn"))
    with pytest.raises(checkpoint.CheckpointError, match="holds model 'cnn'.*builds model 'mlp'"):
        checkpoint.check_compatible(checkpoint.load(path), path, "mlp", make().layout)
    # Another model, with the same or another layout: one line naming both models (the
    # model check comes before the layout checks, whose messages name only one model).
    for here, layout in [("mlp", make().layout), ("resnet20", [("conv.w", (16, 1, 3, 3))])]:
        with pytest.raises(checkpoint.CheckpointError) as info:
            checkpoint.check_compatible(checkpoint.load(path), path, here, layout)
        message = str(info.value)
        assert "\n" not in message
        assert "'cnn'" in message and f"'{here}'" in message and str(path) in message
    with pytest.raises(checkpoint.CheckpointError, match="fc.w has shape"):
        checkpoint.check_compatible(
            checkpoint.load(path), path, "cnn", [("fc.w", (10, 64)), ("fc.b", (10,))]
        )


def test_not_a_checkpoint(tmp_path):
    bogus = tmp_path / "ckpt-e00001-s000000001.h5"
    bogus.write_text("not hdf5")
    with pytest.raises(checkpoint.CheckpointError, match="cannot be opened as HDF5"):
        checkpoint.load(bogus)


def test_writer_killed_mid_write_leaves_previous_checkpoint(tmp_path):
    good = checkpoint.save(tmp_path, make(gstep=1))
    before = good.read_bytes()
    # A second writer that stalls inside h5py's write, then is SIGKILLed.
    script = textwrap.dedent(
        f"""
        import sys, time, h5py, numpy as np
        sys.path.insert(0, {str(os.getcwd())!r})
        from hpcdl import checkpoint
        orig = h5py.Group.create_dataset
        def slow(self, *a, **k):
            r = orig(self, *a, **k)
            print("writing", flush=True)
            time.sleep(60)
            return r
        h5py.Group.create_dataset = slow
        from tests.test_checkpoint import make
        checkpoint.save({str(tmp_path)!r}, make(gstep=2, n=2_000_000))
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=os.getcwd(), text=True
    )
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert checkpoint.latest(tmp_path) == good
    assert good.read_bytes() == before
    assert checkpoint.load(good).global_step == 1
