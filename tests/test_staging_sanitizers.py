"""Build hpcdl-stage with ASan/UBSan and with TSan; run its unit tests, a real staging run and
the peer tier under each (any report fails the test), and fuzzed plans under ASan/UBSan."""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import peer_stagers as peers
import pytest
from helpers import make_tree, start_session, wait_until

from hpcdl.staging.status import StatusView

REPO = Path(__file__).resolve().parents[1]


SANITIZER_ENV = dict(
    ASAN_OPTIONS="detect_leaks=1:abort_on_error=1",
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
)
# A report ends the process with exit code 66 at once (TSan's default code, made explicit).
TSAN_ENV = dict(TSAN_OPTIONS="halt_on_error=1:exitcode=66:second_deadlock_stack=1")
FUZZ_PLANS = 3000
FUZZ_RUNS = 40


@dataclass(frozen=True)
class Sanitized:
    """A sanitized build of hpcdl-stage and its unit tests, and the environment it runs in."""

    name: str
    build: Path
    env: dict[str, str]


# name -> (CMake option, build type, environment). TSan at -O2 (RelWithDebInfo): it slows the
# stager several times over, and the races it looks for do not need -O0.
SANITIZERS = {
    "asan": ("-DHPCDL_SANITIZE=ON", "Debug", SANITIZER_ENV),
    "tsan": ("-DHPCDL_TSAN=ON", "RelWithDebInfo", TSAN_ENV),
}


def build_sanitized(name: str, where: Path) -> Sanitized:
    """hpcdl-stage and its unit tests built under `where` with sanitizer `name` (SANITIZERS),
    through CMakeLists.txt's option for it; a compiler warning fails the build too."""
    if shutil.which("cmake") is None:
        pytest.skip("needs cmake and a C++17 compiler")
    option, build_type, env = SANITIZERS[name]
    build = where / "build"
    cfg = ["cmake", "-S", REPO, "-B", build, option, "-DHPCDL_STAGE_TESTS=ON",
           f"-DCMAKE_BUILD_TYPE={build_type}"]  # fmt: skip
    subprocess.run(cfg, check=True, capture_output=True, timeout=120)
    made = subprocess.run(
        ["cmake", "--build", build, "-j2"], capture_output=True, text=True, timeout=300
    )
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    assert "warning" not in made.stdout + made.stderr
    return Sanitized(name, build, env)


@pytest.fixture(scope="module")
def sanitized_build(tmp_path_factory) -> Path:
    """hpcdl-stage and its unit tests built once with ASan + UBSan."""
    return build_sanitized("asan", tmp_path_factory.mktemp("asan")).build


@pytest.fixture(scope="module", params=sorted(SANITIZERS))
def sanitized(request, tmp_path_factory) -> Sanitized:
    """Each sanitized build in turn: ASan + UBSan (the fuzz test's), then TSan."""
    if request.param == "asan":
        return Sanitized("asan", request.getfixturevalue("sanitized_build"), SANITIZER_ENV)
    return build_sanitized(request.param, tmp_path_factory.mktemp(request.param))


