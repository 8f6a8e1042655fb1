"""A refused budget says the smallest one that runs (``BudgetError.smallest_bytes``), and that budget runs the call
within itself: captured diffusers blocks, diffusers' hand-recognised ``FeedForward``, and a whole tiny Llama (its first
layer refuses). Budgets cover a call's live inputs, so the measured peak of the call's own work plus those inputs stays
under the budget; a budget a little below the smallest is refused again."""
import pytest
import torch

import streamplan
from conftest import diffusers_case, rel_err

ROWS = 1024


def _live(args, kwargs) -> int:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _refused(module, call, budget):
    handle = streamplan.apply(module, budget=budget, capture="prefer")
    try:
        with pytest.raises(streamplan.BudgetError) as err:
            call()
    finally:
        handle.remove()
    return err.value


@pytest.mark.parametrize("name", ["wan", "minimax_h3", "flux_single"])
@torch.no_grad()
def test_a_captured_block_runs_under_the_smallest_budget_it_was_told(name):
    block, args, kwargs = diffusers_case(name, ROWS)
    ref = _first(block(*args, **kwargs))
    err = _refused(block, lambda: block(*args, **kwargs), 2**16)
    smallest = err.smallest_bytes
    assert isinstance(smallest, int) and smallest > 2**16, str(err)
    assert "the smallest budget that runs it" in str(err), str(err)
    handle = streamplan.apply(block, budget=smallest, capture="prefer")
    out, peak = streamplan.measure_peak(lambda: _first(block(*args, **kwargs)))
    (plan,) = handle.plans[""]
    assert plan.tier != "L0" and plan.predicted_total <= smallest, handle.report()
    assert peak + _live(args, kwargs) <= smallest, (peak, smallest, handle.report())
    assert rel_err(out, ref) <= 1e-5
    handle.remove()
    again = _refused(block, lambda: block(*args, **kwargs), int(smallest * 0.98))
    assert again.smallest_bytes == smallest


@torch.no_grad()
def test_a_hand_recognised_mlp_is_told_its_smallest_budget():
    from diffusers.models.attention import FeedForward
    torch.manual_seed(0)
    ff = FeedForward(64, mult=4, activation_fn="gelu-approximate").eval()
    x = torch.randn(1, ROWS, 64)
    ref = ff(x)
    err = _refused(ff, lambda: ff(x), 2**12)
    assert isinstance(err.smallest_bytes, int), str(err)
    handle = streamplan.apply(ff, budget=err.smallest_bytes, capture="prefer")
    out, peak = streamplan.measure_peak(lambda: ff(x))
    assert handle.plans and all(p.tier != "L0" for ps in handle.plans.values() for p in ps), handle.report()
    assert peak + x.numel() * x.element_size() <= err.smallest_bytes, (peak, err.smallest_bytes)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    handle.remove()


@torch.no_grad()
def test_a_model_forward_reaches_a_budget_that_runs_by_following_what_each_refusal_says():
    """Each refusal names the smallest budget for the operation it refused (the embedding's output, then the first
    layer's plan, ...); following them, a whole tiny Llama reaches a budget that runs, exactly, in a few steps, and a
    refused call leaves the model as it was."""
    from transformers import LlamaConfig, LlamaModel
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    model = LlamaModel(config).eval()
    ids = torch.randint(0, 128, (1, ROWS))
    ref = model(ids).last_hidden_state
    budget, refused = 2**16, []
    for _ in range(6):
        handle = streamplan.apply(model, budget=budget)
        try:
            out = model(ids).last_hidden_state
            break
        except streamplan.BudgetError as exc:
            refused.append(str(exc).split(" ")[0])
            assert isinstance(exc.smallest_bytes, int) and exc.smallest_bytes > budget, str(exc)
            budget = exc.smallest_bytes
        finally:
            handle.remove()
        assert torch.equal(model(ids).last_hidden_state, ref)   # nothing of the model changed
    else:
        pytest.fail(f"no budget reached after refusals by {refused}")
    assert refused, "the first budget was meant to be refused"
    assert rel_err(out, ref) <= 1e-5
