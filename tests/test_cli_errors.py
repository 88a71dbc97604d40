"""Errors as one line naming the file and the cause; GPUPIPE_TRACEBACK=1 for the full traceback (bug reports)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from gpupipe._deps import INSTALL_HINTS
from gpupipe.cli import main
from gpupipe.errors import TRACEBACK_ENV

from .common_utils import REPO_ROOT, make_folder, train_args


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


def _without(modules: set[str], *args) -> subprocess.CompletedProcess:
    """``gpupipe ARGS`` in a process where ``modules`` cannot be found (an install without the extra that has them)."""
    code = (
        "import sys\n"
        "class Gone:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {sorted(modules)!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Gone())\n"
        "from gpupipe.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop(TRACEBACK_ENV, None)
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("command", [["train", "--print-config"], ["eval", "--checkpoint", "x.pt", "--data", "."]])
def test_train_and_eval_without_the_train_extra_name_it(command):
    r = _without({"yaml", "omegaconf", "timm"}, *command)
    assert r.returncode == 2 and _lines(r.stderr) == [
        f"error: gpupipe {command[0]} needs the train extra (timm, omegaconf, yaml not installed): "
        + INSTALL_HINTS["train"]
    ], r.stderr


@pytest.mark.slow
def test_bench_plot_without_matplotlib_is_refused_before_the_benchmark(tmp_path):
    """The probe: the whole benchmark ran, then --plot failed. Here --data does not exist: the plot is checked first."""
    r = _without({"matplotlib"}, "bench", "--data", tmp_path / "nowhere", "--plot", tmp_path / "b.png")
    assert r.returncode == 2 and _lines(r.stderr) == [
        f"error: 'matplotlib' is not installed; {INSTALL_HINTS['bench']}"
    ], r.stderr


def test_a_bench_output_that_cannot_be_written_is_named_by_its_flag_before_the_benchmark(tmp_path, capsys, monkeypatch):
    """The probe: ``--json /proc/nope/x.json`` ran the whole benchmark, then said ``error: /proc/nope: No such file or
    directory``, naming no flag. Here --data does not exist: the outputs are checked first."""
    monkeypatch.delenv("GPUPIPE_TRACEBACK", raising=False)
    nowhere, a_file = tmp_path / "nowhere", tmp_path / "notes.txt"
    a_file.write_text("kept")
    for flag, path, why in (
        ("--json", a_file / "runs" / "r.json", f"{a_file} is a file, not a folder"),
        ("--plot", tmp_path, "a folder; name a file to write"),
    ):
        assert main(["bench", "--data", str(nowhere), flag, str(path)]) == 2
        assert _lines(capsys.readouterr().err) == [f"error: {flag} {path}: {why}"]
    assert main(["bench", "--data", str(nowhere), "--json", str(tmp_path / "new" / "r.json")]) == 2  # made then
    assert "--json" not in capsys.readouterr().err and a_file.read_text() == "kept"


@pytest.mark.parametrize(
    "args, line",
    [
        (["train", "--epochs", "x"], "error: argument --epochs: invalid int value: 'x'"),
        (["train", "--epoch", "2"], "error: unrecognized arguments: --epoch 2 (--epoch: did you mean --epochs?)"),
        (["bench", "--device", "tpu"], "error: argument --device: invalid choice: 'tpu' (choose from 'cpu', 'cuda')"),
        (["eval", "--workers", "-1"], "error: argument --workers: must be >= 0, got -1"),
        (["prepare", "a", "b", "--workers", "-1"], "error: argument --workers: must be >= 0, got -1"),
    ],
)
def test_an_argument_mistake_is_one_line_without_the_usage_block(args, line, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    (got,) = _lines(capsys.readouterr().err)
    assert got == f"{line} (`gpupipe {args[0]} --help` lists the flags)"


@pytest.mark.parametrize("args", [["nosuch"], []])
def test_a_command_mistake_points_to_the_list_of_commands(args, capsys):
    """The probe: ``gpupipe nosuch`` and a bare ``gpupipe`` ended "(`gpupipe --help` lists the flags)"."""
    with pytest.raises(SystemExit) as e:
        main(args)
    (got,) = _lines(capsys.readouterr().err)
    assert e.value.code == 2 and got.startswith("error: ") and got.endswith("(`gpupipe --help` lists the commands)")


def test_train_workers_below_zero_names_the_flag(tmp_path, capsys, monkeypatch):
    """The probe: ``gpupipe train --workers -1`` said ``num_workers must be >= 0`` (build_loader's name)."""
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    assert main(["train", "--data", str(tmp_path), "--workers", "-1"]) == 2
    assert _lines(capsys.readouterr().err) == ["error: --workers must be >= 0, got -1"]


def test_train_without_data_names_the_default_and_how_to_make_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["train"]) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert line.startswith("error: data/sample: no such folder; it is --data's default, the sample data: ")
    assert "`gpupipe sample-data` makes it" in line
    assert not (tmp_path / "runs").exists()


