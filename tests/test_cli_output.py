"""What the commands print, read from a file or pipe as a log or a script reads it: whole lines, file names as
written (brackets too)."""

import shutil

import pytest

import gpupipe

from .common_utils import gpupipe_cli, make_folder


def _dirty(tmp_path):
    """A folder with a deep path (longer lines than 80 columns) and two unreadable files with brackets in their
    names."""
    root = make_folder(tmp_path / ("a-rather-long-folder-name-" * 3) / "data", 2, 2)
    (root / "c00" / "holiday [copy].jpg").write_bytes(b"not a jpeg")
    (root / "c01" / "[bold]x.jpg").write_bytes(b"")
    return root


@pytest.mark.slow
def test_check_to_a_pipe_prints_whole_lines_and_names_as_written(tmp_path):
    root = _dirty(tmp_path)
    r = gpupipe_cli("check", root, "--workers", 0)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    unreadable = [line for line in lines if line.startswith("unreadable ")]
    assert len(unreadable) == 2 and min(map(len, unreadable)) > 80  # one line each, not wrapped at 80 columns
    assert any(line.startswith(f"unreadable {root}/c00/holiday [copy].jpg: ") for line in unreadable)
    assert any(line.startswith(f"unreadable {root}/c01/[bold]x.jpg: ") for line in unreadable)
    assert lines[-1] == "6 files: 2 unreadable, 0 unusual but usable"


@pytest.mark.slow
def test_prepare_to_a_pipe_prints_whole_lines_and_names_as_written(tmp_path):
    root = _dirty(tmp_path)
    out = tmp_path / "shards [v1]"
    r = gpupipe_cli("prepare", root, out, "--workers", 0)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sum(line.startswith("unreadable ") and "holiday [copy].jpg: " in line for line in lines) == 1
    assert lines[-1].startswith(f"{out}: prepared: 4 samples in 1 shard (")  # one line, the brackets kept
    shutil.rmtree(out)


def test_an_error_keeps_its_brackets(tmp_path, capsys):
    from gpupipe.cli import main

    assert main(["check", str(tmp_path / "no [such] folder")]) == 2  # in this process: no interpreter to start
    assert capsys.readouterr().err.startswith(f"error: {tmp_path}/no [such] folder: ")


def test_version_is_quick_and_does_not_import_torch():
    import subprocess
    import sys

    from .common_utils import REPO_ROOT

    code = (  # argparse's version action answers and exits
        "import sys\nfrom gpupipe.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert r.stdout.splitlines() == [f"gpupipe {gpupipe.__version__}", "False"]  # was 3.7 s: torch imported


def test_import_gpupipe_gives_the_public_api():
    assert set(dir(gpupipe)) >= set(gpupipe.__all__)
    assert gpupipe.build_loader is gpupipe.api.build_loader and callable(gpupipe.read_image)


@pytest.mark.slow
def test_check_and_prepare_to_a_pipe_print_no_empty_line(tmp_path):
    """The probe: both began with an empty line (the progress display's, in a pipe)."""
    root = make_folder(tmp_path / "data", 2, 2)
    for args in (["check", root], ["prepare", root, tmp_path / "shards"]):
        r = gpupipe_cli(*args, "--workers", 0)
        assert r.returncode == 0 and r.stderr == "" and r.stdout.count("\n") == 1, (r.stdout, r.stderr)


@pytest.mark.slow  # `gpupipe prepare` in a fresh interpreter
def test_prepare_says_that_a_file_can_have_several_reasons(tmp_path):
    from PIL import Image

    root = tmp_path / "data"
    for name, size in (("c0/big.png", (200, 160)), ("c0/small.jpg", (40, 30)), ("c1/small.jpg", (30, 40))):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (90, 30, 200)).save(root / name)
    r = gpupipe_cli("prepare", root, tmp_path / "shards", "--workers", 0, "--max-side", 100)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == (
        f"{tmp_path / 'shards'}: prepared: 3 samples in 1 shard (2 copied, 1 re-encoded: 1 PNG (not JPEG), "
        "1 larger than max-side (a file can have several reasons)); 0 left out"
    )


@pytest.mark.slow  # writes the 600 JPEGs of the sample data
def test_bench_without_data_says_what_it_measures(tmp_path):
    r = gpupipe_cli("bench", "--backends", "no-such", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == (
        "no --data: measuring the sample data in data/sample (`gpupipe sample-data` writes it)"
    )
