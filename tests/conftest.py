import contextlib

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


class OpCounter:
    """Counts calls of ``ops`` whose arguments ``big`` says are chunk-sized, inside ``with``."""

    def __init__(self, ops: tuple, big):
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                if func in ops and big(args):
                    self.count += 1
                return func(*args, **(kwargs or {}))
        self.count, self._mode = 0, _Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


@contextlib.contextmanager
def streamed(module, **options):
    """``streamplan.apply(module, **options)`` for a ``with`` block's calls: the handle, removed after."""
    import streamplan
    handle = streamplan.apply(module, **options)
    try:
        yield handle
    finally:
        handle.remove()


def diffusers_case(name: str, rows: int, dtype: torch.dtype = torch.float32):
    """The diffusers catalogue's block ``name`` (seeded) and its inputs at ``rows`` rows on the CPU: (module, args,
    kwargs)."""
    from streamplan.tools.catalogue.diffusers_cases import CASES
    torch.manual_seed(0)
    module = CASES[name].build()
    args, kwargs = CASES[name].inputs(rows, torch.device("cpu"), dtype)
    return module, args, kwargs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference relative to the reference's max magnitude."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


class RecordingConsumer:
    """A third-party attention backend for the contract tests: records each call (rows, q_offset, keys, causal) and
    answers with streamplan's SDPA consumer; with ``max_rows`` it runs out of memory on larger chunks, like a card
    that is nearly full."""

    name = "recording"

    def __init__(self, max_rows: int | None = None):
        import streamplan
        self.caps = streamplan.ConsumerCaps()
        self.max_rows = max_rows
        self.calls = []

    def attend(self, q, k, v, *, q_offset, causal, mask, scale):
        import streamplan
        if self.max_rows is not None and q.shape[-2] > self.max_rows:
            raise torch.OutOfMemoryError("simulated: chunk too large")
        self.calls.append((q.shape[-2], q_offset, k.shape[-2], causal))
        return streamplan.attention.SDPA.attend(q, k, v, q_offset=q_offset, causal=causal, mask=mask, scale=scale)


# the tiny decoder config the transformers LLM tests share (test_llm_models, test_row_masks)
TINY_DECODER = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    num_hidden_layers=2, vocab_size=128, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def is_block(name: str) -> bool:
    """An installed entry's name is a block's (the root, or an element of a block list), not a part's: a stock block's
    unknown parts stream from captured graphs of their own too (``recognize.generic.part_candidates``)."""
    return name == "" or name.rsplit(".", 1)[-1].isdigit()
