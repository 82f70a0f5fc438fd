"""A run without mpirun (an MPI singleton) leaves no shared-memory segment behind.

Open MPI 5 gives a singleton a 16 MiB btl/sm backing file (`sm_segment.<host>.<uid>.<job>.<rank>`)
that only a launcher's clean-up removes; every `python -m hpcdl.train` without mpirun left one in
/dev/shm. The tests point the backing directory at a directory of their own, so that other
processes' segments do not count.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py")

_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def _singleton_env(backing) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.pop("OMPI_MCA_btl", None)
    env["OMPI_MCA_btl_sm_backing_directory"] = str(backing)
    return env


def _run(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_singleton_world_leaves_no_shared_memory_segment(tmp_path):
    backing = tmp_path / "shm"
    backing.mkdir()
    out = _run(
        "import os\n"
        "from hpcdl.comm.world import init_world\n"
        "w = init_world(); w.comm.Barrier(); w.node_comm.Barrier()\n"
        "print(w.size, os.environ.get('OMPI_MCA_btl'))\n",
        _singleton_env(backing),
    )
    assert out.split() == ["1", "None"]  # a world of one; the process's environment as it was
    assert sorted(p.name for p in backing.iterdir()) == []


def test_a_singleton_keeps_the_users_own_btl_choice(tmp_path):
    backing = tmp_path / "shm"
    backing.mkdir()
    env = _singleton_env(backing)
    env["OMPI_MCA_btl"] = "self,sm"  # the user asked for sm: hpcdl does not overrule it
    out = _run(
        "import os\n"
        "from hpcdl.comm.world import init_world\n"
        "w = init_world(); w.comm.Barrier()\n"
        "print(os.environ.get('OMPI_MCA_btl'))\n",
        env,
    )
    assert out.split() == ["self,sm"]
    assert [p.name.split(".")[0] for p in backing.iterdir()] == ["sm_segment"]
