"""One rank of the context-parallel tests (``test_context_parallel.py`` starts two, torchrun-style, on gloo).

Each case builds a tiny random-weight diffusers model (the same seed on every rank), runs it in this one process
without parallelism (the reference), enables diffusers' context parallelism (Ulysses over the ranks), runs it stock
under CP, applies streamplan and runs it again; peaks measured with ``streamplan.measure_peak``. Results go to
``$CP_OUT/rank<r>.json``."""
from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def _wan():
    from diffusers import WanTransformer3DModel
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                  out_channels=4, text_dim=32, freq_dim=32, ffn_dim=256, num_layers=2,
                                  rope_max_seq_len=64).eval()
    g = torch.Generator().manual_seed(1)
    kw = dict(hidden_states=torch.randn(1, 4, 4, 64, 64, generator=g), timestep=torch.tensor([500]),
              encoder_hidden_states=torch.randn(1, 8, 32, generator=g), return_dict=False)
    return model, kw, lambda out: {"sample": out[0]}


def _flux():
    from diffusers import FluxTransformer2DModel
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                   pooled_projection_dim=24, axes_dims_rope=(4, 6, 6)).eval()
    g = torch.Generator().manual_seed(1)
    n, t = 1024, 16
    kw = dict(hidden_states=torch.randn(1, n, 16, generator=g),
              encoder_hidden_states=torch.randn(1, t, 32, generator=g),
              pooled_projections=torch.randn(1, 24, generator=g), timestep=torch.tensor([0.5]),
              img_ids=torch.randint(0, 8, (n, 3), generator=g).float(), txt_ids=torch.zeros(t, 3), return_dict=False)
    return model, kw, lambda out: {"sample": out[0]}


def _h3():
    from diffusers import MiniMaxH3Transformer3DModel
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=4, attention_head_dim=16, hidden_size=64, num_layers=2, num_refiner_layers=1,
        ffn_dim=256, in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=48, freq_dim=32,
        time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=2).eval()
    g = torch.Generator().manual_seed(1)
    text, cond, audio, target = 24, 40, 30, 930          # 1024 packed rows
    n = text + cond + audio + target
    tags = torch.zeros(n, dtype=torch.long)
    tags[:text], tags[text + cond:text + cond + audio] = 1, 2
    ts_idx = torch.zeros(n, dtype=torch.long)
    ts_idx[text + cond:] = 1
    kw = dict(hidden_states=torch.randn(1, cond + target, 16, generator=g),
              audio_hidden_states=torch.randn(1, audio, 8, generator=g),
              encoder_hidden_states=torch.randn(1, text, 48, generator=g), timestep=torch.tensor([0.0, 0.7]),
              timestep_indices=ts_idx, token_tags=tags, position_ids=torch.randint(0, 8, (n, 3), generator=g),
              video_indices=torch.cat([torch.arange(text, text + cond), torch.arange(text + cond + audio, n)]),
              audio_indices=torch.arange(text + cond, text + cond + audio), text_indices=torch.arange(0, text),
              return_dict=False)
    return model, kw, lambda out: {"sample": out[0], "audio": out[1]}


CASES = {"wan": (_wan, 128), "flux": (_flux, 128), "h3": (_h3, 128)}


def _peak(fn):
    """(result, peak) of the lower of two measured runs: the allocations are the same each run, and a CPU run under
    load sometimes counts a transient that is not the call's."""
    import streamplan
    out, first = streamplan.measure_peak(fn)
    out, second = streamplan.measure_peak(fn)
    return out, min(first, second)


def _case(name: str, world: int) -> dict:
    import streamplan
    from diffusers import ContextParallelConfig
    make, chunk = CASES[name]
    torch.manual_seed(0)
    model, kw, outputs = make()
    with torch.no_grad():
        ref = outputs(model(**kw))
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        cp, cp_peak = _peak(lambda: outputs(model(**kw)))
        handle = streamplan.apply(model, chunk_tokens=chunk)
        model(**kw)   # captures (once per block class), outside the measurement
        out, peak = _peak(lambda: outputs(model(**kw)))
    plans = {k: [p.to_dict() for p in v] for k, v in handle.plans.items()}
    return dict(rel={k: _rel(out[k], ref[k]) for k in ref}, cp_rel={k: _rel(cp[k], ref[k]) for k in ref},
                peak=peak, cp_peak=cp_peak, plans=plans, report=handle.report(),
                notes={k: e.runtime_notes for k, e in handle.installed.items()})


def _mismatch(world: int, rank: int) -> dict:
    """Ranks asked for different chunks: the plan check raises on every rank instead of hanging."""
    import streamplan
    from diffusers import ContextParallelConfig
    from streamplan.execute.sequence_parallel import PlanMismatch
    torch.manual_seed(0)
    model, kw, _ = _wan()
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    streamplan.apply(model, chunk_tokens=64 * (rank + 1))
    try:
        with torch.no_grad():
            model(**kw)
    except PlanMismatch as exc:
        return dict(raised=str(exc))
    return dict(raised=None)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    # diffusers' enable_parallelism picks the device as rank % torch.accelerator.device_count(), which is 0 on a
    # CPU-only machine: this test process has one "device", the CPU
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name in sys.argv[1:]:
        try:
            results[name] = _mismatch(world, rank) if name == "mismatch" else _case(name, world)
        except Exception:
            results[name] = dict(error=traceback.format_exc())
            break   # the other rank may be waiting in a collective: stop, the test reports this error
    with open(os.path.join(os.environ["CP_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
