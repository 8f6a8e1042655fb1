import time

from streamplan.cli import main


def test_demo_runs_and_reports(capsys):
    start = time.monotonic()
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "stock peak" in out and "streamed peak" in out and "max relative difference" in out
    assert time.monotonic() - start < 120


def test_demo_rejects_a_bad_budget(capsys):
    assert main(["demo", "--budget", "many"]) == 2
    assert "budget" in capsys.readouterr().err
