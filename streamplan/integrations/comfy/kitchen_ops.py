"""comfy_kitchen (ComfyUI's fused kernels): the custom ops its DiT blocks call, declared row-local for the
captured-graph analysis. Each was read in comfy_kitchen's eager reference (backends/eager): rotary applies a row's own
table row to that row; the norms normalise a row's features and modulate them elementwise."""
from __future__ import annotations

from ...registries import register_row_local_op

# the in-place forms (``_``) write the same rows into their q and k arguments (MiniMax-H3's DiTBlock at inference);
# the analysis checks those are per-call values with rows
for _name in ("apply_rope1", "apply_rope", "rms_rope_split_half1", "rms_rope_split_half", "rms_rope_split_half1_",
              "rms_rope_split_half_"):
    register_row_local_op("comfy_kitchen", _name, "rows")
for _name in ("rms_adaln", "adaln"):
    register_row_local_op("comfy_kitchen", _name, "norm")
