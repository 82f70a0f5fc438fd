import os
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from hpcdl import checkpoint


def make(model="cnn", epoch=1, step=0, gstep=10, n=1000, run_id="run-a"):
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
        run_id=run_id,
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


def spoiled(tmp_path, edit):
    """A good checkpoint file, then edit(h5py.File) applied to it."""
    path = checkpoint.save(tmp_path, make())
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: f.attrs.__delitem__("epoch"), "lacks the 'epoch' attribute"),
        (lambda f: f.attrs.__delitem__("format_version"), "lacks the 'format_version' attribute"),
        (lambda f: f.attrs.__setitem__("rng_states", "{not json"), "unreadable 'rng_states'"),
        (lambda f: f.attrs.__setitem__("rng_states", "[{}]"), "1 RNG states for a world of 2"),
        (lambda f: f.attrs.__setitem__("layout", '[["w", [-1]]]'), "unreadable 'layout'"),
        (lambda f: f.attrs.__setitem__("global_step", "ten"), "unreadable 'global_step'"),
        (lambda f: f.__delitem__("optimizer"), "lacks the 'optimizer' entry"),
        (
            lambda f: (f.__delitem__("params"), f.create_dataset("params", data=[7, 8])),
            "'params' is int64 (2,), not a vector of floats",
        ),
    ],
    ids=["epoch", "version", "rng-json", "rng-count", "layout", "step", "optimizer", "params"],
)
def test_a_damaged_checkpoint_is_one_line_naming_file_and_field(tmp_path, edit, message):
    path = spoiled(tmp_path, edit)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(path)
    text = str(info.value)
    assert text.startswith(f"checkpoint {path}") and message in text and "\n" not in text, text


def test_a_parameter_vector_of_the_wrong_length_is_refused(tmp_path):
    layout = [("fc.w", (10, 90)), ("fc.b", (10,))]  # 910 values; make() stores 1000
    path = checkpoint.save(tmp_path, make())
    with pytest.raises(checkpoint.CheckpointError, match="has 1000 parameter values, model 'cnn'"):
        checkpoint.check_compatible(checkpoint.load(path), path, "cnn", layout)
    path = checkpoint.save(tmp_path, make(n=910, gstep=11))
    checkpoint.check_compatible(checkpoint.load(path), path, "cnn", layout, buffer_values=4)
    with pytest.raises(checkpoint.CheckpointError, match="has 4 BatchNorm statistics"):
        checkpoint.check_compatible(checkpoint.load(path), path, "cnn", layout, buffer_values=6)


def test_a_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="nope.h5 does not exist"):
        checkpoint.load(tmp_path / "nope.h5")


def test_a_checkpoint_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        checkpoint.save(tmp_path / "a-file", make())
    text = str(info.value)
    assert text.startswith(f"cannot write checkpoint {tmp_path / 'a-file'}/ckpt-"), text
    assert "--checkpoint-dir" in text and "\n" not in text