def test_a_warning_is_one_line_without_the_source_that_raised_it(tmp_path, capsys, monkeypatch):
    """A file list naming a missing file, with --on-error skip: one line, as the command's other messages. Python's own
    display named gpupipe's source file, line and category, and printed the line of source ("build.py:81:
    UserWarning: ... train_loader = train()")."""
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    data = make_folder(tmp_path / "data", 2, 4)
    rows = [f"{path.relative_to(tmp_path)},{path.parent.name}" for path in sorted(data.glob("*/*.jpg"))]
    listed = tmp_path / "list.csv"
    listed.write_text("\n".join(["path,label", *rows, "data/c00/nothere.jpg,c00"]) + "\n")
    assert main(["train", *train_args(listed, tmp_path / "run", "--on-error", "skip", epochs=1)]) == 0
    err = capsys.readouterr().err
    line = next(line for line in _lines(err) if "nothere.jpg" in line)  # (the epoch's skipped list names it too)
    assert line.startswith("warning: 1 file(s) in the list do not exist and will be skipped: "), err
    assert "UserWarning" not in err and ".py:" not in err, err


def test_an_out_folder_holding_a_config_yaml_of_the_users_own_is_refused_and_left_as_it_was(
    tmp_path, capsys, monkeypatch
):
    """A --out folder with a config.yaml that is no run's (the user's own): it was taken for a run that saved no
    checkpoint, renamed config.unfinished.yaml with a line listing some 60 settings, and the run's metrics were added to
    the folder's metrics.jsonl. It is refused now, naming the file, and nothing in the folder changes."""
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    data = make_folder(tmp_path / "data", 2, 2)
    out = tmp_path / "project"
    out.mkdir()
    (out / "config.yaml").write_text("lr: 0.1\nepochs: 5\nmy_own_setting: true\n")
    (out / "metrics.jsonl").write_text('{"mine": 1}\n')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["train", *train_args(data, out, epochs=1)]) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert line == f"error: {out / 'config.yaml'} is not a gpupipe train run's config: choose another --out " + (
        "(a run writes its settings, metrics and checkpoints there)"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_refused_run_leaves_no_empty_out_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    data = make_folder(tmp_path / "data", 2, 2)
    for extra in (["--data", tmp_path / "nowhere"], ["--model", "no_such_model"], ["--batch-size", "5"]):
        args = train_args(data, tmp_path / "runs" / "x", *map(str, extra), batch_size=None)
        assert main(["train", *args]) == 2
        capsys.readouterr()
        assert not (tmp_path / "runs").exists(), extra
    (tmp_path / "runs").mkdir()  # a folder that was there before the run stays
    assert main(["train", *train_args(data, tmp_path / "runs", "--batch-size", "5", batch_size=None)]) == 2
    assert (tmp_path / "runs").is_dir()


def test_a_batch_larger_than_the_data_names_the_flag_and_the_largest_batch(tmp_path, capsys, monkeypatch):
    """The probe: the CLI advised drop_last=False, which gpupipe train has no flag for."""
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    data = make_folder(tmp_path / "data", 2, 2)
    assert main(["train", *train_args(data, tmp_path / "out", batch_size=5)]) == 2
    (line,) = _lines(capsys.readouterr().err)
    assert line == (
        "error: 4 samples over 1 rank(s) make no full batch of 5 with drop_last=True: use --batch-size 4 or less"
    )


def test_a_wrong_flag_value_is_named_by_its_flag_and_a_wrong_file_value_by_its_key(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    assert main(["train", "--image-size", "0", "--print-config"]) == 2
    assert _lines(capsys.readouterr().err) == ["error: --image-size must be >= 1, got 0"]
    config = tmp_path / "run.yaml"
    config.write_text("image_size: 0\n")
    assert main(["train", "--config", str(config), "--print-config"]) == 2
    assert _lines(capsys.readouterr().err) == [f"error: {config}:1: image_size must be >= 1, got 0"]


def test_a_shard_label_past_an_int64_is_one_line_naming_the_shard_and_member(tmp_path, capsys, monkeypatch):
    """A 30-digit label once overflowed the index's int64 column: a traceback from check and train."""
    import io
    import tarfile

    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    shard = tmp_path / "train.tar"
    with tarfile.open(shard, "w") as tf:
        for name, data in (("a.jpg", b"x"), ("a.cls", b"1" * 30)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    for command in (["check", str(shard)], ["train", *train_args(shard, tmp_path / "out")]):
        assert main(command) == 2
        (line,) = _lines(capsys.readouterr().err)
        assert line.startswith(f"error: {shard}: a.cls: label 111111111111...(30 characters) would make more than")


def test_a_ctrl_c_a_library_wrapped_in_its_own_error_is_the_one_line_stop(monkeypatch, capsys):
    """DALI turns a KeyboardInterrupt raised while it builds a pipeline into an error of its own: still the one-line
    stop and 130, not a traceback and 1; another error keeps its traceback."""
    from gpupipe import cli

    def wrapped(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise RuntimeError("Critical error when building pipeline") from e

    def other(args):
        raise RuntimeError("not an interrupt")

    monkeypatch.setattr(cli, "show_traceback", lambda: False)
    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), wrapped))
    assert cli.main(["info"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted: stopped"
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), other))
    with pytest.raises(RuntimeError, match="not an interrupt"):
        cli.main(["info"])


