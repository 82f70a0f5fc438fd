"""What the stager says and what it leaves (issue 29): its last line at a normal end, its start
line's capacity, and the modes of every file and directory staging creates, whatever the umask.
Its niceness (issue 35): --stage-nice N from the start; by default (auto) +10 once the ranks pass
the first epoch."""

from __future__ import annotations

import os
import signal
import stat
import subprocess

import pytest
from helpers import (
    make_tree,
    niceness,
    stager_ran_on,
    start_session,
    wait_for_status,
    wait_ready,
    wait_until,
    write_peer_plan,
)

from hpcdl.staging import StageOptions
from hpcdl.staging.binary import find_stager_binary
from hpcdl.staging.status import StatusView


def stager_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("hpcdl-stage on ")]


def test_a_normal_end_says_the_job_ended_not_sigterm(tmp_path, capfd):
    ds = make_tree(tmp_path / "pfs", 12, 100)
    session = start_session(ds, tmp_path / "stage", threads=2)
    wait_ready(session, 12)
    session.close()
    last = stager_lines(capfd.readouterr().err)[-1]
    assert "SIGTERM" not in last, last
    assert "finished (the job ended)" in last, last


def test_a_real_sigterm_is_still_named(tmp_path, capfd):
    ds = make_tree(tmp_path / "pfs", 12, 100)
    session = start_session(ds, tmp_path / "stage", threads=2)
    wait_ready(session, 12)
    os.kill(session.stager.proc.pid, signal.SIGTERM)
    session.stager.proc.wait(10)
    session.close()
    assert "stopped on SIGTERM" in stager_lines(capfd.readouterr().err)[-1]


def test_the_start_line_gives_the_capacity_in_binary_units(tmp_path, capfd):
    ds = make_tree(tmp_path / "pfs", 12, 100)
    session = start_session(ds, tmp_path / "stage", threads=2, capacity=int(65.1 * 2**30))
    wait_ready(session, 12)
    session.close()
    first = stager_lines(capfd.readouterr().err)[0]
    assert "capacity 65.1 GiB" in first, first
    assert str(int(65.1 * 2**30)) not in first, first


def test_every_file_staging_creates_has_an_explicit_mode_under_umask_0(tmp_path):
    ds = make_tree(tmp_path / "pfs", 12, 100)
    stage = tmp_path / "stage"
    old = os.umask(0)
    try:
        session = start_session(ds, stage, threads=2, keep=True)
        wait_ready(session, 12)
        found = modes_below(stage)  # while the job runs: plan, progress, counters, owner...
        session.close()
    finally:
        os.umask(old)
    found.update(modes_below(stage))  # what --keep-staged leaves
    names = {os.path.basename(p) for p in found}
    assert {"plan", "status", "progress", "counters", "owner", "manifest", "lock"} <= names
    assert sum(p.endswith(".bin") for p in found) == 12  # the staged copies
    loose = {p: oct(m) for p, m in found.items() if m & 0o077}
    assert not loose, loose


def modes_below(root) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            out[path] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


@pytest.mark.parametrize("nice", ["10", "3"])
def test_the_stager_runs_below_the_ranks_and_says_so(tmp_path, capfd, nice):
    """--stage-nice N (StageOptions.nice, as hpcdl.train passes it): every thread of the stager
    (copy threads included) at the niceness it started with plus N, from the start; a core
    goes to a rank before a copy that is ahead of need."""
    ds = make_tree(tmp_path / "pfs", 12, 100)
    session = start_session(ds, tmp_path / "stage", threads=2, nice=nice)
    wait_ready(session, 12)
    threads = niceness(session.stager.proc.pid)
    session.close()
    assert threads == {min(19, os.getpriority(os.PRIO_PROCESS, 0) + int(nice))}, threads
    first = stager_lines(capfd.readouterr().err)[0]
    assert f"at nice +{nice}" in first and "after epoch" not in first, first


def test_by_default_the_stager_goes_below_the_ranks_once_they_pass_the_first_epoch(tmp_path, capfd):
    """--stage-nice auto, the default: the ranks' priority while they wait for epoch 1's
    copies from the PFS (at +10 from the start, epoch 1 staged later than the cluster model
    says), then every thread at +10 once the slowest rank has passed that epoch: from then on
    the stager works an epoch ahead (docs/staging.md, "Below the ranks")."""
    assert StageOptions("x").nice == "auto"
    base = os.getpriority(os.PRIO_PROCESS, 0)
    ds = make_tree(tmp_path / "pfs", 12, 100)
    session = start_session(ds, tmp_path / "stage", threads=2)  # 2 epochs of 3 steps
    wait_ready(session, 12)
    session.consumed(0, 2)
    stager_ran_on(session.status, 0.2)  # it read the ranks' progress since (every 0.2 s)
    during = niceness(session.stager.proc.pid)
    session.consumed(0, 3)  # the end of epoch 1
    pid, below = session.stager.proc.pid, {min(19, base + 10)}
    wait_until(lambda: niceness(pid) == below, 10, f"every thread at {below} ({niceness(pid)})")
    session.close()
    lines = stager_lines(capfd.readouterr().err)
    assert during == {base}, during
    assert "nice +10 after epoch 1" in lines[0], lines
    assert len(lines) == 2, lines  # announced at the start, done without another line


def test_stage_nice_0_keeps_the_priority_it_started_with_after_epoch_1(tmp_path, capfd):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    ds = make_tree(tmp_path / "pfs", 12, 100)
    session = start_session(ds, tmp_path / "stage", threads=2, nice="0")
    wait_ready(session, 12)
    session.consumed(1, 1)
    stager_ran_on(session.status, 0.2)  # it read the ranks' progress since (every 0.2 s)
    threads = niceness(session.stager.proc.pid)
    session.close()
    assert threads == {base}, threads
    assert "nice +" not in stager_lines(capfd.readouterr().err)[0]


def test_a_plain_hpcdl_stage_keeps_the_priority_it_was_started_with(tmp_path):
    """Without --nice or --nice-later the binary changes no thread's priority."""
    ds = make_tree(tmp_path / "pfs", 12, 100)
    stage = tmp_path / "stage"
    write_peer_plan(ds, stage, "job", 0, None)
    cmd = [str(find_stager_binary()), "--stage-dir", str(stage), "--session", "job"]
    with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as p:
        StatusView(wait_for_status(stage, p)).close()
        threads = niceness(p.pid)
        p.terminate()
        _, err = p.communicate(timeout=20)
    assert threads == {os.getpriority(os.PRIO_PROCESS, 0)}, threads
    assert "nice +" not in stager_lines(err)[0], err
