"""peft's LoRA layers inside a block are captured with it: A, B and the scale in the graph. What the layer's forward
reads besides its public settings (``scaling``, ``merged_adapters``, which the capture key already holds) is declared
here, so a block whose adapters are switched off or switched to another gets its own capture, never a stale one."""
from __future__ import annotations

from ..registries import register_capture_state

register_capture_state("_disable_adapters", "_active_adapter")