def test_sanitizer_build_runs_clean(sanitized, tmp_path, monkeypatch):
    """The unit tests (kept peer connections, the copy threads among them), then a staging run
    that evicts and copies while the trainer's progress moves, exit clean under the sanitizer."""
    build = sanitized.build
    env = dict(os.environ, **sanitized.env)
    unit = subprocess.run(
        [build / "hpcdl-stage-tests", tmp_path / "scratch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "Sanitizer" not in unit.stderr, unit.stderr[-3000:]

    ds = make_tree(tmp_path / "pfs", 40, 2000)
    monkeypatch.setenv("HPCDL_STAGE_BIN", str(build / "hpcdl-stage"))
    for name, value in sanitized.env.items():
        monkeypatch.setenv(name, value)
    session = start_session(ds, tmp_path / "stage", epochs=(0, 3), capacity=30_000, verify=True)
    status = StatusView(session.meta / "status")
    # 14 files of about 2,003 bytes fit in 30,000: staged before the trainer moves, so that files
    # lie behind the cursor when it jumps (a stager that starts after the jump, as one under TSan
    # beside busy cores did, stages what lies ahead and has nothing to evict)
    wait_until(lambda: status.field("files_staged") >= 14, timeout=120, what="capacity filled")
    for epoch in range(3):
        for step in range(10):
            session.consumed(epoch, step + 1)
            if (epoch, step) == (1, 5):  # files behind the cursor are done: evict, copy more
                wait_until(lambda: status.field("evictions") > 0
                           and status.field("files_staged") > 14, timeout=60,
                           what="evictions and copies past the capacity")  # fmt: skip
    staged = status.field("files_staged")
    proc = session.stager.proc
    session.close()
    assert proc.returncode == 0, "sanitized stager did not exit cleanly"
    assert staged > 14  # more than fits at once: files were evicted and others copied


def test_the_sanitized_peer_tier_serves_fetches_and_refuses_clean(sanitized, tmp_path, monkeypatch):
    """Two sanitized stagers: a home serving, a fetcher taking every file from it while a
    stranger trickles a handshake and a fetcher with another secret is refused (issue 51's
    handshake, MACs and deadlines under ASan + UBSan; the server, copy and coordinator threads
    of both under TSan)."""
    monkeypatch.setenv("HPCDL_STAGE_BIN", str(sanitized.build / "hpcdl-stage"))
    for name, value in sanitized.env.items():
        monkeypatch.setenv(name, value)
    with peers.serving_home(tmp_path) as (ds, address, secret, home):
        host, port = address.split(":")
        with socket.create_connection((host, int(port))) as stranger:
            stranger.sendall(b"HPCDLPH2")  # and never the rest
            view, err = peers.fetch(ds, tmp_path, address, secret)
            assert view.field("peer_files") == peers.FILES and view.field("pfs_opens") == 0, err
            other = tmp_path / "other"
            peers.write_plan(ds, other, 1, address)
            refused = peers.start(other, secrets.token_hex(32), None, "--once")
            _, refused_err = refused.communicate(timeout=120)
        home.send_signal(signal.SIGUSR1)
        _, home_err = home.communicate(timeout=60)
    peers.assert_copies_are_the_sources(ds, tmp_path / "b")
    assert refused.returncode == 0 and peers.status(other).field("peer_files") == 0, refused_err
    assert home.returncode == 0, home_err
    for text in (err, refused_err, home_err):
        assert "Sanitizer" not in text and "runtime error" not in text, text[-3000:]


def _valid_plan(src: Path, files: int) -> bytes:
    """Every file whole, and two pieces of file 0 (slots files, files + 1: docs/staging.md)."""
    size0 = (src / "f0").stat().st_size
    head = ["hpcdl-plan 1", "fingerprint 00000000000000aa", "seed 0", "epochs 0 2"]
    head += ["steps_per_epoch 4", "local_ranks 2", f"dataset_files {files + 2}"]
    head.append(f"entries {files + 2}")
    rows = [
        f"{i}\t{(src / f'f{i}').stat().st_size}\t{i % 4},{4 + i % 4}\tk/d{i % 2}/f{i}\t{src}/f{i}"
        for i in range(files)
    ]
    rows += [f"{files + k}\t40\t{k + 1}\tk/d0/f0.pieces/{30 * k}\t{src}/f0" for k in range(2)]
    peers = ["peers 1", "0\t127.0.0.1:9", "peer_sources 2", "0\t0\t1", "3\t0\t0"]  # unused
    pieces = ["pieces 2", f"{files}\t0\t{size0}\t0", f"{files + 1}\t0\t{size0}\t30"]
    return "\n".join(head + rows + peers + pieces + ["end", ""]).encode()


def _mutate(plan: bytes, rng: random.Random) -> bytes:
    """One of: random bytes, a cut, a flipped byte, a huge or negative number, a swapped line."""
    lines = plan.split(b"\n")
    kind = rng.randrange(6)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
    if kind == 1:
        return plan[: rng.randrange(len(plan))]
    if kind == 2:
        pos = rng.randrange(len(plan))
        return plan[:pos] + bytes([rng.randrange(256)]) + plan[pos + 1 :]
    if kind == 3:
        numbers = [
            b"18446744073709551615",
            b"18446744073709551616",
            b"-1",
            b"4294967296",
            b"9223372036854775807",
            b"0",
            b"99999999999999999999999",
        ]
        i = rng.randrange(len(lines))
        words = re.split(rb"([ \t,])", lines[i])
        digits = [k for k, w in enumerate(words) if w.isdigit()]
        if digits:
            words[rng.choice(digits)] = rng.choice(numbers)
        lines[i] = b"".join(words)
    elif kind == 4:
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    else:
        lines.insert(rng.randrange(len(lines)), lines[rng.randrange(len(lines))])
    return b"\n".join(lines)


def _no_sanitizer_report(proc: subprocess.CompletedProcess) -> None:
    text = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1, 2), text[-3000:]  # a sanitizer abort is a signal
    assert "Sanitizer" not in text and "runtime error" not in text, text[-3000:]


def test_fuzzed_plans_never_crash_the_sanitized_stager(sanitized_build, tmp_path):
    """Thousands of random and mutated plans (pieces among them): each is accepted or refused,
    never a crash."""
    rng = random.Random(19)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"f{i}").write_bytes(bytes(rng.randrange(256) for _ in range(100 + i)))
    valid = _valid_plan(src, 6)
    plans = tmp_path / "plans"
    plans.mkdir()
    paths = []
    for k in range(FUZZ_PLANS):
        path = plans / f"p{k}"
        path.write_bytes(_mutate(valid, rng))
        paths.append(str(path))
    env = dict(os.environ, **SANITIZER_ENV)
    binary = str(sanitized_build / "hpcdl-stage")
    checked = subprocess.run(
        [binary, "--check-plan", *paths],
        env=env,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=600,
    )
    _no_sanitizer_report(checked)
    accepted = checked.stdout.count("\n")
    assert 0 < accepted < FUZZ_PLANS  # both kinds were exercised
    # Real runs: the stager maps its status map from the plan and copies what it accepts.
    for k in range(FUZZ_RUNS):
        stage = tmp_path / f"stage{k}"
        meta = stage / ".hpcdl" / "sessions" / "fuzz"
        meta.mkdir(parents=True)
        (meta / "plan").write_bytes(Path(paths[k]).read_bytes() if k % 4 else valid)
        run = subprocess.run(
            [
                binary,
                "--stage-dir",
                str(stage),
                "--session",
                "fuzz",
                "--once",
                "--threads",
                "3",
                "--quiet",
            ],
            env=env,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=120,
        )
        _no_sanitizer_report(run)
        if k % 4 == 0:  # the valid plan staged every file
            assert run.returncode == 0, run.stderr
            for i in range(6):
                assert (stage / f"k/d{i % 2}/f{i}").read_bytes() == (src / f"f{i}").read_bytes()
            for offset in (0, 30):  # and each piece its range of f0
                piece = (stage / f"k/d0/f0.pieces/{offset}").read_bytes()
                assert piece == (src / "f0").read_bytes()[offset : offset + 40]
