"""``gpupipe check`` (gpupipe/check.py): unreadable files fail the command, unusual ones are noted."""


def test_check_command_reports_and_fails(dirty_folder, capsys):
    import json

    from gpupipe.cli import main

    assert main(["check", str(dirty_folder), "--json", "--workers", "2"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {r["path"].rsplit("/", 1)[-1] for r in report["unreadable"]} == {"zz_empty.jpg", "zz_truncated.jpg"}
    notes = " ".join(n for r in report["unusual"] for n in r["notes"])
    assert "CMYK" in notes and "arithmetic" in notes and "PNG data under a .jpg name" in notes
