import importlib.metadata
import json
import subprocess
import sys
import time

import pytest
import torch

import streamplan
import streamplan.tools.bench
import streamplan.tools.demo
import streamplan.tools.families
from streamplan.tools import cli
from streamplan.tools.cli import main


def _one_line_error(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], (w, err)


# --- runs ------------------------------------------------------------------------------------------------------------

def test_demo_runs_and_reports(capsys, tmp_path):
    import xml.etree.ElementTree as ET
    start = time.monotonic()
    assert main(["demo", "--plot", str(tmp_path / "timeline.html")]) == 0
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    assert "stock peak" in out and "streamed peak" in out and "max relative difference" in out
    # every number says what it is: measured or predicted, memory and time, on one stated baseline
    assert "with its inputs" in out and "the report's baseline" in out
    assert "stock peak      (measured)" in out and "streamed peak   (measured)" in out
    assert "stock time      (measured)" in out and "streamed time   (measured)" in out and "x stock" in out
    # one predicted figure: the report's (its table's "predicted" column), the same in the summary
    (predicted_line,) = [line for line in out.splitlines() if "(predicted)" in line]
    predicted = predicted_line.split("(predicted)")[1].split()[0:2]
    row = next(line for line in out.splitlines() if line.lstrip().startswith("<root>"))
    assert " ".join(predicted) in row and "peak~" not in out
    # the picture was written, and the last line says what the demo showed, in measured figures
    assert ET.parse(tmp_path / "timeline.html").getroot() is not None and "timeline.html" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("Measured on cpu: streamed,") and "the same output as stock" in last
    assert "x less peak memory than stock" in last and "x stock's time" in last and "inputs included" in last
    stock, streamed = (line.split("(measured)")[1].split()[:2] for line in out.splitlines()
                       if line.lstrip().startswith(("stock peak", "streamed peak   (measured)")))
    assert f"({' '.join(streamed)} against {' '.join(stock)}" in last
    # progress on stderr, stage by stage, with times
    for stage in ("[1/3] building", "[2/3] stock run", "[3/3] streamed run"):
        assert stage in err
    assert err.count("done in") == 3
    assert time.monotonic() - start < 120


def test_demo_with_a_budget(capsys):
    assert main(["demo", "--case", "wan-ffn", "--budget", "100MiB"]) == 0
    out = capsys.readouterr().out
    assert "budget: 100.00 MiB" in out and "streamed peak" in out


def test_run_demo_reports_progress_and_times_and_prints_nothing(capfd):
    seen = []
    r = streamplan.tools.demo.run_demo("wan-ffn", tokens=2048, progress=seen.append)
    out, err = capfd.readouterr()
    assert out == "" and err == ""          # library code reports through the callback (and logging) only
    assert [m[:5] for m in seen if m.startswith("[")] == ["[1/3]", "[2/3]", "[3/3]"]
    assert r.stock_time_s > 0 and r.streamed_time_s > 0 and r.time_ratio == r.streamed_time_s / r.stock_time_s
    assert r.predicted_peak is not None and r.predicted_peak > r.input_bytes > 0   # with the inputs, as reported
    assert 0 < r.streamed_peak < r.stock_peak
    assert r.streamed_total == r.streamed_peak + r.input_bytes and r.stock_total == r.stock_peak + r.input_bytes
    # the memory picture of the metered streamed call: its measured peak is the meter's
    assert r.timeline is not None and r.timeline.call_own == r.streamed_peak
    assert r.summary().startswith("Measured on cpu: streamed, Wan2.1 FeedForward at 2048 tokens")


@pytest.mark.parametrize("tokens", [0, -5])
def test_run_demo_rejects_tokens_below_one(tokens):
    with pytest.raises(ValueError, match="tokens"):
        streamplan.tools.demo.run_demo("wan-ffn", tokens=tokens)


