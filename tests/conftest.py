"""Shared fixtures and hooks only (what tests import lives in helpers.py). MPI tests are marked
`mpi` and run under `mpirun -np 2 pytest --with-mpi`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcdl.backend import cupy_or_none, gpu_available


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist, never called
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N --dist loadscope` (scripts/test.sh), scoped by helpers.xdist_scope: each
    test module runs whole on one worker, so its module fixtures are made once, and the modules
    that start Slurm or emulated nodes run on one worker, one test after another. (xdist's own
    loadgroup marks do not group under pytest 9, whose nodes keep their id elsewhere.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from helpers import xdist_scope
    from xdist.scheduler import LoadScopeScheduling

    class ByTestGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return ByTestGroup(config, log)


@pytest.fixture(autouse=True)
def no_stale_open_mpi_session_dirs() -> None:
    """Before every test: the session dirs of Open MPI launchers and remote daemons that a
    test killed are removed, so that no later mpirun or daemon that draws the same pid fails to
    start (helpers.remove_stale_session_dirs; test_openmpi_leftovers.py)."""
    import tempfile

    from helpers import remove_stale_session_dirs

    remove_stale_session_dirs(Path(tempfile.gettempdir()))


@pytest.fixture(autouse=True)
def stop_signals_released():
    """After every test: the stop signals handled as in a fresh process. hpcdl.train catches
    them until its process exits (NOTE [stop signals]); a run inside this pytest process must not
    leave them caught for the tests after it (hpcdl.torch.Loader installs its SIGTERM handler
    only where nobody handles SIGTERM: test_config.py calling hpcdl.train.main(["--help"]) made
    test_torch_loader_handlers fail in the full run)."""
    yield
    from hpcdl import stop_signals

    stop_signals.release()


@pytest.fixture(scope="session", autouse=True)
def index_cache(tmp_path_factory) -> Path:
    """The image-folder index cache of this test session ($XDG_CACHE_HOME, inherited by the
    runs the tests start), not the user's ~/.cache."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    return cache / "hpcdl"


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> Path:
    """scikit-learn's digits converted to HDF5 shards (train/ and val/) once per session."""
    import subprocess

    out = tmp_path_factory.mktemp("digits")
    subprocess.run(
        [sys.executable, "-m", "hpcdl.data", "convert", "digits", str(out), "--shard-size", "400"],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(
    params=[
        pytest.param(np, id="numpy"),
        pytest.param(
            "cupy",
            id="cupy",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU"),
            ],
        ),
    ]
)
def xp(request):
    """The array module a layer/model test runs on: numpy always, cupy when a GPU exists."""
    return cupy_or_none() if request.param == "cupy" else request.param


@pytest.fixture
def cluster(tmp_path):
    """Two emulated nodes (tools.bench.cluster); skips, with the reason, where none can be made.
    Everything it made is gone afterwards."""
    from tools.bench.cluster import Cluster, leftovers, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with Cluster(tmp_path / "cluster", nodes=2) as c:
        yield c
    assert not leftovers(), leftovers()


@pytest.fixture(scope="module")
def world():
    """This MPI job's World (tests marked mpi, run under mpirun with --with-mpi)."""
    from hpcdl.comm.world import init_world  # noqa: PLC0415 (MPI starts only for the tests using it)

    return init_world()


@pytest.fixture(scope="module")
def shared_digits(world, tmp_path_factory):
    """Digits as HDF5 shards in ONE directory that every rank sees (the run config must agree)."""
    import subprocess  # noqa: PLC0415

    path, error = None, None
    if world.rank == 0:
        out = tmp_path_factory.mktemp("digits_shared")
        proc = subprocess.run(
            [sys.executable, "-m", "hpcdl.data", "convert", "digits", str(out)],
            capture_output=True,
            text=True,
        )
        path, error = str(out), (proc.stderr if proc.returncode else None)
    path, error = world.comm.bcast((path, error), root=0)
    assert error is None, error
    return Path(path)


@pytest.fixture(scope="session")
def slurm():
    """A private single-host Slurm for the `slurm`-marked tests, once per session
    (tests/slurm_cluster.py); torn down even when tests fail."""
    from slurm_cluster import INSTALL_HINT, SlurmCluster, SlurmError, missing_binaries

    if os.environ.get("HPCDL_NO_SLURM") == "1":
        pytest.skip("HPCDL_NO_SLURM=1: Slurm tests skipped on request")
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm tests need {', '.join(missing)}: {INSTALL_HINT}", pytrace=False)
    if os.geteuid() != 0:
        pytest.fail(
            "Slurm tests start slurmd, which must run as root to launch jobs; run them as "
            "root or set HPCDL_NO_SLURM=1",
            pytrace=False,
        )
    cluster = SlurmCluster()
    try:
        cluster.start()
    except SlurmError as exc:
        pytest.fail(f"could not start the test Slurm: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
