import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference relative to the reference's max magnitude."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
