"""`python -m hpcdl.bench calibrate ARGS` with rank 0's flight-recorder events of its first quiet
trainer-step window written to $HPCDL_STEP_EVENTS (JSON: kind, t0, t1, step, arg per event).
Started by step_timeline.py under mpirun; not part of hpcdl."""

import json
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[3])]  # the repository root

import hpcdl.bench.calibrate as calibrate  # noqa: E402
import hpcdl.bench.calibrate_step as calibrate_step  # noqa: E402  (the steps' timing)
from hpcdl.diag.events import RECORDER  # noqa: E402

timed_steps = calibrate_step._timed_steps
windows = [0]


def first_window_recorded(*args, **kwargs):
    RECORDER.resize(1 << 16)
    out = timed_steps(*args, **kwargs)
    windows[0] += 1
    from mpi4py import MPI

    if windows[0] == 1 and MPI.COMM_WORLD.Get_rank() == 0:
        events = [[float(v) for v in e] for e in RECORDER.last(1 << 16)]
        Path(os.environ["HPCDL_STEP_EVENTS"]).write_text(json.dumps(events))
    return out


calibrate_step._timed_steps = first_window_recorded
sys.exit(calibrate.main(sys.argv[1:]))
