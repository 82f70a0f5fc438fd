from pathlib import Path

import pytest

from hpcdl.config import ConfigError, parse_args


def test_flags_override_toml(tmp_path):
    cfg_file = tmp_path / "job.toml"
    cfg_file.write_text('data = "/d"\nbatch_size = 16\nlr = 0.5\nmodel = "mlp"\nnesterov = true\n')
    cfg = parse_args(["--config", str(cfg_file), "--batch-size", "8"])
    assert (cfg.data, cfg.batch_size, cfg.lr, cfg.model, cfg.nesterov) == (
        "/d",
        8,
        0.5,
        "mlp",
        True,
    )
    assert cfg.epochs == 10  # default kept


def test_stage_nice_is_auto_by_default_and_a_number_from_toml_or_a_flag(tmp_path):
    """--stage-nice takes a word (auto) or a number: TOML may write either as it reads best."""
    assert parse_args(["--data", "x"]).stage_nice == "auto"
    assert parse_args(["--data", "x", "--stage-nice", "7"]).stage_nice == "7"
    for text, want in (("stage_nice = 10", "10"), ('stage_nice = "auto"', "auto")):
        cfg_file = tmp_path / "job.toml"
        cfg_file.write_text(f'data = "/d"\n{text}\n')
        assert parse_args(["--config", str(cfg_file)]).stage_nice == want
    cfg_file.write_text('data = "/d"\nstage_nice = true\n')
    with pytest.raises(ConfigError, match="--stage-nice .* must be a string, got True"):
        parse_args(["--config", str(cfg_file)])


def test_lr_zero_is_accepted_to_freeze_a_model():
    """PyTorch's optimizers and Keras take lr=0 (freeze, or check that weights round-trip)."""
    assert parse_args(["--data", "x", "--lr", "0"]).lr == 0.0