def _with_func(parser, func):
    for action in parser._subparsers._group_actions:  # the sub-commands
        for sub in action.choices.values():
            sub.set_defaults(func=func)
    return parser


def test_a_second_ctrl_c_that_broke_a_lock_in_a_thread_pool_is_trains_stop_at_once(monkeypatch, capsys, tmp_path):
    """A Ctrl-C raised inside ``threading.Condition.__exit__`` (the loader's host thread pool) came out as
    ``RuntimeError: release unlocked lock``: train said the generic "interrupted: stopped", not what it kept."""
    from gpupipe.train import cli as train_cli

    def broken_lock(cfg):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("release unlocked lock")  # noqa: B904 -- as threading raises it: the context, no cause

    monkeypatch.setattr(train_cli, "_train_or_stop", broken_lock)
    assert train_cli._train(types.SimpleNamespace(out=str(tmp_path))) == 130
    said = capsys.readouterr().err.strip()
    assert (
        said == f"interrupted: stopped at once; no checkpoint was saved ({tmp_path}/checkpoints/last.pt does not "
        "exist): nothing to resume"
    )

    def other(cfg):
        raise RuntimeError("not an interrupt")

    monkeypatch.setattr(train_cli, "_train_or_stop", other)
    with pytest.raises(RuntimeError, match="not an interrupt"):
        train_cli._train(types.SimpleNamespace(out=str(tmp_path)))
