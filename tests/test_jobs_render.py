"""hpcdl.jobs renderer: valid bash for every bundled site, validation, no shell injection."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.jobs import JobSpec, JobSpecError, bundled_sites, load_site, render
from hpcdl.jobs.render import shell_words, time_seconds

RESUME = re.compile(r"^\s+--resume auto\b", re.M)  # the launch line, not the comments


def write_config(path: Path, **values) -> Path:
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    return path


@pytest.fixture
def config(tmp_path) -> Path:
    return write_config(
        tmp_path / "job.toml", data=str(tmp_path / "data"), checkpoint_dir=str(tmp_path / "ck")
    )


def spec(config: Path, /, **overrides) -> JobSpec:
    values = dict(
        kind="train",
        nodes=2,
        tasks_per_node=4,
        device="gpu",
        time="01:00:00",
        config=str(config),
        site=load_site("generic"),
        output_dir=str(config.parent),
    )
    values.update(overrides)
    return JobSpec(**values)


def bash_n(script: str) -> None:
    r = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.jobs", *args], capture_output=True, text=True, cwd=cwd
    )


@pytest.mark.parametrize("site", sorted(bundled_sites()))
@pytest.mark.parametrize("kind", ["train", "stage"])
def test_every_bundled_site_renders_valid_bash(config, site, kind):
    script, _ = render(spec(config, kind=kind, site=load_site(site), stage_key="run1"))
    bash_n(script)
    assert script.startswith("#!/bin/bash\n#SBATCH --job-name=hpcdl-")
    if kind == "train":
        assert "--signal=B:USR1@" in script
        assert RESUME.search(script)
    else:
        assert "#SBATCH --ntasks-per-node=1" in script
    assert "srun mpirun" not in script


# A stand-in launcher's lines that leave what a finished run leaves: a summary in --metrics.
WRITE_SUMMARY = """while [ $# -gt 0 ]; do
  [ "$1" = --metrics ] && printf '{"event": "start"}\\n{"event": "summary"}\\n' >> "$2"
  shift
done
"""


def launched_command(tmp_path: Path, script: str) -> list[str]:
    """Run a rendered script with a stand-in launcher; the words the launcher was given."""
    record = tmp_path / "launcher-args"
    stub = tmp_path / "launcher"
    stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n{WRITE_SUMMARY}')
    stub.chmod(0o755)
    script = re.sub(r"(?m)^launcher=.*$", f"launcher={stub}", script)
    env = {
        **os.environ,
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NAME": "hpcdl-train",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_NTASKS": "8",
        "HPCDL_STAGE_DIR": str(tmp_path / "local"),
    }
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return record.read_text().splitlines()


def after(words: list[str], marker: list[str]) -> list[str]:
    """The words after the first occurrence of the sequence marker."""
    for i in range(len(words)):
        if words[i : i + len(marker)] == marker:
            return words[i + len(marker) :]
    raise AssertionError(f"{marker} not in {words}")


@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_trainer_command_line_carries_every_render_option(tmp_path, device):
    config = write_config(tmp_path / "job.toml", data="d")
    ck = tmp_path / "my ck"
    job = spec(
        config,
        device=device,
        checkpoint_dir=str(ck),
        stage_key="run1",
        cpus_per_task=3,
        requeue=True,
        extra_args=["--epochs", "3", "--note", "a b"],
    )
    words = launched_command(tmp_path, render(job)[0])
    assert words[: words.index(sys.executable)] == [
        *("-np", "8", "--map-by", "ppr:4:node", "--bind-to", "none", "--oversubscribe"),
    ]
    assert after(words, [sys.executable]) == [
        *("-u", "-m", "hpcdl.train", "--config", str(config.resolve())),
        *("--metrics", f"{tmp_path}/hpcdl-train-42.metrics.jsonl"),
        *("--device", device),
        *("--resume", "auto"),
        *("--stage-dir", f"{tmp_path}/local/hpcdl-run1"),
        *("--checkpoint-dir", str(ck)),
        *("--epochs", "3", "--note", "a b"),
    ]


def test_training_jobs_of_one_user_share_a_stage_dir_without_a_stage_key(tmp_path):
    """Without --stage-key every training job of a user stages into the same hpcdl-u<uid>, so
    the next job on a node finishes what an earlier one left there (a lost node's copies, a
    removal cut off by the job's end) and a chain's jobs reuse the copies."""
    config = write_config(tmp_path / "job.toml", data="d")
    words = launched_command(tmp_path, render(spec(config))[0])
    assert after(words, ["--stage-dir"])[0] == f"{tmp_path}/local/hpcdl-u{os.getuid()}"


def test_trainer_command_line_without_checkpoints_or_staging(tmp_path):
    config = write_config(tmp_path / "job.toml", data="d", metrics="m.jsonl", device="gpu")
    words = launched_command(tmp_path, render(spec(config, device="", stage=False))[0])
    assert after(words, [sys.executable]) == [
        *("-u", "-m", "hpcdl.train", "--config", str(config.resolve())),
        *("--metrics", str(tmp_path / "m.jsonl")),
        *("--device", "gpu"),  # the config's device when render has no --device
    ]


def test_stage_command_line_carries_the_training_shape(tmp_path):
    config = write_config(tmp_path / "job.toml", data="shards")
    site = load_site("generic")
    words = launched_command(tmp_path, render(spec(config, kind="stage", stage_key="k"))[0])
    assert words[:2] == ["-np", "2"] and site.launcher.args[0] in words
    assert after(words, [sys.executable]) == [
        *("-u", "-m", "hpcdl.stage", "--data", str(tmp_path / "shards")),
        *("--config", str(config.resolve())),
        *("--nodes", "2", "--ranks-per-node", "4", "--stage-dir", f"{tmp_path}/local/hpcdl-k"),
    ]


def test_gpu_request_style_follows_the_site(config):
    generic, _ = render(spec(config))
    assert "#SBATCH --gpus-per-node=4" in generic
    abci, _ = render(spec(config, site=load_site("abci")))
    assert "#SBATCH --gres=gpu:4" in abci
    cpu, _ = render(spec(config, device="cpu"))
    assert "gpus-per-node" not in cpu and "--gres" not in cpu


def test_mpirun_takes_the_shape_and_site_options(config):
    script, _ = render(spec(config))
    assert "-np 8 --map-by ppr:4:node --bind-to none" in script
    assert "--oversubscribe" in script
    assert "OMPI_ALLOW_RUN_AS_ROOT=1" in script  # generic: launcher.allow_root
    srun, _ = render(spec(config, site=load_site("perlmutter")))
    assert "--mpi=cray_shasta --ntasks-per-node=4 --cpus-per-task=32" in srun
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in srun


def test_on_node_loss_continue_runs_mpirun_with_ulfm(tmp_path):
    config = write_config(tmp_path / "job.toml", data="d", checkpoint_dir="ck",
                          on_node_loss="continue")  # fmt: skip
    script, _ = render(spec(config))
    assert "-np 8 --map-by ppr:4:node --bind-to none --with-ft ulfm" in script
    plain, _ = render(spec(write_config(tmp_path / "stop.toml", data="d", checkpoint_dir="ck")))
    assert "--with-ft" not in plain


@pytest.mark.parametrize(
    "name",
    ["$(touch /tmp/hpcdl-pwned)", "a b", "x;rm -rf /", "job\nname", "`id`", "-x", "a" * 65],
)
def test_hostile_job_names_are_rejected(config, name):
    with pytest.raises(JobSpecError, match="--job-name"):
        render(spec(config, job_name=name))


def test_hostile_paths_are_quoted_and_run_nothing(tmp_path):
    # A config path with quotes, $(...) and backticks is a legal file name: it must reach the
    # script as one literal word, and evaluating the assignment must not run anything.
    weird = tmp_path / 'it\'s $(touch pwned) `touch pwned2` "q"'
    weird.mkdir()
    config = write_config(weird / "job.toml", data="d")
    extra = ["--note", "$(touch pwned3)"]
    script, _ = render(spec(config, output_dir=str(tmp_path), extra_args=extra))
    bash_n(script)
    line = next(li for li in script.splitlines() if li.startswith("config="))
    r = subprocess.run(
        ["bash", "-c", f'{line}\nprintf %s "$config"'], capture_output=True, text=True, cwd=tmp_path
    )
    assert r.stdout == str(config.resolve())
    assert "'$(touch pwned3)'" in script
    assert not any(tmp_path.glob("pwned*"))


@pytest.mark.parametrize(
    "field,value",
    [
        ("config", "job\n.toml"),
        ("checkpoint_dir", "ck\npt"),
        ("extra_args", ["--x", "a\rb"]),
        ("stage_key", "a;b"),
    ],
)
def test_control_characters_and_bad_keys_are_rejected(config, field, value):
    with pytest.raises(JobSpecError, match="control characters|--stage-key"):
        render(spec(config, **{field: value}))


def test_output_dir_for_sbatch_directive_rejects_spaces(config, tmp_path):
    with pytest.raises(JobSpecError, match="--output .*#SBATCH"):
        render(spec(config, output_dir=str(tmp_path / "my logs")))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(nodes=0), "--nodes must be >= 1"),
        (dict(tasks_per_node=-1), "--tasks-per-node must be >= 1"),
        (dict(device="tpu"), "--device must be one of cpu, gpu"),
        (dict(time="90"), "--time must be HH:MM:SS"),
        (dict(time="00:61:00"), "minutes and seconds"),
        (dict(time="00:01:00"), "--signal-seconds 120 must be shorter"),
        (dict(signal_seconds=70000), "--signal-seconds must be 0-65535"),
        (dict(kind="stage"), "needs --stage-key"),
        (dict(config="/nonexistent/job.toml"), "--config: config file .* does not exist"),
    ],
)
def test_invalid_values_name_the_field(config, overrides, match):
    with pytest.raises(JobSpecError, match=match):
        render(spec(config, **overrides))


def test_time_limits():
    assert time_seconds("00:10:00") == 600
    assert time_seconds("1-02:03:04") == 93784
    assert time_seconds("100:00:00") == 360000


def test_signal_can_be_turned_off_for_short_jobs(config):
    script, _ = render(spec(config, time="00:01:00", signal_seconds=0))
    assert "#SBATCH --signal" not in script


def test_missing_checkpoint_dir_warns(tmp_path):
    config = write_config(tmp_path / "job.toml", data="d")
    script, warnings = render(spec(config))
    assert any("cannot be resumed" in w for w in warnings)
    assert not RESUME.search(script)
    script, warnings = render(spec(config, checkpoint_dir=str(tmp_path / "ck")))
    assert not warnings
    assert RESUME.search(script) and '--checkpoint-dir "$checkpoint_dir"' in script
    assert f"checkpoint_dir={tmp_path / 'ck'}\n" in script


def test_site_values_may_reference_variables_but_not_run_commands():
    assert shell_words("f", "/mnt/bb/$USER") == '/mnt/bb/"${USER}"'
    assert shell_words("f", "${HOME}/x y") == "\"${HOME}\"'/x y'"
    r = subprocess.run(
        ["bash", "-c", "printf %s " + shell_words("f", "/a/$USER/${HOME} b")],
        capture_output=True,
        text=True,
        env={**os.environ, "USER": "u1", "HOME": "/h"},
    )
    assert r.stdout == "/a/u1//h b"
    for bad in ("$(id)", "a$", "${USER:-x}", "$1"):
        with pytest.raises(JobSpecError, match=r"may use \$ only"):
            shell_words("site local_ssd", bad)


def test_site_file_errors_name_the_field(tmp_path):
    bad = tmp_path / "s.toml"
    bad.write_text('gpu_request = "gpus"\n')
    with pytest.raises(JobSpecError, match="gpu_request must be one of"):
        load_site(str(bad))
    bad.write_text("partitoin = 'x'\n")
    with pytest.raises(JobSpecError, match="unknown key partitoin"):
        load_site(str(bad))
    bad.write_text("[launcher]\nargs = '--oversubscribe'\n")
    with pytest.raises(JobSpecError, match="launcher.args must be a list of strings"):
        load_site(str(bad))
    bad.write_text('partition = "debug\\nx"\n')
    with pytest.raises(JobSpecError, match="control characters"):
        render(spec(write_config(tmp_path / "j.toml", data="d"), site=load_site(str(bad))))
    with pytest.raises(JobSpecError, match="no bundled site named 'nowhere'"):
        load_site("nowhere")


def test_cli_renders_to_stdout_and_reports_errors_in_one_line(config, tmp_path):
    r = cli(
        "render",
        "train",
        "--nodes",
        "1",
        "--tasks-per-node",
        "2",
        "--time",
        "00:10:00",
        "--config",
        str(config),
        "--output",
        str(tmp_path),
        "--",
        "--epochs",
        "1",
    )
    assert r.returncode == 0, r.stderr
    bash_n(r.stdout)
    assert "--epochs 1 &" in r.stdout
    r = cli(
        "render",
        "train",
        "--nodes",
        "1",
        "--time",
        "00:10:00",
        "--config",
        str(config),
        "--job-name",
        "$(touch x)",
    )
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("hpcdl.jobs: error: --job-name")


def test_cli_lists_bundled_sites():
    r = cli("sites")
    assert r.returncode == 0
    for name in ("generic", "perlmutter", "frontier", "abci"):
        assert name in r.stdout
    assert "untested" in r.stdout and "CI:" in r.stdout


def test_chain_submits_the_same_job_script_n_times_each_after_the_last(config):
    job, _ = render(spec(config))
    chain, warnings = render(spec(config, chain=3))
    assert warnings == []
    bash_n(chain)
    heredoc = re.search(r"<<'HPCDL_CHAIN_JOB'\n(.*)\nHPCDL_CHAIN_JOB\n", chain, re.S)
    assert heredoc and heredoc.group(1) == job.rstrip("\n")  # one job script, verbatim
    assert RESUME.search(job) and "#SBATCH --signal=B:USR1@120" in job
    assert "for k in $(seq 1 3)" in chain
    assert '${previous:+"--dependency=afterany:$previous"}' in chain
    assert render(spec(config, chain=1))[0] == job  # --chain 1: the job script itself


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"chain": 0}, "--chain must be >= 1"),
        ({"chain": 2, "requeue": True}, "--chain and --requeue"),
        ({"chain": 2, "kind": "stage", "stage_key": "k"}, "--chain is for training jobs"),
    ],
)
def test_chain_errors_name_the_flag(config, overrides, match):
    with pytest.raises(JobSpecError, match=match):
        render(spec(config, **overrides))


def test_chain_needs_a_checkpoint_directory(tmp_path):
    config = write_config(tmp_path / "job.toml", data=str(tmp_path / "data"))
    with pytest.raises(JobSpecError, match="--chain needs a checkpoint directory"):
        render(spec(config, chain=2))


@pytest.mark.parametrize(
    "records,status,line",
    [
        ("", 5, "did NOT finish: the launcher exited 0"),  # mpirun after a lost node
        ('{"event": "start"}\\n{"event": "summary"}\\n{"event": "start"}\\n', 5, "did NOT"),
        ('{"event": "start"}\\n{"event": "summary"}\\n', 0, "finished training"),
    ],
    ids=["no-record", "earlier-run-finished", "finished"],
)
def test_a_run_is_finished_by_its_own_record_not_the_launchers_status(
    tmp_path, records, status, line
):
    """Issue 36: Open MPI's mpirun exits 0 after losing a node; the job must not say finished."""
    metrics = tmp_path / "metrics.jsonl"
    config = write_config(tmp_path / "job.toml", data=str(tmp_path / "data"), metrics=str(metrics))
    script, _ = render(spec(config, stage=False))
    stub = tmp_path / "launcher"
    stub.write_text(f"#!/bin/sh\nprintf '{records}' >> {metrics}\nexit 0\n")
    stub.chmod(0o755)
    script = re.sub(r"(?m)^launcher=.*$", f"launcher={stub}", script)
    env = {**os.environ, "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS": "8"}
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == status, r.stdout + r.stderr
    assert line in r.stdout, r.stdout
    assert ("finished training" in r.stdout) == (status == 0)