def test_plan_prints_a_plan_without_running_anything(capsys):
    assert main(["plan", "--family", "wan-14b-block", "--tokens", "217088", "--budget", "12GiB"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "planned on meta tensors" in out and "L1" in out
    assert "floor (residual + K + V)       " in out and out.split("floor (residual + K + V)")[1].split()[0] == "30.0"
    # the stock figure is the memory model's estimate, not a measurement: it says so
    assert "stock (estimate, not measured)" in out and "planned (predicted)" in out
    assert "[1/3]" in captured.err and "[3/3] planning" in captured.err


def test_plan_below_the_floor_says_what_dominates(capsys):
    assert main(["plan", "--family", "llama3-8b-layer", "--tokens", "131072", "--budget", "2GiB"]) == 2
    err = capsys.readouterr().err
    assert "cannot hold it" in err and "K, V and the outputs" in err


def test_plan_finds_the_smallest_budget_and_card(capsys):
    assert main(["plan", "--family", "flux-single-block", "--tokens", "16384", "--smallest"]) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if s.startswith("smallest budget that plans it"))
    smallest = streamplan.parse_budget(line.split(": ")[1].split(" beside")[0])
    assert 0 < smallest and "with its weights" in line, line
    # a budget below it is refused, naming that smallest budget (rounded as printed)
    assert main(["plan", "--family", "flux-single-block", "--tokens", "16384", "--budget",
                 str(int(smallest * 0.97))]) == 2
    assert "the smallest budget that runs it" in capsys.readouterr().err


def test_plan_of_a_whole_model_below_the_devices_reach_keeps_its_rows_on_the_host(capsys):
    # planned on meta tensors: the rehearsal makes every plan, nothing runs in chunks (it once ran them all: minutes)
    start = time.monotonic()
    assert main(["plan", "--family", "wan-14b-model", "--tokens", "16384", "--budget", "300MiB"]) == 0
    out = capsys.readouterr().out
    root = next(s for s in out.splitlines() if s.strip().startswith("<root>"))
    assert " L6 " in root, root
    assert "of host memory at once" in out and " L4 " in out, out[:2000]
    assert time.monotonic() - start < 120

def test_plan_as_json(capsys):
    assert main(["plan", "--family", "flux-single-block", "--tokens", "65536", "--budget", "4GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)     # progress goes to stderr: stdout is the JSON alone
    (plan,) = data["streamed"][""]["plans"]
    assert plan["tier"] in ("L1", "L2", "L3") and plan["predicted_peak"] > 0


def test_planning_on_meta_counts_the_inputs(capsys):
    assert main(["plan", "--family", "wan-14b-block", "--tokens", "65536", "--budget", "8GiB", "--json"]) == 0
    (plan,) = json.loads(capsys.readouterr().out)["streamed"][""]["plans"]
    x = 65536 * 5120 * 2
    assert plan["live_bytes"] >= x            # the residual input alone
    assert plan["live_bytes"] + plan["predicted_peak"] <= 8 * 2**30


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_bench_needs_a_gpu_and_says_so(capsys):
    assert main(["bench"]) == 2
    assert "CUDA" in capsys.readouterr().err


# --- input checks: one line naming the option and what it accepts, exit 2, nothing built --------------------------

@pytest.fixture
def no_demo_run(monkeypatch):
    """run_demo replaced: a test fails if the command gets as far as building the model."""
    calls = []
    monkeypatch.setattr(streamplan.tools.demo, "run_demo", lambda *a, **k: calls.append((a, k)) or pytest.fail("ran"))
    return calls


@pytest.mark.parametrize("argv, words", [
    (["demo", "--tokens", "0"], ["--tokens", "at least 1", "'0'"]),
    (["demo", "--tokens", "-5"], ["--tokens", "at least 1", "'-5'"]),
    (["demo", "--tokens", "1.5"], ["--tokens", "whole number"]),
    (["demo", "--chunk-tokens", "0"], ["--chunk-tokens", "at least 1"]),
    (["demo", "--ffn-slice", "-2"], ["--ffn-slice", "at least 1"]),
    (["demo", "--device", "gpu"], ["--device", "cpu, cuda or cuda:N"]),
    (["demo", "--case", "nope"], ["--case", "wan-block", "wan-ffn"]),
    (["demo", "--budget", "many"], ["--budget", "budget"]),
    (["demo", "--budget", "0"], ["--budget", "budget"]),
    (["demo", "--budget", "-5GiB"], ["--budget", "budget", "-5GiB"]),
    (["demo", "--budget=-5GiB"], ["--budget", "budget", "-5GiB"]),
    (["demo", "--budget", "-1"], ["--budget", "budget"]),
    (["plan", "--tokens", "0"], ["--tokens", "at least 1"]),
    (["plan", "--tokens", "-1"], ["--tokens", "at least 1"]),
    (["plan", "--budget", "-5GiB"], ["--budget", "budget"]),
    (["plan", "--family", "gpt-5"], ["--family", "wan-14b-block", "llama3-8b-layer"]),
    (["bench", "--cases", "wan-14b-block,nope"], ["--cases", "'nope'", "flux-single-block"]),
    (["bench", "--tokens", "4096,0"], ["--tokens", "at least 1"]),
    (["bench", "--modes", "stock,fast"], ["--modes", "'fast'", "streamplan-<rows>"]),
    (["bench", "--repeats", "0"], ["--repeats", "at least 1"]),
    (["demo", "--plot", "/no/such/folder/t.html"], ["--plot", "does not exist"]),
    (["demo", "--plot", "."], ["--plot", "a file to write"]),
    (["bench", "--plot", "/no/such/folder/t.html"], ["--plot", "does not exist"]),
])
def test_bad_values_are_one_line_and_exit_2(argv, words, capsys, no_demo_run):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    _one_line_error(captured.err, *words)
    assert "expected one argument" not in captured.err
    assert not no_demo_run


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_demo_on_cuda_without_cuda_says_so(capsys, no_demo_run):
    assert main(["demo", "--device", "cuda"]) == 2
    _one_line_error(capsys.readouterr().err, "--device", "CUDA", "--device cpu")


def test_a_budget_is_checked_before_the_model_is_built(monkeypatch, capsys):
    built = []
    monkeypatch.setattr(streamplan.tools.demo.CASES["wan-block"], "build",
                        lambda: built.append(1) or pytest.fail("built"))
    start = time.monotonic()
    assert main(["demo", "--budget", "12 parsecs"]) == 2
    assert "budget" in capsys.readouterr().err and not built
    assert time.monotonic() - start < 5


def test_auto_budget_is_accepted():
    args = cli.build_parser().parse_args(["demo", "--budget", "auto"])
    assert args.budget == "auto"
    args = cli.build_parser().parse_args(["plan", "--budget", "AUTO"])
    assert args.budget == "auto"


# --- help, version, options ----------------------------------------------------------------------------------------

def test_help_says_what_streamplan_is_and_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "bounded activation memory" in " ".join(out.split())
    for verb in ("demo", "plan", "bench"):
        assert f"\n    {verb} " in out


def test_command_help_lists_the_choices(capsys):
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "{wan-block,wan-ffn}" in out and "WanTransformerBlock" in out
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "{" + ",".join(streamplan.tools.families.FAMILIES) + "}" in out
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in streamplan.tools.bench.CASES)


def test_every_option_has_help():
    parser = cli.build_parser()
    for command in ("demo", "plan", "bench"):
        sub = parser.parse_args([command])._parser
        for action in [*parser._actions, *sub._actions]:
            if action.option_strings:
                assert action.help, (command, action.option_strings)


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "streamplan 0.1.0"
    assert streamplan.__version__ == importlib.metadata.version("streamplan")


def test_verbose_before_or_after_the_command():
    parser = cli.build_parser()
    assert parser.parse_args(["demo"]).verbose is False
    assert parser.parse_args(["-v", "demo"]).verbose is True
    assert parser.parse_args(["demo", "-v"]).verbose is True
    assert parser.parse_args(["plan", "--tokens", "4096", "--verbose"]).verbose is True


def test_the_cli_catalogues_match_what_the_commands_build():
    import streamplan.tools.bench
    import streamplan.tools.families

    assert {k: c.description for k, c in streamplan.tools.demo.CASES.items()} == cli.DEMO_CASES
    assert {k: c.default_tokens for k, c in streamplan.tools.demo.CASES.items()} == cli.DEMO_DEFAULT_TOKENS
    assert {k: f.description for k, f in streamplan.tools.families.FAMILIES.items()} == cli.PLAN_FAMILIES
    assert {k: make().description for k, make in streamplan.tools.bench.CASES.items()} == cli.BENCH_CASES


# --- no torch for --help / --version ---------------------------------------------------------------------------------

_NO_TORCH = """
import sys, time
start = time.perf_counter()
from streamplan.tools.cli import main
rc = main({argv!r})
print("RESULT", rc, "torch" in sys.modules, time.perf_counter() - start, file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["demo", "--help"], ["plan", "--help"],
                                  ["bench", "--help"], ["demo", "--tokens", "0"]])
def test_help_and_usage_errors_do_not_import_torch(argv):
    done = subprocess.run([sys.executable, "-c", _NO_TORCH.format(argv=argv)], capture_output=True, text=True,
                          timeout=60)
    rc, torch_loaded, seconds = done.stderr.strip().splitlines()[-1].split()[1:]
    assert torch_loaded == "False", done.stderr
    assert int(rc) == (2 if "0" in argv else 0)
    assert float(seconds) < 2


def test_python_m_streamplan_help_is_quick_and_torch_free():
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "streamplan", "--help"], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 2
    assert done.returncode == 0 and "usage: streamplan" in done.stdout
    code = ("import runpy, sys\nsys.argv = ['streamplan', 'demo', '--help']\n"
            "try:\n    runpy.run_module('streamplan', run_name='__main__')\nexcept SystemExit as e:\n"
            "    print('RESULT', e.code, 'torch' in sys.modules, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stderr.strip().splitlines()[-1] == "RESULT 0 False", done.stderr


def test_the_lazy_package_keeps_its_public_names():
    code = ("import streamplan, streamplan.tools.demo\n"            # importing the verify submodule first
            "from streamplan import apply\n"
            "assert callable(streamplan.verify) and streamplan.verify.__name__ == 'verify'\n"
            "assert all(getattr(streamplan, n) is not None for n in streamplan.__all__)\n"
            "assert streamplan.attention.SDPA is not None and streamplan.apply is apply\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


def test_plan_of_ltx2_image_to_video_holds_its_budget_on_meta(capsys):
    # a timestep per video row: the tables described (no values on meta: one distinct timestep stands in)
    assert main(["plan", "--family", "ltx2-model", "--tokens", "20400", "--budget", "2GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (root,) = data["streamed"][""]["plans"]
    assert root["live_bytes"] + root["predicted_peak"] <= 2 << 30, root
    assert "per-row tables described" in data["streamed"][""]["recognized_as"], data["streamed"][""]


def test_plan_of_a_whole_llama_prefill_holds_its_budget_on_meta(capsys):
    # the stock forward reads a value (transformers' packed-sequence check) that meta tensors do not have: the plan on
    # shapes runs the planned forward instead; the call's keywords (no cache, one position's logits) are the family's
    assert main(["plan", "--family", "llama3-8b-model", "--tokens", "8192", "--budget", "600MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (root,) = data["streamed"][""]["plans"]
    assert root["live_bytes"] + root["predicted_peak"] <= 600 << 20, root
    assert root["shape"].startswith("((1, 8192), ('logits_to_keep'"), root
