"""Below MPI_THREAD_MULTIPLE the trainer says so once and reduces on the calling thread.

The level is forced the way a user's MPI would grant it: MPI4PY_RC_THREAD_LEVEL=serialized makes
mpi4py ask for (and get) MPI_THREAD_SERIALIZED.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import mpi_env, mpirun_cmd, run_train

NOTICE = "not MPI_THREAD_MULTIPLE"

SCRIPT = textwrap.dedent(
    """
    import threading
    import numpy as np
    from mpi4py import MPI
    from hpcdl.comm.reducer import GradientReducer
    from hpcdl.comm.world import init_world

    world = init_world()
    n = 200_003
    grads = np.random.default_rng(world.rank).standard_normal(n).astype(np.float32)
    expected = np.empty_like(grads)
    world.comm.Allreduce(grads, expected, op=MPI.SUM)
    expected /= world.size
    reducer = GradientReducer(world.comm, grads, bucket_mb=0.05)
    assert not reducer.threaded, "a helper thread would call MPI without THREAD_MULTIPLE"
    assert not any(t.name == "hpcdl-allreduce" for t in threading.enumerate())
    reducer.begin_step()
    for ready in (1000, 50_000, n):
        reducer.mark_ready(ready)
    reducer.wait()
    np.testing.assert_allclose(grads, expected, rtol=1e-6, atol=1e-7)
    reducer.close()
    print(f"rank {world.rank}: reduced on the calling thread", flush=True)
    """
)


def forced_env(level: str) -> dict[str, str]:
    env = mpi_env()
    env["MPI4PY_RC_THREAD_LEVEL"] = level
    return env


def test_serialized_mpi_reduces_on_the_calling_thread_and_says_so_once(tmp_path):
    script = tmp_path / "reduce.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [*mpirun_cmd(2), sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=forced_env("serialized"),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("reduced on the calling thread") == 2
    assert proc.stderr.count(NOTICE) == 1, proc.stderr
    assert "MPI_THREAD_SERIALIZED" in proc.stderr


def test_training_with_serialized_mpi_completes_with_one_notice(digits_dir):
    common = ["--data", digits_dir / "train", "--model", "mlp", "--epochs", 1]
    proc = run_train(
        2, *common, "--batch-size", 32, "--workers", 0, "--quiet", env=forced_env("serialized")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(NOTICE) == 1, proc.stderr
    assert "final train loss" in proc.stdout


def test_thread_multiple_is_requested_and_granted_by_default(tmp_path):
    script = tmp_path / "level.py"
    script.write_text(
        "from hpcdl.comm.reducer import GradientReducer\n"
        "from hpcdl.comm.world import init_world\n"
        "import numpy as np\n"
        "w = init_world()\n"
        "r = GradientReducer(w.comm, np.zeros(10, np.float32))\n"
        "print('threaded', r.threaded, flush=True)\n"
        "r.close()\n"
    )
    env = mpi_env()
    env.pop("MPI4PY_RC_THREAD_LEVEL", None)
    proc = subprocess.run(
        [*mpirun_cmd(2), sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("threaded True") == 2 and NOTICE not in proc.stderr
