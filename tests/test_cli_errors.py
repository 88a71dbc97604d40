"""Errors as one line naming the file and the cause; GPUPIPE_TRACEBACK=1 for the full traceback (bug reports)."""

from __future__ import annotations

import os

import pytest

from gpupipe.cli import main
from gpupipe.errors import TRACEBACK_ENV


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_an_error_is_one_line_and_the_traceback_is_there_when_asked(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nowhere"
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    assert main(["check", str(missing)]) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert line == f"error: {missing}: no such directory or file list"
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        main(["check", str(missing)])


def test_a_system_error_names_the_file_and_the_cause(tmp_path, capsys, monkeypatch):
    """An OSError from deep inside (here: an output folder that is a file) is not a traceback either."""
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    src = tmp_path / "src"
    (src / "c0").mkdir(parents=True)
    (src / "c0" / "a.jpg").write_bytes(b"x")
    blocker = tmp_path / "file"
    blocker.write_text("a file where the output folder should go")
    assert main(["prepare", str(src), str(blocker / "out")]) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert line == f"error: {blocker / 'out'}: Not a directory", line


def test_a_newline_in_a_message_stays_on_its_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    missing = tmp_path / "two\nlines"
    assert main(["check", str(missing)]) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert line == f"error: {tmp_path}/two\\nlines: no such directory or file list"
    assert os.sep in line


def test_a_python_tag_in_a_yaml_config_is_one_line_and_never_run(tmp_path, capsys, monkeypatch):
    """The probe: ``!!python/object/apply`` gave a 49-line traceback (it was not executed: nor is it now)."""
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    planted = tmp_path / "made-by-the-yaml"
    config = tmp_path / "run.yaml"
    config.write_text(f'epochs: 2\nlr: !!python/object/apply:os.mkdir ["{planted}"]\n')
    assert main(["train", "--config", str(config), "--print-config"]) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert line.startswith(f"error: {config}:2: could not determine a constructor for the tag")
    assert "python/object/apply:os.mkdir" in line and not planted.exists()


def test_an_unknown_device_is_one_line_naming_the_valid_ones(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    assert main(["train", "--data", str(tmp_path), "--device", "gpu", "--out", str(tmp_path / "run")]) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert line == "error: device must be 'cpu', 'cuda' or 'cuda:N' (or a torch.device), got 'gpu'"
    assert not (tmp_path / "run").exists()
