"""Every float flag must be finite: `--lr inf` was taken and failed at step 1 with numpy's
RuntimeWarnings (`--momentum inf`, `--weight-decay inf` alike), `--warmup-epochs inf` trained
at lr 0 and exited 0, while `--lr nan` was refused up front."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import mpi_env, one_line_error

from hpcdl.config import ConfigError, field_types, parse_args

FLOATS = [name for name, typ in field_types().items() if typ is float]


def test_the_float_flags_are_the_ones_a_user_sets():
    assert {"lr", "momentum", "weight_decay", "warmup_epochs", "bucket_mb"} <= set(FLOATS)


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_a_float_flag_that_is_not_finite_is_refused(name, value):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ConfigError, match=f"^{flag} must be a finite number, got "):
        parse_args(["--data", "x", f"{flag}={value}"])


def test_a_job_file_cannot_give_inf_either(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('data = "x"\nweight_decay = inf\n')
    with pytest.raises(ConfigError, match="^--weight-decay must be a finite number, got inf$"):
        parse_args(["--config", str(job)])


def test_training_refuses_lr_inf_before_it_starts(digits_dir):
    done = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--data", digits_dir / "train", "--model", "mlp",
         "--epochs", "1", "--lr", "inf"],
        capture_output=True, text=True, env=mpi_env(), timeout=300,
    )  # fmt: skip
    assert one_line_error(done) == "hpcdl.train: error: --lr must be a finite number, got inf"
    assert "RuntimeWarning" not in done.stderr
