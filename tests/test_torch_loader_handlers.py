"""hpcdl.torch.Loader installs process-wide handlers (SIGTERM, atexit, sys.excepthook) only
when the script asks: inside `with Loader(...)`, or with handle_signals=True; used otherwise it
says so once (issue 37, item 4; NOTE [process-wide handlers] in hpcdl/torch/loader.py). And
when it does install them, a SIGTERM still cleans up: the workers and the stager end."""

from __future__ import annotations

import atexit
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

pytest.importorskip("torch")
from hpcdl.torch import Loader  # noqa: E402

BATCH = 8


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.h5"
    with h5py.File(path, "w") as f:
        f["images"] = np.zeros((32, 4, 4, 1), np.uint8)
        f["labels"] = np.arange(32) % 4
        f["sample_ids"] = np.arange(32)
    return path


EXIT_CALLS: list = []  # the loader's atexit registrations, while a test watches them


@pytest.fixture(autouse=True)
def watch_atexit(monkeypatch):
    """atexit, recorded (CPython has no public count of what is registered now)."""
    EXIT_CALLS.clear()
    monkeypatch.setattr(atexit, "register", EXIT_CALLS.append)
    monkeypatch.setattr(
        atexit, "unregister", lambda f: EXIT_CALLS.remove(f) if f in EXIT_CALLS else None
    )


def handlers() -> tuple:
    return signal.getsignal(signal.SIGTERM), sys.excepthook, len(EXIT_CALLS)


def test_without_with_nothing_is_installed_and_first_use_says_so(data, capfd):
    before = handlers()
    loader = Loader(data, BATCH, epochs=1, workers=1)
    assert handlers() == before
    for _ in loader:
        pass
    for _ in loader:
        pass
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("hpcdl: rank 0: warning: "), err
    assert "handle_signals=True" in err[0] and "with Loader" in err[0]
    loader.close()
    assert handlers() == before


def test_with_block_installs_them_and_puts_back_what_was_there(data, capfd):
    before = handlers()
    with Loader(data, BATCH, epochs=1, workers=1) as loader:
        term, hook, callbacks = handlers()
        assert term is not before[0] and hook is not before[1]
        assert callbacks == before[2] + 1
        for _ in loader:
            pass
    assert handlers() == before
    assert capfd.readouterr().err == ""  # asked for: nothing to say


def test_handle_signals_true_installs_them_for_the_loaders_life(data):
    before = handlers()
    loader = Loader(data, BATCH, epochs=1, workers=1, handle_signals=True)
    assert handlers()[0] is not before[0]
    loader.close()
    assert handlers() == before


def test_handle_signals_false_installs_nothing_even_in_a_with_block(data, capfd):
    before = handlers()
    with Loader(data, BATCH, epochs=1, workers=1, handle_signals=False) as loader:
        assert handlers() == before
        for _ in loader:
            pass
    assert capfd.readouterr().err == ""


def test_a_script_sigterm_handler_wins(data):
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with Loader(data, BATCH, epochs=1, workers=1):
            assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_inside_the_with_block_ends_with_143_and_cleans_up(data, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, time
        from hpcdl.torch import Loader
        with Loader({str(data)!r}, {BATCH}, epochs=1, workers=1) as loader:
            print(os.getpid(), flush=True)
            next(iter(loader))
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        """)
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143, done.stderr
    assert "stopped by signal SIGTERM" in done.stderr
    pid = done.stdout.split()[0]
    orphans = subprocess.run(["pgrep", "-P", pid], capture_output=True, text=True).stdout
    assert orphans == ""
