"""What the commands print, read from a file or pipe as a log or a script reads it: whole lines, file names as
written (brackets too)."""

import shutil

import gpupipe

from .common_utils import gpupipe_cli, make_folder


def _dirty(tmp_path):
    """A folder with a deep path (longer lines than 80 columns) and two unreadable files with brackets in their
    names."""
    root = make_folder(tmp_path / ("a-rather-long-folder-name-" * 3) / "data", 2, 2)
    (root / "c00" / "holiday [copy].jpg").write_bytes(b"not a jpeg")
    (root / "c01" / "[bold]x.jpg").write_bytes(b"")
    return root


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


def test_prepare_to_a_pipe_prints_whole_lines_and_names_as_written(tmp_path):
    root = _dirty(tmp_path)
    out = tmp_path / "shards [v1]"
    r = gpupipe_cli("prepare", root, out, "--workers", 0)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sum(line.startswith("unreadable ") and "holiday [copy].jpg: " in line for line in lines) == 1
    assert lines[-1].startswith(f"{out}: prepared: 4 samples in 1 shards")  # one line, the brackets kept
    shutil.rmtree(out)


def test_an_error_keeps_its_brackets(tmp_path):
    r = gpupipe_cli("check", tmp_path / "no [such] folder")
    assert r.returncode == 2 and r.stderr.startswith(f"error: {tmp_path}/no [such] folder: ")


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
