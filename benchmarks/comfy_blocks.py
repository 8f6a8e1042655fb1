"""Each block call measured inside a whole ComfyUI model call (``gpu_comfy.py --blocks``): the issue's criterion is of
the block, not of ``apply_model`` (whose patch embedding, head and rope table are the model forward's).

A probe sits in the clone's "dit" block replacements: on a streamplan clone each ``StreamedBlock`` is swapped for a
subclass that measures around it (so the model forward still donates its input and ``report`` still finds it); on the
stock patcher a pass-through replacement that calls ``original_block`` (the same block call the stock forward makes).
Per call: the peak above what was allocated at the block's entry (``streamplan.measure_peak``: the CUDA allocator's
counters, the profiler on CPU), the block's seconds (synchronised around the call, in calls without the meter), whether
its input was donated, and the plan the streamer used."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

import streamplan
from streamplan.integrations.comfy import block_keys
from streamplan.integrations.comfy.patch import StreamedBlock
from streamplan.execute.donation import donated


class BlockProbe:
    """What the probed block calls measured. ``mode``: "peak" (the meter around each call) or "time"."""

    def __init__(self, device: torch.device):
        self.device, self.mode = device, "peak"
        self.peaks: list[dict] = []
        self.times: list[float] = []

    def measure(self, run: Callable[[], Any], img: torch.Tensor) -> Any:
        if self.mode == "time":
            self._sync()
            t0 = time.perf_counter()
            out = run()
            self._sync()
            self.times.append(time.perf_counter() - t0)
            return out
        residual = img.numel() * img.element_size()
        given = donated(img)
        out, peak = streamplan.measure_peak(run, device=self.device)
        self.peaks.append({"peak": peak, "donated": given, "residual": residual})
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _Metered(StreamedBlock):
    """A streamplan block replacement measured by ``probe`` (a subclass: the model forward donates to it and
    ``streamplan.integrations.comfy.report`` reads it as the replacement it wraps)."""

    def __init__(self, inner: StreamedBlock, probe: BlockProbe):
        super().__init__(inner.state, inner.key, inner.list_name)
        self.probe = probe

    def __call__(self, args: dict, extra: dict) -> dict:
        return self.probe.measure(lambda: StreamedBlock.__call__(self, args, extra), args["img"])


class _StockProbe:
    """The stock block call (``original_block``, as the model forward makes it without replacements), measured."""

    def __init__(self, probe: BlockProbe):
        self.probe = probe

    def __call__(self, args: dict, extra: dict) -> dict:
        return self.probe.measure(lambda: extra["original_block"](args), args["img"])


def probed(patcher, device: torch.device):
    """(a clone of ``patcher`` whose block calls are measured, its probe): streamplan's replacements wrapped, or a
    pass-through replacement per block where the patcher has none."""
    probe = BlockProbe(device)
    clone = patcher.clone()
    dit = clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for key, _, _ in block_keys(clone.model.diffusion_model):
        held = dit.get(key)
        if isinstance(held, StreamedBlock):
            dit[key] = _Metered(held, probe)
        elif held is None:
            clone.set_model_patch_replace(_StockProbe(probe), "dit", key[0], key[1])
    return clone, probe


def plans_of(patched) -> list[dict]:
    """The plans streamplan's block streamers made in ``patched`` (tier, chunk, predicted peak above the live inputs,
    the budget the planner had)."""
    from streamplan.integrations.comfy.patch import _states
    out = []
    for st in _states(patched):
        for key, b in st.blocks.items():
            if b.streamer is None:
                continue
            for plans in b.streamer.handle.plans.values():
                out += [{"block": f"{key[0]}.{key[1]}", "tier": str(p.tier), "chunk": p.chunk,
                         "predicted_above_inputs": p.predicted_peak, "live_inputs": p.live_bytes,
                         "planner_budget": p.budget} for p in plans]
    return out


def block_figures(patcher, call: Callable[[Any], Any], device: torch.device, floor: int, repeats: int = 2) -> dict:
    """Through ``patcher`` with probes (``call(patcher)`` makes one model call): one call with each block call metered,
    then ``repeats`` timed calls (the model call and its block calls, each synchronised; medians). The largest block
    peak above its entry, also over ``floor``, and with the donated residual added (what the block holds with its
    input, which it overwrites)."""
    clone, probe = probed(patcher, device)
    call(clone)
    probe.mode = "time"
    blocks, whole = [], []
    for _ in range(repeats):
        probe.times.clear()
        probe._sync()
        t0 = time.perf_counter()
        call(clone)
        probe._sync()
        whole.append(time.perf_counter() - t0)
        blocks.append(sum(probe.times))   # every block call of the model call, summed
    worst = max(probe.peaks, key=lambda p: p["peak"])
    with_residual = worst["peak"] + (worst["residual"] if worst["donated"] else 0)
    return {"block_calls": len(probe.peaks), "block_peak_above_entry": worst["peak"],
            "block_peak_vs_floor": worst["peak"] / floor, "block_input_donated": worst["donated"],
            "block_peak_with_donated_residual_vs_floor": with_residual / floor,
            "block_time_s": statistics.median(blocks), "call_time_s": statistics.median(whole)}


def kitchen_backends() -> dict:
    """Which comfy_kitchen backends serve here (the rotary and norm ops inside the blocks are its custom ops, opaque to
    the capture's memory model: a fused CUDA kernel allocates only its output, the eager reference fp32 copies of its
    input too, which no plan charges)."""
    try:
        import comfy_kitchen
    except ImportError as exc:
        return {"error": str(exc)}
    return {name: ("available" if b.get("available") and not b.get("disabled") else
                   f"unavailable: {b.get('unavailable_reason') or 'disabled'}")
            for name, b in comfy_kitchen.list_backends().items()}