def test_sync_params_k():
    assert parse_args(["--data", "x", "--sync", "params:4"]).params_sync_every == 4
    assert parse_args(["--data", "x"]).params_sync_every == 0


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--data", "x", "--batch-size", "0"], "--batch-size must be a positive integer"),
        (["--data", "x", "--batch-size", "abc"], "--batch-size .*must be an integer"),
        (["--data", "x", "--model", "vgg"], "--model must be one of mlp, cnn, resnet20"),
        (["--data", "x", "--sync", "params:0"], "--sync"),
        (["--data", "x", "--lr", "-1"], "--lr must be >= 0"),
        (["--data", "x", "--resume", "auto"], "needs --checkpoint-dir"),
        (["--data", "x", "--stage-capacity", "lots"], "--stage-capacity"),
        (["--data", "x", "--peer-staging", "yes"], "--peer-staging must be one of auto, on, off"),
        (["--data", "x", "--stage-nice", "20"], "--stage-nice must be auto or 0..19, got '20'"),
        (["--data", "x", "--stage-nice", "-1"], "--stage-nice must be auto or 0..19, got '-1'"),
        (["--data", "x", "--stage-nice", "low"], "--stage-nice must be auto or 0..19, got 'low'"),
        (["--data", "x", "--stage-nice", "\u00b2"], "--stage-nice must be auto or 0..19, got '."),
        (["--batch-size", "4"], "--data is required"),
        (["--data", "x", "--no-such-flag"], "unrecognized arguments"),
        (["--data", "x", "--stall-warning", "0"], "--stall-warning must be > 0 seconds"),
        (["--data", "x", "--stall-shutdown", "-1"], "--stall-shutdown must be > 0 seconds"),
        (["--data", "x", "--timeline", "/"], "--timeline / is a directory; give a file name"),
    ],
)
def test_invalid_values_name_the_field(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(argv)


def test_bad_config_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_args(["--config", str(tmp_path / "missing.toml")])
    bad = tmp_path / "bad.toml"
    bad.write_text("data = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_args(["--config", str(bad)])
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('data = "x"\nbatchsize = 3\n')
    with pytest.raises(ConfigError, match="unknown key 'batchsize'"):
        parse_args(["--config", str(unknown)])
    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text('data = "x"\nepochs = "many"\n')
    with pytest.raises(ConfigError, match="--epochs .*type.toml.* must be an integer"):
        parse_args(["--config", str(wrong_type)])


def test_toml_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    jobdir = tmp_path / "jobs"
    (jobdir / "ck").mkdir(parents=True)
    (jobdir / "ck" / "old.h5").write_bytes(b"")
    cfg_file = jobdir / "job.toml"
    cfg_file.write_text(
        'data = "shards/train"\nval_data = "../val"\ncheckpoint_dir = "ck"\n'
        'metrics = "m.jsonl"\nstage_dir = "/local/stage"\nresume = "ck/old.h5"\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = parse_args(["--config", str(cfg_file)])
    assert cfg.data == str(jobdir / "shards" / "train")
    assert cfg.val_data == str(jobdir / ".." / "val")
    assert cfg.checkpoint_dir == str(jobdir / "ck")
    assert cfg.metrics == str(jobdir / "m.jsonl")
    assert cfg.stage_dir == "/local/stage"
    assert cfg.resume == str(jobdir / "ck" / "old.h5")
    # Flags stay relative to the current directory; auto/none are not paths.
    cfg = parse_args(["--config", str(cfg_file), "--data", "here", "--resume", "auto"])
    assert (cfg.data, cfg.resume) == ("here", "auto")
    # A relative --config path works the same.
    monkeypatch.chdir(tmp_path)
    assert parse_args(["--config", "jobs/job.toml"]).data == str(Path("jobs/shards/train"))


def test_stage_config_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    from hpcdl.stage import build_parser, resolve  # noqa: PLC0415

    (tmp_path / "job.toml").write_text('data = "shards"\nstage_dir = "local"\n')
    monkeypatch.chdir("/")
    args = resolve(build_parser().parse_args(["--config", str(tmp_path / "job.toml")]))
    assert (args.data, args.stage_dir) == (str(tmp_path / "shards"), str(tmp_path / "local"))


@pytest.mark.parametrize(
    "spec,match",
    [
        ("flipp", "--augment: unknown op 'flipp'"),
        ("crop4+rrc32", "at most one of"),
        ("rcrop0", "unknown op 'rcrop0'"),
    ],
)
def test_bad_augment_spec_is_a_config_error(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(["--data", "x", "--augment", spec])
    assert parse_args(["--data", "x", "--augment", "crop4+flip"]).augment == "crop4+flip"


def test_abbreviated_flags_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="unrecognized arguments: --epoch 3"):
        parse_args(["--data", "x", "--epoch", "3"])


def test_no_parser_in_the_package_accepts_abbreviated_flags(monkeypatch):
    import argparse  # noqa: PLC0415
    import importlib  # noqa: PLC0415

    from hpcdl.bench.__main__ import BENCHMARKS  # noqa: PLC0415
    from tools.bench.__main__ import HARNESSES  # noqa: PLC0415

    made: list[tuple[str, bool]] = []
    init = argparse.ArgumentParser.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append((self.prog, self.allow_abbrev))

    monkeypatch.setattr(argparse.ArgumentParser, "__init__", recording_init)
    mains = ["hpcdl.train", "hpcdl.stage", "hpcdl.jobs.__main__", "hpcdl.report"]
    mains += ["hpcdl.data.__main__"]
    mains += [*BENCHMARKS.values(), "hpcdl.bench._steps", *HARNESSES.values()]
    for name in mains:
        with pytest.raises(SystemExit) as exit_:
            importlib.import_module(name).main(["--help"])
        assert exit_.value.code == 0, name
    assert len(made) >= len(mains) + 3  # with the subcommands of hpcdl.jobs and hpcdl.data
    assert [prog for prog, allowed in made if allowed] == []


def test_a_model_file_named_in_toml_is_relative_to_the_config_file(tmp_path, monkeypatch):
    jobdir = tmp_path / "jobs"
    (jobdir / "models").mkdir(parents=True)
    (jobdir / "models" / "net.py").write_text("def build(shape, classes):\n    return []\n")
    cfg_file = jobdir / "job.toml"
    cfg_file.write_text('data = "shards"\nmodel = "models/net.py:build"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert parse_args(["--config", str(cfg_file)]).model == f"{jobdir / 'models' / 'net.py'}:build"
    # A module spec and a built-in name are not paths; a flag stays relative to the cwd.
    for model in ("hpcdl.nn.models:build_model", "resnet18"):
        cfg_file.write_text(f'data = "shards"\nmodel = "{model}"\n')
        assert parse_args(["--config", str(cfg_file)]).model == model
    (elsewhere / "net.py").write_text("def build(shape, classes):\n    return []\n")
    flagged = parse_args(["--config", str(cfg_file), "--model", "net.py:build"])
    assert flagged.model == "net.py:build"
