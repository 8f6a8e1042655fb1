import pytest
import torch

from streamplan import measure_peak


def test_measures_a_known_allocation():
    def alloc():
        return torch.empty(1024, 1024, dtype=torch.float32)  # 4 MiB

    result, peak = measure_peak(alloc, device="cpu")
    assert result.shape == (1024, 1024)
    assert peak == 4 * 2**20


def test_peak_is_the_high_water_mark_not_the_end_state():
    def transient():
        a = torch.ones(2**20)          # 4 MiB
        b = torch.ones(2 * 2**20)      # 8 MiB, both live: 12 MiB
        del a, b
        return torch.ones(256)         # 1 KiB survives

    _, peak = measure_peak(transient, device="cpu")
    assert peak == 12 * 2**20


def test_memory_live_before_the_call_does_not_count():
    big = torch.ones(4 * 2**20)
    _, peak = measure_peak(lambda t: t.sum(), big)
    assert peak < 1024


def test_garbage_of_an_earlier_measured_call_freed_now_does_not_offset_this_call():
    """Memory an earlier measured call allocated (so the profiler knows its size) and that is freed inside this call
    (garbage collected, a cache cleared) is not this call's: it must not hide what this call allocates."""
    kept: list = []
    _, first = measure_peak(lambda: kept.append(torch.ones(2 * 2**20)), device="cpu")   # 8 MiB, kept past the call
    assert first == 8 * 2**20

    def frees_old_then_allocates():
        kept.clear()                           # the earlier call's 8 MiB go now
        a = torch.ones(2**20)                  # 4 MiB of this call's own
        return a.sum()

    _, peak = measure_peak(frees_old_then_allocates, device="cpu")
    assert 4 * 2**20 <= peak < 4 * 2**20 + 1024, peak   # its 4 MiB and the sum's scalar


def test_rejects_a_non_callable():
    with pytest.raises(ValueError, match="fn"):
        measure_peak(42)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_allocator():
    _, peak = measure_peak(lambda: torch.empty(2**20, device="cuda"))
    assert peak >= 4 * 2**20


# --- the caller's stderr and warnings survive the meter; only the profiler's own noise is dropped -------------------

def test_the_callers_stderr_output_reaches_the_user(capfd):
    import os
    import sys

    def noisy():
        print("hello from python", file=sys.stderr)
        os.write(2, b"hello from fd 2\n")      # what C extensions and subprocesses write
        return torch.ones(4)

    result, _ = measure_peak(noisy, device="cpu")
    assert result.shape == (4,)
    err = capfd.readouterr().err
    assert "hello from python" in err and "hello from fd 2" in err


def test_the_callers_warnings_reach_the_user():
    import warnings

    def warns():
        warnings.warn("mine")
        return torch.ones(4)

    with pytest.warns(UserWarning, match="mine"):
        measure_peak(warns, device="cpu")


def test_output_is_kept_when_the_call_raises(capfd):
    import os

    def fails():
        os.write(2, b"last words\n")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        measure_peak(fails, device="cpu")
    assert "last words" in capfd.readouterr().err
    os.write(2, b"after\n")                   # stderr is the real one again
    assert capfd.readouterr().err == "after\n"


def test_in_a_fresh_process_the_user_sees_their_output_and_no_profiler_noise():
    import subprocess
    import sys

    code = """
import sys, warnings, torch
from streamplan import measure_peak
before = [torch.ones(1000) for _ in range(3)]
def fn():
    print("hello", file=sys.stderr)
    warnings.warn("mine")
    before.clear()                  # frees blocks allocated before the window: the CPU allocator warns
    return torch.ones(10)
measure_peak(fn, device="cpu")
measure_peak(fn, device="cpu")
print("done")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
    assert done.stderr.count("hello") == 2 and "UserWarning: mine" in done.stderr
    for noise in ("profiler_start", "profiler_stop", "Memory block of unknown size"):
        assert noise not in done.stderr, done.stderr
