"""Wan Animate 2's block on a generation step (``kv_cache_mode="cached"``, a flex ``BlockMask``) streams from its
captured graph: its mask described over the rows and the reference keys (``integrations.diffusers.flex``), exact
against the real block's and the real model's forward (fp32, CPU), its peak measured below stock's and within a
budget; the reference pass, a mask the model did not make and other modules keep what they had."""
import pytest
import torch

from conftest import rel_err, streamed

pytest.importorskip("diffusers")

import streamplan  # noqa: E402
from streamplan.integrations.diffusers.flex import describe_generation_step  # noqa: E402
from streamplan.tools.catalogue.diffusers_cases import CASES, T, _cls  # noqa: E402

CPU = torch.device("cpu")


def _block(rows: int):
    case = CASES["wan_animate2"]
    torch.manual_seed(0)
    block = case.build()
    args, kwargs = case.inputs(rows, CPU, torch.float32)
    return block, args, kwargs


def _shorter_segment(kwargs: dict, rows: int) -> dict:
    """The call as a segment of a longer video makes it: the model's mask for 6 frames (5 of reference) over the
    case's 4, and a reference grid one line narrower than the frames (each reference frame padded with zeros)."""
    hw = rows // 4
    model = _cls(T + "transformer_wan_animate_2:WanAnimate2Transformer3DModel")
    return {**kwargs, "attention_mask": model.create_mask(None, 5, hw, "cpu"), "origin_latent_frames": 5,
            "reference_grid_sizes": torch.tensor([[3, hw // 10 - 1, 10]])}


@torch.no_grad()
def test_generation_step_streams_from_its_captured_graph_exactly():
    block, args, kwargs = _block(800)
    ref, stock = streamplan.measure_peak(block, *args, **kwargs)
    with streamed(block, chunk_tokens=128) as handle:
        out, peak = streamplan.measure_peak(block, *args, **kwargs)
        report = handle.report()
        plan = handle.plans[""][0]
    assert "captured diffusers.WanAnimate2TransformerBlock" in report and plan.tier == "L1", report
    assert plan.chunk == 128 and "its flex BlockMask described over its rows and the 641 keys after them" in report
    assert rel_err(out, ref) <= 1e-5
    assert peak < 0.25 * stock, (peak, stock)   # measured 0.16x: one chunk's uncompiled flex scores, not every row's


@torch.no_grad()
def test_a_segment_of_a_longer_video_attends_the_padding_keys_stock_attends():
    """Stock packs 800 rows into the 6-frame mask's buffer and every query row attends the 400 zero keys after them
    (the mask's valid rows run to 6 frames): the described mask stands one zero key for them, scored by their log
    count; the narrower reference frames keep their zeros where the processor puts them."""
    block, args, kwargs = _block(800)
    kwargs = _shorter_segment(kwargs, 800)
    ref, stock = streamplan.measure_peak(block, *args, **kwargs)
    with streamed(block, chunk_tokens=128) as handle:
        out, peak = streamplan.measure_peak(block, *args, **kwargs)
        report = handle.report()
    assert "described over its rows and the 1025 keys after them" in report, report
    assert rel_err(out, ref) <= 1e-5
    assert peak < 0.15 * stock, (peak, stock)


@torch.no_grad()
def test_a_budget_is_held_with_the_described_mask_priced():
    block, args, kwargs = _block(1600)
    ref, stock = streamplan.measure_peak(block, *args, **kwargs)
    budget = stock // 4
    with streamed(block, budget=budget) as handle:
        out, peak = streamplan.measure_peak(block, *args, **kwargs)
        plan = handle.plans[""][0]
        report = handle.report()
    assert plan.tier != "L0" and peak <= budget, (peak, budget, report)
    assert rel_err(out, ref) <= 1e-5


@torch.no_grad()
def test_the_whole_model_streams_its_generation_step_exactly():
    """A tiny WanAnimate2Transformer3DModel as its pipeline runs it: the reference pass fills the cache (its blocks
    stock, named: they write it), then a generation step over a segment of a longer video, every block streamed."""
    model_cls = _cls(T + "transformer_wan_animate_2:WanAnimate2Transformer3DModel")
    cache_cls = _cls(T + "transformer_wan_animate_2:WanAnimate2KVCache")
    torch.manual_seed(0)
    model = model_cls(in_dim=8, dim=64, ffn_dim=128, freq_dim=32, text_dim=32, text_len=16, out_dim=4, num_heads=4,
                      num_layers=2).eval()
    lat = lambda frames: torch.randn(4, frames, 16, 20)   # noqa: E731 -- 8 x 10 = 80 rows a frame
    text, ref_grid = [torch.randn(5, 32)], torch.tensor([[3, 8, 10]])
    image = torch.randn(1, 257, 1280)

    def run(cache):
        model(hidden_states=[lat(3)], timestep=torch.tensor([500.0]), encoder_hidden_states=text,
              condition_latents=[lat(3)], kv_cache=cache, kv_cache_mode="extract", seq_len=240,
              encoder_hidden_states_image=image, offset_grid_sizes=ref_grid)
        return model(hidden_states=[lat(5)], timestep=torch.tensor([700.0]), encoder_hidden_states=text,
                     condition_latents=[lat(5)], kv_cache=cache, kv_cache_mode="cached", seq_len=400,
                     encoder_hidden_states_image=image, reference_grid_sizes=ref_grid, origin_len=20,
                     origin_area=[128, 160]).sample[0]

    with torch.no_grad():
        torch.manual_seed(1)
        ref, stock = streamplan.measure_peak(lambda: run(cache_cls(2)))
        budget = stock // 2
        with streamed(model, budget=budget) as handle:
            torch.manual_seed(1)
            out, peak = streamplan.measure_peak(lambda: run(cache_cls(2)))
            report = handle.report()
            tiers = {name: [p.tier for p in handle.plans[name]] for name in ("blocks.0", "blocks.1")}
    assert "CacheWritten" in report, report   # the reference pass: each block fills its cache, stock
    assert all("L1" in t for t in tiers.values()), report
    assert report.count("its flex BlockMask described over its rows and the") == 2, report
    assert rel_err(out, ref) <= 1e-5
    assert peak <= budget, (peak, budget, stock)   # both passes under the budget


@torch.no_grad()
def test_the_reference_pass_is_left_to_the_capture_which_names_the_cache_it_fills():
    block, args, kwargs = _block(400)
    args = (*args[:4], "extract", *args[5:])   # the reference pass: it fills its cache, with no BlockMask
    kwargs = {**kwargs, "attention_mask": None}
    assert describe_generation_step(block, args, kwargs) is None
    ref = block(*args, **kwargs)
    cache = args[3]
    with streamed(block, chunk_tokens=128) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
        parts = {part: handle.plans[part][0].tier for part in ("cross_attn", "ffn")}
    assert "CacheWritten: the block sets WanAnimate2KVLayerCache.key (a cache being filled)" in report, report
    assert torch.equal(out, ref) and cache.key is not None
    assert set(parts.values()) == {"L1"}, report   # the block ran stock (a cache filled): its unknown parts streamed


@torch.no_grad()
def test_a_mask_the_model_did_not_make_keeps_the_block_stock_named_and_its_parts_streamed():
    from torch.nn.attention.flex_attention import create_block_mask
    block, args, kwargs = _block(800)
    given = kwargs["attention_mask"]
    kwargs["attention_mask"] = create_block_mask(lambda b, h, q, kv: given.mask_mod(b, h, q, kv), None, None,
                                                 *given.seq_lengths, device="cpu")
    ref = block(*args, **kwargs)
    with streamed(block, chunk_tokens=128) as handle:
        out = block(*args, **kwargs)
        report = handle.report()
        self_attn = handle.plans["self_attn"][0].tier
    assert "ran stock: its BlockMask is not the one WanAnimate2Transformer3DModel.create_mask makes" in report, report
    assert self_attn == "L1" and torch.equal(out, ref), report   # the part's chunks: stock's softmax per query row


def test_other_calls_are_not_claimed():
    block, args, kwargs = _block(400)
    assert describe_generation_step(torch.nn.Linear(4, 4), args, kwargs) is None
    described = describe_generation_step(block, args, kwargs)
    assert isinstance(described, tuple), described
    assert described[0][6] == (10, 10) and described[1]["reference_grid_sizes"] == (3, 10, 10)
    assert type(described[1]["attention_mask"]).__name__ == "RowMask"


def test_the_described_masks_block_tables_cover_every_key_it_lets_through():
    """Compiled flex visits only the listed key blocks, and skips mask_mod on full ones (uncompiled flex, the CPU's,
    decides every element by mask_mod alone, so the exactness tests above cannot see a table's fault): every block
    holding a key the described mask lets a row see is listed, and a block listed full lets every row see every key."""
    from streamplan.integrations.diffusers.flex import _BLOCK_ARGS, _compact_mask, _layout, _mask_limits
    from streamplan.recognize.checks import call_args
    block, args, kwargs = _block(800)
    for kw in (kwargs, _shorter_segment(kwargs, 800)):
        call = call_args(_BLOCK_ARGS, args, kw)
        bm, lay = call["attention_mask"], _layout(call, 800)
        flex, _ = _compact_mask(bm, lay, 800, _mask_limits(bm))
        mask = flex.block_mask
        keys = mask.seq_lengths[1]
        q, kv = torch.arange(800)[:, None], torch.arange(keys)[None, :]
        seen = mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv)   # [rows, keys]
        qb, kb = mask.BLOCK_SIZE
        pad = torch.zeros(-(-800 // qb) * qb, -(-keys // kb) * kb, dtype=torch.bool)
        pad[:800, :keys] = seen
        any_seen = pad.unflatten(0, (-1, qb)).unflatten(2, (-1, kb)).any(3).any(1)   # [q blocks, kv blocks]
        listed = torch.zeros_like(any_seen)
        full = torch.zeros_like(any_seen)
        for i in range(any_seen.shape[0]):
            listed[i, mask.kv_indices[0, 0, i, :mask.kv_num_blocks[0, 0, i]].long()] = True
            full[i, mask.full_kv_indices[0, 0, i, :mask.full_kv_num_blocks[0, 0, i]].long()] = True
        assert not (any_seen & ~(listed | full)).any()
        for i, j in full.nonzero().tolist():
            rows_i = slice(i * qb, min((i + 1) * qb, 800))
            assert seen[rows_i, j * kb:(j + 1) * kb].all(), (i, j)
        assert full.any() and listed.any()
