"""``gpupipe check`` (gpupipe/check.py): unreadable files fail the command, unusual ones are noted."""


def test_check_command_reports_and_fails(dirty_folder, capsys):
    import json

    from gpupipe.cli import main

    assert main(["check", str(dirty_folder), "--json", "--workers", "2"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {r["path"].rsplit("/", 1)[-1] for r in report["unreadable"]} == {"zz_empty.jpg", "zz_truncated.jpg"}
    notes = " ".join(n for r in report["unusual"] for n in r["notes"])
    assert "CMYK" in notes and "arithmetic" in notes and "PNG data under a .jpg name" in notes


def test_check_reads_shards_and_urls_as_build_loader_does(tmp_path, s3, capsys):
    """A foreign shard with one truncated member, on a disk and on a local S3 server: the member is named."""
    import io
    import json
    import tarfile

    import numpy as np

    from gpupipe.cli import main

    from .common_utils import INVALID, photo

    good = io.BytesIO()
    photo(np.random.default_rng(0), 40, 50).save(good, "JPEG")
    members = {
        "a.jpg": good.getvalue(),
        "a.cls": b"0",
        "b.jpg": INVALID["truncated"](photo(np.random.default_rng(1), 40, 50)),
        "b.cls": b"1",
    }
    with tarfile.open(tmp_path / "part-0.tar", "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    url = s3.upload(tmp_path / "part-0.tar", "check")
    for source in (tmp_path / "part-0.tar", f"{url}/part-0.tar"):
        assert main(["check", str(source), "--json", "--workers", "2"]) == 1
        report = json.loads(capsys.readouterr().out)
        assert report["files"] == 2 and [r["path"] for r in report["unreadable"]] == ["part-0.tar:b.jpg"]


def test_check_takes_allow_outside_root_as_train_does(tmp_path, capsys):
    """A CSV list naming files beside its folder: refused with the flag to pass, then checked with it."""
    import numpy as np

    from gpupipe.cli import main

    from .common_utils import photo

    photo(np.random.default_rng(0), 40, 50).save(tmp_path / "a.jpg", "JPEG")
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "train.csv").write_text("../a.jpg,0\n")
    assert main(["check", str(tmp_path / "lists" / "train.csv"), "--workers", "0"]) == 2  # an error: one line
    assert "--allow-outside-root" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "lists" / "train.csv"), "--workers", "0", "--allow-outside-root"]) == 0
