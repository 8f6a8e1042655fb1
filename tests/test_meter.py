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


def test_rejects_a_non_callable():
    with pytest.raises(ValueError, match="fn"):
        measure_peak(42)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_allocator():
    _, peak = measure_peak(lambda: torch.empty(2**20, device="cuda"))
    assert peak >= 4 * 2**20
