"""scripts/gpu-check.sh's CPU dry run (GPU_CHECK_DEVICE=cpu), as CI runs it: every phase of the
prepared device call runs here on small sizes, so that a phase that would fail on a lent GPU for
a reason visible on CPU fails here first (issue 60 item 7). A few minutes on two cores."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_cpu_dry_run_runs_every_phase_and_judges_no_goal(tmp_path):
    out = tmp_path / "gpu-check"
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu"}
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
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
    rows = [json.loads(x) for x in (out / "input.jsonl").read_text().splitlines()]
    kinds = {(r["loader"], r["decode"], r["workers"]) for r in rows}
    assert {("none", "-", None), ("dataloader", "cpu", 2), ("hpcdl", "cpu", 2),
            ("hpcdl", "gpu", 2), ("hpcdl.train", "gpu", 2)} <= kinds  # fmt: skip
    trained = {r["model"] for r in rows if r["loader"] == "hpcdl.train"}
    assert len(trained) == 2 and any(m.startswith("hpcdl ") for m in trained)  # and a torch model
    with tarfile.open(out / "raw.tar.gz") as raw:
        names = raw.getnames()
        phases = raw.extractfile("raw/phases.txt").read().decode()
    assert "train-tv-decode-resnet50-cpu 0 " in phases  # --decode gpu with a torch model
    assert "compute-gk-tf32-cnn-fp32 0 " in phases  # --tf32 in both frameworks
    computed = [json.loads(x) for x in (out / "compute.jsonl").read_text().splitlines()]
    assert sorted(r["tf32"] for r in computed) == [False] * (len(computed) - 1) + [True]
    assert "  gk-tf32-cnn-fp32 " in summary
    assert {"raw/phases.txt", "raw/input.log", "raw/compute-cnn-fp32.log"} <= set(names)
    assert (out / "input.log").exists() and (out / "compute.jsonl").read_text()


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
