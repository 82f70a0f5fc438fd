"""`python -m tools.bench staging`: its own input checks (the copy itself runs in
docs/PERFORMANCE.md's commands, behind the FUSE harness)."""

from __future__ import annotations

from tools.bench import staging


def test_a_missing_scratch_dir_is_a_clear_error_and_nothing_is_made(tmp_path, capsys):
    missing = tmp_path / "no-such-dir"
    assert staging.main(["--dir", str(missing), "--files", "4", "--sweep-files", "4"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "--dir" in err
    assert not missing.exists()


def test_a_scratch_dir_that_is_a_file_is_an_error_and_the_file_is_kept(tmp_path, capsys):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine\n")
    assert staging.main(["--dir", str(afile), "--files", "4", "--sweep-files", "4"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert afile.read_text() == "mine\n"
