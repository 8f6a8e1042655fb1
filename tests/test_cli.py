import time

import pytest
import torch

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


def test_plan_prints_a_plan_without_running_anything(capsys):
    assert main(["plan", "--family", "wan-14b-block", "--tokens", "217088", "--budget", "12GiB"]) == 0
    out = capsys.readouterr().out
    assert "planned on meta tensors" in out and "L1" in out and "floor (residual + K + V) 30.0" in out


def test_plan_below_the_floor_says_what_dominates(capsys):
    assert main(["plan", "--family", "llama3-8b-layer", "--tokens", "131072", "--budget", "2GiB"]) == 2
    err = capsys.readouterr().err
    assert "smallest peak" in err and "K and V" in err


def test_plan_as_json(capsys):
    import json
    assert main(["plan", "--family", "flux-single-block", "--tokens", "65536", "--budget", "4GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (plan,) = data["streamed"][""]["plans"]
    assert plan["tier"] in ("L1", "L2", "L3") and plan["predicted_peak"] > 0


def test_demo_with_a_budget(capsys):
    assert main(["demo", "--case", "wan-ffn", "--budget", "100MiB"]) == 0
    out = capsys.readouterr().out
    assert "budget: 100.00 MiB" in out and "streamed peak" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_bench_needs_a_gpu_and_says_so(capsys):
    assert main(["bench"]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_planning_on_meta_counts_the_inputs(capsys):
    import json
    assert main(["plan", "--family", "wan-14b-block", "--tokens", "65536", "--budget", "8GiB", "--json"]) == 0
    (plan,) = json.loads(capsys.readouterr().out)["streamed"][""]["plans"]
    x = 65536 * 5120 * 2
    assert plan["live_bytes"] >= x            # the residual input alone
    assert plan["live_bytes"] + plan["predicted_peak"] <= 8 * 2**30
