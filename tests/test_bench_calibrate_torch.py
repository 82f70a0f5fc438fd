"""`bench calibrate` with a torch model (issue 61, "Tools"): the compute figures, the trainer's
step and the checkpoint are timed through hpcdl.train's engine seam (hpcdl.engines), so a
user's nn.Module file is calibrated as hpcdl.train would train it; and the loaded window of
the contention figure runs on until the node's copies have landed."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import mpi_env, mpirun_cmd, stage_cli

from hpcdl.bench import synthetic
from hpcdl.clustermodel import calibration

REPO = Path(__file__).resolve().parents[1]
MODELS = Path(__file__).parent / "torch_models.py"
CNN = f"{MODELS}:small_cnn"


def calibrate(ranks: int, data: Path, tmp: Path, model: str) -> subprocess.CompletedProcess:
    cmd = [*mpirun_cmd(ranks), sys.executable, "-m", "hpcdl.bench", "calibrate",
           "--data", data, "--stage-dir", tmp / "stage", "--threads", 1, "--files", 4,
           "--local-mb", 1, "--steps", 5, "--batch-size", 4, "--input-shape", "3,16,16",
           "--classes", 4, "--repeats", 1, "--model", model,
           "--checkpoint-dir", tmp / "ck", "--out", tmp / "c.toml"]  # fmt: skip
    return subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=mpi_env())  # fmt: skip


def test_bench_calibrate_times_a_users_torch_module_and_the_dry_run_reads_it(tmp_path):
    torch = pytest.importorskip("torch")
    import torch_models  # noqa: PLC0415 (tests/ is on the path; it imports torch)

    data = synthetic.class_colour_folder(tmp_path / "images", 24, side=16, classes=4)
    proc = calibrate(2, data, tmp_path, CNN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compute = calibration.load(tmp_path / "c.toml").compute
    module = torch_models.small_cnn((3, 16, 16), 4)
    assert isinstance(module, torch.nn.Module)
    assert compute.model == CNN
    assert compute.gradient_bytes == 4 * sum(p.numel() for p in module.parameters())
    assert compute.v0 > 0 and compute.t >= 0 and 0 < compute.step_s(4) < 5.0, compute
    assert 0 < compute.checkpoint_s < 30, proc.stdout
    line = next(line for line in proc.stdout.splitlines() if "compute:" in line)
    assert f"compute: {CNN} step = b / " in line, line
    found = re.search(r"trainer step .*: ([\d.]+) ms", proc.stdout)
    assert found and float(found[1]) > 0, proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "images"]  # all removed
    dry = stage_cli("--dry-run", "--data", str(data), "--files-only", "--calibration",
                    str(tmp_path / "c.toml"), "--nodes", "1,2", "--batch-size", "4",
                    cwd=REPO)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "Traceback" not in dry.stderr


@pytest.mark.parametrize(
    ("model", "said"),
    [(CNN, "imports torch, which is not installed: pip install 'hpcdl[torch]'"),
     ("torchvision:resnet18", "needs torch, which is not installed: pip install 'hpcdl[torch]'")],
)  # fmt: skip
def test_bench_calibrate_with_a_torch_model_and_no_torch_says_what_to_install(
    tmp_path, model, said
):
    """torch hidden from the process (as if not installed): hpcdl.train's one line, exit 2."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f.bin").write_bytes(b"x" * 1000)
    argv = ["--data", str(tmp_path / "data"), "--stage-dir", str(tmp_path), "--model", model,
            "--input-shape", "1,8,8"]  # fmt: skip
    code = ("import sys; sys.modules['torch'] = None; from hpcdl.bench.calibrate import main; "
            f"sys.exit(main({argv!r}))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "--model " in done.stderr and model in done.stderr and said in done.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "data"]  # nothing written


class LandsLate:
    """A load beside the timed steps whose `files` all land `after` seconds after it starts (as
    a stager's copies that take longer than one window of --steps), or never (after=None)."""

    def __init__(self, files: int, after: float | None) -> None:
        self.files, self.after = files, after
        self.started = self.at_stop = 0.0
        self.failed = ""

    def staged(self) -> int:
        landed = self.after is not None and time.monotonic() - self.started >= self.after
        return self.files if landed else 0

    def start(self) -> None:
        self.started = time.monotonic()

    def pending(self) -> bool:
        return self.staged() < self.files

    def stop(self) -> None:
        self.at_stop = self.staged()

    def landed(self) -> int:
        return self.at_stop

    def close(self) -> None:
        pass


def trainer_step_beside(load: LandsLate, steps: int = 5) -> tuple[float | None, str]:
    """bench calibrate's trainer step (mlp, one rank) with `load` beside its loaded window:
    calibrate_contention's figure for it, as `copies`."""
    from mpi4py import MPI  # noqa: PLC0415

    from hpcdl.bench.calibrate import measure_trainer_step  # noqa: PLC0415
    from hpcdl.bench.calibrate_contention import _timed_copies  # noqa: PLC0415
    from hpcdl.comm.world import build_world  # noqa: PLC0415

    world = build_world(MPI.COMM_SELF)
    args = SimpleNamespace(model="mlp", shape=(1, 8, 8), classes=4, batch_size=4, bucket_mb=25.0,
                           steps=steps)  # fmt: skip
    figures = []

    def contention(quiet_s: float, timed) -> tuple:
        figures.append(_timed_copies(world, quiet_s, timed, load, "copies"))
        return (0.0, "", None, "")

    measure_trainer_step(args, world, None, contention)
    return figures[0]


def test_the_loaded_window_runs_on_until_the_copies_have_landed():
    """The copies land 1 s after the timed steps begin, long after a window of 5 steps of a
    tiny mlp: the steps go on, window after window, until they have, and the figure covers
    them (it said "not measured: none of the copies landed during the timed steps")."""
    figure, note = trainer_step_beside(LandsLate(40, after=1.0))
    assert figure is not None, note
    found = re.search(r"while 40 copies per node landed in ([\d.]+) s", note)
    assert found and float(found[1]) >= 1.0, note


def test_a_load_that_never_lands_is_not_measured_after_the_cap(monkeypatch):
    from hpcdl.bench import calibrate_contention  # noqa: PLC0415

    monkeypatch.setattr(calibrate_contention, "LOAD_CAP_S", 0.5)
    began = time.monotonic()
    figure, note = trainer_step_beside(LandsLate(40, after=None))
    assert figure is None
    assert note == "not measured: the copies had not all landed after 0.5 s of steps", note
    assert time.monotonic() - began < 30


def test_every_copy_of_the_load_is_counted_even_those_before_the_first_step(tmp_path):
    """A real hpcdl-stage copying 64 small files beside the steps: the figure is over all 64.
    A fast copier published some, or all, while calibrate still waited for its status map,
    before the timed steps began; those were left out, and all of them gave "not measured:
    none of the copies landed" (as a 2-rank calibrate of the cnn printed)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(64):
        (data / f"f{i:02d}").write_bytes(b"x" * 100)
    cmd = [sys.executable, "-m", "hpcdl.bench", "calibrate", "--data", data, "--stage-dir",
           tmp_path / "stage", "--threads", 2, "--files", 4, "--local-mb", 1, "--steps", 3,
           "--batch-size", 4, "--input-shape", "1,8,8", "--classes", 4, "--repeats", 1]  # fmt: skip
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=300,
                          cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if "per file a node copies" in line)
    assert "while 64 copies per node landed" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
