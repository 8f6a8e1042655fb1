"""Attention masks over a call's own rows on the captured-graph path (issues 10 and 16): a transformers decoder model
forward hands its layers a ``RowMask`` (the library's own mask function, evaluated a Q chunk at a time) where stock
builds a ``[B, 1, N, N]`` mask: padded batches, sliding windows past the window, Gemma 2/3's alternating layers,
Qwen2's sliding layers. Every layer streams from its graph, exact against the real model (logits and cache), and
the mask rows each chunk builds are counted in its plan. Gemma 2 (transformers gives it no SDPA attention: eager, with
its logits soft-capped) streams the same way: its hand-written attention found in the graph, its eager masks
described."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import streamplan  # noqa: E402
from conftest import TINY_DECODER, rel_err  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = (TINY_DECODER[k] for k in ("hidden_size", "num_attention_heads",
                                                             "num_key_value_heads", "head_dim", "vocab_size"))
WINDOW = 32
N, CHUNK = 200, 64
COMMON = TINY_DECODER
FAMILIES = {   # name -> (model_type, config overrides)
    "llama": ("llama", {}),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                            layer_types=["full_attention", "sliding_attention"])),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", dict(sliding_window=WINDOW)),
    "gemma": ("gemma", {}),
    "gemma3": ("gemma3_text", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
}
CACHE_KW = "cache" if "cache" in __import__("inspect").signature(transformers.LlamaForCausalLM.forward).parameters \
    else "past_key_values"


def _lm(name: str, impl: str = "sdpa", **over):
    model_type, overrides = FAMILIES[name]
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **overrides, **over})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
    with torch.no_grad():   # norms away from one, so a norm applied twice or not at all shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _ids(batch=2, n=N):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(n))


def _padded(ids, left=9, right=13):
    mask = torch.ones_like(ids)
    mask[0, :left] = 0                       # left padding
    if ids.shape[0] > 1 and right:
        mask[1, ids.shape[1] - right:] = 0   # right padding
    return mask


def _cache_of(out):
    found = getattr(out, "cache", None)
    return found if found is not None else out.past_key_values


def _same_cache(a, b) -> None:
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert la.keys.shape == lb.keys.shape and la.values.shape == lb.values.shape
        assert rel_err(la.keys, lb.keys) <= 1e-5 and rel_err(la.values, lb.values) <= 1e-5


def _layers_streamed(handle, layers=2) -> None:
    for i in range(layers):
        name = f"model.layers.{i}"
        notes = " ".join(handle.installed[name].runtime_notes)
        tiers = {str(p.tier) for p in handle.plans.get(name, [])}
        assert tiers and tiers <= {"L1", "L2"} and "ran stock" not in notes, (name, handle.report())


@pytest.mark.parametrize("name", sorted(FAMILIES))
@torch.no_grad()
def test_padded_batch_streams_every_layer_exactly(name):
    """Batch 2, left and right padding, with and without a cache: every layer streams from its graph with its mask
    rows built per Q chunk; logits at every position (padding rows too: fully masked rows are zeros both ways) and the
    cache match stock."""
    model, ids = _lm(name), _ids()
    mask = _padded(ids)
    ref = model(ids, attention_mask=mask, use_cache=True)
    ref_nc = model(ids, attention_mask=mask, use_cache=False).logits
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model(ids, attention_mask=mask, use_cache=True)
    out_nc = model(ids, attention_mask=mask, use_cache=False).logits
    assert rel_err(out.logits, ref.logits) <= 1e-5, rel_err(out.logits, ref.logits)
    assert rel_err(out_nc, ref_nc) <= 1e-5
    _same_cache(_cache_of(out), _cache_of(ref))
    _layers_streamed(handle)
    handle.remove()


@pytest.mark.parametrize("name", ["mistral", "phi3", "qwen2", "gemma3"])
@torch.no_grad()
def test_sliding_window_layers_stream_past_the_window(name):
    """N = 200 rows over a 32-row window, in 24-row chunks: each chunk's keys are cut to the window's span."""
    model, ids = _lm(name), _ids(batch=1)
    ref = model(ids, use_cache=False).logits
    handle = streamplan.apply(model, chunk_tokens=24)
    out = model(ids, use_cache=False).logits
    assert rel_err(out, ref) <= 1e-5, rel_err(out, ref)
    _layers_streamed(handle)
    handle.remove()


@torch.no_grad()
def test_no_mask_over_rows_x_rows_is_built(monkeypatch):
    """The library's SDPA mask function is called for one Q chunk's rows at a time, never for all N (stock: once, for
    [B, 1, N, N]); with the layers left stock (capture off) they get the whole tensor, as stock."""
    from transformers import masking_utils
    model, ids = _lm("mistral"), _ids()
    mask = _padded(ids)
    ref = model(ids, attention_mask=mask, use_cache=False).logits
    real, asked = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"], []

    def spy(**kw):
        asked.append(kw["q_length"])
        return real(**kw)

    monkeypatch.setitem(masking_utils.AttentionMaskInterface._global_mapping, "sdpa", spy)
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    assert rel_err(model(ids, attention_mask=mask, use_cache=False).logits, ref) <= 1e-5
    assert asked and max(asked) == CHUNK, asked
    handle.remove()
    asked.clear()
    handle = streamplan.apply(model, chunk_tokens=CHUNK, capture="off")   # no layer takes row masks
    assert rel_err(model(ids, attention_mask=mask, use_cache=False).logits, ref) <= 1e-5
    assert asked == [N], asked
    handle.remove()


@pytest.mark.parametrize("key_block", [None, 48], ids=["keys whole", "key blocks"])
@pytest.mark.parametrize("left,right", [(9, 13), (0, 0)])
@torch.no_grad()
def test_soft_capped_eager_attention_streams_with_row_masks(left, right, key_block, monkeypatch):
    """Gemma 2: transformers gives it eager attention only (its scores soft-capped, c * tanh(s / c)): the hand-written
    chain is found in the captured graph (``capture/eager_attention.py``) and every layer streams, the sliding layer's
    keys cut to its window, the eager masks built a Q chunk's rows at a time; logits and cache match stock, padding
    rows included (a row that sees no key attends every key evenly, as eager's additive minimum makes it). With key
    blocks of 48 (past that, the soft-capped path merges blocks by their log-sum-exps) the same."""
    if key_block:
        from streamplan.attention import sdpa
        monkeypatch.setattr(sdpa, "SOFTCAP_KEYS", key_block)
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("gemma2", **COMMON, sliding_window=WINDOW, attn_logit_softcapping=5.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():   # scores of a few units: where soft-capping at 5 bends them
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
    ids = _ids()
    mask = _padded(ids, left, right)
    ref = model(ids, attention_mask=mask, use_cache=True)
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model(ids, attention_mask=mask, use_cache=True)
    assert rel_err(out.logits, ref.logits) <= 1e-5, rel_err(out.logits, ref.logits)
    _same_cache(_cache_of(out), _cache_of(ref))
    _layers_streamed(handle)
    notes = " ".join(n for k, e in handle.installed.items() if k.startswith("model.layers.") for n in e.runtime_notes)
    assert "Q chunk's rows at a time" in notes and "sliding window of 32" in notes, handle.report()
    handle.remove()


@torch.no_grad()
def test_soft_capped_eager_attention_in_head_groups():
    """L3 (two head groups, each with its own K/V buffer): padded rows that see no key take each group's own V mean."""
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("gemma2", **COMMON, sliding_window=WINDOW, attn_logit_softcapping=5.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = _ids()
    mask = _padded(ids)
    ref = model(ids, attention_mask=mask, use_cache=False).logits
    handle = streamplan.apply(model, chunk_tokens=CHUNK, head_groups=2)
    out = model(ids, attention_mask=mask, use_cache=False).logits
    assert rel_err(out, ref) <= 1e-5, rel_err(out, ref)
    for i in range(2):
        assert [(str(p.tier), p.head_groups) for p in handle.plans[f"model.layers.{i}"]] == [("L3", 2)], \
            handle.report()
    handle.remove()


@torch.no_grad()
def test_eager_attention_without_soft_capping_streams_through_fused_kernels():
    """Llama with ``attn_implementation="eager"``: the same chain without tanh becomes an attention the SDPA consumer
    runs on its fused kernels; padded batch, logits as stock's."""
    model, ids = _lm("llama", impl="eager"), _ids()
    mask = _padded(ids)
    ref = model(ids, attention_mask=mask, use_cache=False).logits
    handle = streamplan.apply(model, chunk_tokens=CHUNK)
    out = model(ids, attention_mask=mask, use_cache=False).logits
    assert rel_err(out, ref) <= 1e-5, rel_err(out, ref)
    _layers_streamed(handle)
    handle.remove()


@torch.no_grad()
def test_soft_capped_peak_has_no_rows_x_rows_tensor():
    """Gemma 2 at 2,048 rows, batch 1, 128-row chunks: stock builds the [1, 1, N, N] eager mask and every layer's
    [1, H, N, N] scores; streamed, the peak stays near the floor (residual + K + V) with one chunk's mask rows and one
    piece of scores."""
    torch.manual_seed(0)
    n = 2048
    cfg = transformers.AutoConfig.for_model("gemma2", **COMMON, sliding_window=WINDOW, attn_logit_softcapping=50.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = _ids(batch=1, n=n)
    call = lambda: model(ids, use_cache=False, logits_to_keep=1)  # noqa: E731
    ref, stock_peak = streamplan.measure_peak(call)
    handle = streamplan.apply(model, chunk_tokens=128)
    out, peak = streamplan.measure_peak(call)
    assert rel_err(out.logits, ref.logits) <= 1e-5
    _layers_streamed(handle)
    floor = n * (HIDDEN + 2 * KV_HEADS * HEAD_DIM) * 4
    scores = HEADS * 128 * n * (2 * 4 + 4)    # one chunk's scores, their fp32 softmax and its cast (one piece here)
    mask_rows = 128 * n * 4
    assert stock_peak > n * n * 4 * HEADS, (stock_peak / floor)       # stock: the scores over rows x rows
    assert peak <= 1.5 * floor + scores + mask_rows, (peak / floor, stock_peak / floor)
    assert stock_peak > 10 * peak
    plan = handle.plans["model.layers.0"][0]
    assert plan.predicted_total >= 0.9 * peak, (plan.predicted_total / peak)   # the scores are in the plan
    handle.remove()


@torch.no_grad()
def test_soft_capped_layers_held_to_a_budget_stay_within_it(monkeypatch):
    """Gemma 2 under a budget of four floors (tiny widths: a chunk's mask rows weigh more): the soft-capped pieces
    shrink with the planner's chunk (``sdpa.softcap_scores``; their fixed size made the smallest reachable peak many
    times the floor), rows that see no key take V's mean without a whole fp32 copy of V, and the measured peak stays
    in the budget."""
    from streamplan.attention import sdpa
    monkeypatch.setattr(sdpa, "SOFTCAP_MIN_SCORES", 1 << 12)   # the tiny model's chunks: pieces of their own size
    torch.manual_seed(0)
    n = 4096
    cfg = transformers.AutoConfig.for_model("gemma2", **COMMON, sliding_window=WINDOW, attn_logit_softcapping=50.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = _ids(batch=1, n=n)
    mask = torch.ones_like(ids)
    mask[:, :7] = 0   # left padding: rows that see no key
    call = lambda: model(ids, attention_mask=mask, use_cache=False, logits_to_keep=1)  # noqa: E731
    ref = call()
    floor = n * (HIDDEN + 2 * KV_HEADS * HEAD_DIM) * 4
    budget = ids.numel() * 16 + 4 * floor
    handle = streamplan.apply(model, budget=budget)
    call()   # the capture, outside the measurement
    out, peak = streamplan.measure_peak(call)
    assert rel_err(out.logits, ref.logits) <= 1e-5
    _layers_streamed(handle)
    assert peak <= budget, (peak / floor, budget / floor, handle.report())
    handle.remove()


@pytest.mark.parametrize("name", ["llama", "mistral"])
@torch.no_grad()
def test_padded_peak_is_near_the_floor(name):
    """Batch 2 with left padding, 4096 rows, no cache: Llama's mask is padding and causality alone, so each batch
    element attends its own keys with no mask rows at all; Mistral's window builds each chunk's rows against the
    window's keys only ([B, chunk, chunk + window], counted in the plan). Stock builds [B, 1, N, N]."""
    n, chunk = 4096, 64
    model, ids = _lm(name), _ids(n=n)
    mask = _padded(ids, left=100, right=0)
    call = lambda: model(ids, attention_mask=mask, use_cache=False, logits_to_keep=1)  # noqa: E731
    ref, stock_peak = streamplan.measure_peak(call)
    handle = streamplan.apply(model, chunk_tokens=chunk)
    out, peak = streamplan.measure_peak(call)
    assert rel_err(out.logits, ref.logits) <= 1e-5
    _layers_streamed(handle)
    floor = 2 * n * (HIDDEN + 2 * KV_HEADS * HEAD_DIM) * 4            # residual + K + V, float32, batch 2
    rope = n * 2 * HEAD_DIM * 4 + n * 8
    mask_rows = 0 if name == "llama" else 2 * chunk * (chunk + WINDOW) * (1 + 4)
    assert peak <= floor + rope + mask_rows + floor / 2, (peak / floor, stock_peak / floor)
    assert stock_peak > 4 * peak, (peak / floor, stock_peak / floor)
    handle.remove()


@torch.no_grad()
def test_a_layer_given_a_mask_over_rows_x_rows_takes_its_query_rows_per_chunk():
    """A captured block called with a [B, 1, N, N] mask tensor (here transformers' own padded causal mask, handed to
    a lone decoder layer): each Q chunk attends with the mask's rows for its queries, keys whole; exact."""
    model, ids = _lm("llama"), _ids()
    mask2d = _padded(ids)
    layer = model.model.layers[0]
    hidden = model.model.embed_tokens(ids)
    pos = torch.arange(N).unsqueeze(0)
    from transformers.masking_utils import create_causal_mask
    mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=mask2d, position_ids=pos,
                              **{CACHE_KW: None})
    assert mask.shape == (2, 1, N, N)
    rope = model.model.rotary_emb(hidden, pos)
    ref = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=pos)
    handle = streamplan.apply(layer, chunk_tokens=CHUNK, capture="prefer")
    out = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=pos)
    ref, out = (o[0] if isinstance(o, tuple) else o for o in (ref, out))
    assert rel_err(out, ref) <= 1e-5
    assert [p.tier for p in handle.plans[""]] == ["L1"], handle.report()
    handle.remove()
