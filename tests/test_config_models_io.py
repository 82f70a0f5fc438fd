"""--init-from and --tensorboard in hpcdl.config: flags, TOML keys, and one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpcdl.config import ConfigError, parse_args


def test_flags_and_toml_keys(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"")
    cfg = parse_args(
        ["--data", "d", "--init-from", str(tmp_path / "w.safetensors"), "--tensorboard", "tb"]
    )
    assert (cfg.init_from, cfg.tensorboard) == (str(tmp_path / "w.safetensors"), "tb")
    (tmp_path / "job.toml").write_text(
        'data = "d"\ninit_from = "w.safetensors"\ntensorboard = "runs/a"\n'
    )
    cfg = parse_args(["--config", str(tmp_path / "job.toml")])
    assert cfg.init_from == str(tmp_path / "w.safetensors")  # relative to the file's directory
    assert cfg.tensorboard == str(tmp_path / "runs/a")


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--init-from", "{tmp}/none.pth"], "--init-from {tmp}/none.pth: no such file"),
        (
            ["--init-from", "{tmp}/w.npz"],
            "--init-from {tmp}/w.npz: expected a .pth, .pt, .safetensors file",
        ),
        (["--tensorboard", "{tmp}/w.npz"], "--tensorboard {tmp}/w.npz is a file; give a directory"),
    ],
)
def test_bad_values_are_one_line(tmp_path, flags, message):
    (tmp_path / "w.npz").write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        parse_args(["--data", "d", *(f.format(tmp=tmp_path) for f in flags)])
    assert str(info.value) == message.format(tmp=tmp_path)


def test_tensorboard_without_tensorboardx_says_which_extra():
    script = """
import sys
sys.modules["tensorboardX"] = None  # not installed: importing it raises ImportError
from hpcdl.config import ConfigError, parse_args
try:
    parse_args(["--data", "d", "--tensorboard", "tb"])
except ConfigError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.stdout.strip() == (
        "--tensorboard needs tensorboardX, which is not installed: pip install 'hpcdl[tensorboard]'"
    )
