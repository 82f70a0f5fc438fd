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
        (["--data", "x", "--lr", "-1"], "--lr must be > 0"),
        (["--data", "x", "--resume", "auto"], "needs --checkpoint-dir"),
        (["--data", "x", "--stage-capacity", "lots"], "--stage-capacity"),
        (["--batch-size", "4"], "--data is required"),
        (["--data", "x", "--no-such-flag"], "unrecognized arguments"),
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
