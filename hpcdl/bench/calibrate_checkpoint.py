"""`bench calibrate --checkpoint-dir`: the seconds of one checkpoint as hpcdl.train writes it.

hpcdl.train's rank 0 writes a checkpoint at every epoch's end (and every --checkpoint-every
steps) while the other ranks wait for it at the next collective, so each one adds its time to
the epoch (the cluster model's checkpoints_per_epoch). It is measured, not derived from a disk
figure: the checkpoint directory is wherever the user keeps them (the PFS, a home directory),
and an HDF5 file written, flushed, fsync'ed and renamed (hpcdl.checkpoint.save) costs more than
its bytes.

World rank 0 takes the engine bench calibrate steps (hpcdl.train's, for --model: hpcdl's own
or the torch engine, hpcdl.bench.calibrate_step), one step further so that the optimizer's state
is there, and saves its checkpoint as hpcdl.resume.save does (the engine's flat parameters,
buffers and optimizer state: either engine's, hpcdl.engine.Checkpointable) with
hpcdl.checkpoint.save into a temporary directory inside --checkpoint-dir, REPEATS times; the
median counts. The temporary directory goes afterwards, and a --checkpoint-dir that did not
exist is made and removed again (hpcdl.bench.stage_scratch): nothing else there is touched.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from hpcdl.bench.stage_scratch import scratch_dir

REPEATS = 3


def measure_checkpoint(engine: Any, batch: tuple, directory: Path) -> tuple[float, str]:
    """(seconds of one checkpoint of engine after a step on batch, the median of REPEATS; a
    note with its size and each time)."""
    from hpcdl import checkpoint  # noqa: PLC0415
    from hpcdl.backend import to_host  # noqa: PLC0415
    from hpcdl.resume import shapes  # noqa: PLC0415

    engine.step(*batch, 0.01, False, None, True)  # the optimizer's state exists after a step
    net = engine.model
    times, size = [], 0
    with scratch_dir(directory, ".hpcdl-calibrate-checkpoint.") as where:
        for k in range(REPEATS):
            ckpt = checkpoint.Checkpoint(
                model=net.name, layout=shapes(net), params=to_host(net.params).copy(),
                buffers=to_host(net.buffers).copy(),
                optimizer={key: to_host(v) for key, v in engine.optimizer.state_dict().items()},
                epoch=k + 1, step_in_epoch=0, global_step=k + 1,
                rng_states=[net.get_rng_state()], config={}, world_size=1, run_id="calibrate",
            )  # fmt: skip
            began = time.perf_counter()
            path = checkpoint.save(where, ckpt)
            times.append(time.perf_counter() - began)
            size = path.stat().st_size
    seconds = statistics.median(times)
    note = (f"{size / 1e6:.1f} MB in {directory}: "
            + ", ".join(f"{t * 1e3:.0f}" for t in times) + " ms")  # fmt: skip
    return seconds, note
