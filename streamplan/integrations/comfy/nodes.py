"""The ComfyUI nodes (V3 schema, ``comfy_api.latest``): "Stream Blocks" patches a MODEL so its diffusion-model blocks
stream (``streamplan.integrations.comfy.patch``) and returns the patched MODEL with a report of the settings and blocks;
"Stream Report" reads, after a sampler has run, what each block did (streamed, with which plan and whose attention, or
stock and why). Both hand their report out as a STRING output (index 1, after the MODEL or LATENT they pass on): the
frontend shows text only in text nodes, so a workflow wires it to ComfyUI's core "Preview as Text" (``PreviewAny``).

``stream_blocks`` and ``stream_report`` are the nodes' whole behaviour as plain functions; the node classes are built
when ComfyUI's ``comfy_api`` imports (``comfy_entrypoint``, ``node_classes``)."""
from __future__ import annotations

from .patch import patch, report

NODE_ID = "StreamplanStreamBlocks"
DISPLAY_NAME = "Stream Blocks (streamplan)"
REPORT_NODE_ID = "StreamplanStreamReport"
REPORT_DISPLAY_NAME = "Stream Report (streamplan)"
CATEGORY = "advanced/model"
REPORT_TOOLTIP = 'the report as text: wire it to "Preview as Text" (PreviewAny) to read it in the browser'


DESCRIPTION = (
    "Runs every block of the diffusion model over the sequence in row chunks once a call has at least min_tokens rows: "
    "the same math, with the block's K and V for all rows and one chunk's work alive instead of the whole sequence's "
    "intermediates. For Wan, MiniMax-H3, Flux, HunyuanVideo and LTX-Video the model's input projection and output "
    "head run in row chunks too. Weights stay ComfyUI's: under lowvram (weights offloaded, cast to the GPU per call), "
    "DynamicVRAM (weights faulted in and evicted on demand) and LoRA applied per call, each layer's weight is taken "
    "once per block call through ComfyUI's own cast and patch path (the patched weight, not the LoRA math again per "
    "chunk) and released when the block returns; quantized layers (fp8, ...) take row chunks only. Each chunk attends "
    "through ComfyUI's optimized_attention (so --use-sage-attention, and attention functions nodes set on the model, "
    "still apply). What cannot stream (attention patches, overrides that may need every query row at once outside "
    "MiniMax-H3, unknown forwards, custom ops with per-call patches) runs stock; the report says which and why.")
BUDGET_TOOLTIP = (
    '"auto": plan each block within what ComfyUI reports free on the device, less --reserve-vram and reserve '
    '(weights DynamicVRAM could evict are not counted as free); where that holds no plan, the block streams at '
    'the smallest peak it can reach instead of failing (ComfyUI evicts weights for it as for the stock block), '
    'and the report says so. A size ("12GiB"): for Wan, MiniMax-H3, Flux, HunyuanVideo, LTX-Video and LTX-2 '
    '(chunk_tokens 0) a ceiling on the memory the whole model call adds above what was allocated when it began '
    "(its rows, tables and every block's work; ComfyUI's weights outside it), planned before it runs: an error "
    'before any block runs if it cannot fit, naming the smallest size that does; for other models a ceiling on '
    "the memory a block adds above what it holds when entered (its inputs and ComfyUI's weights), an error before"
    ' that block runs if it cannot fit. Per-call weight copies (lowvram, DynamicVRAM, LoRA) are paid from it. '
    '"none": no planning, every long enough call at chunk_tokens (or the default chunk).')


KV_CHOICES = ("device", "host", "int8", "fp8")
KV_TOOLTIP = ('where a streamed block keeps its K and V between its phases: "device" (exact; below that floor on a '
              'GPU the planner stages them to the host where ComfyUI attends with PyTorch attention), "host" (exact, '
              'always staged to pinned host memory), "int8"/"fp8" (compressed: approximate, the error in the report)')


def _budget(text: str):
    text = (text or "").strip()
    if text.lower() in ("", "auto"):
        return "auto"
    if text.lower() == "none":
        return None
    return text


def stream_blocks(model, budget: str = "auto", chunk_tokens: int = 0, min_tokens: int = 4096, reserve: str = "",
                  self_check: bool = False, kv: str = "device"):
    """(patched clone, report text). ``budget``: "auto", "none" (stream every long enough call at the default
    chunk) or a size ("12GiB"); ``chunk_tokens`` 0 lets the planner choose; ``reserve`` "" keeps the library
    default; ``kv``: ``patch``'s."""
    patched = patch(model, _budget(budget), chunk_tokens or None, min_tokens=min_tokens,
                    reserve=(reserve.strip() or None) if isinstance(reserve, str) else reserve,
                    self_check=self_check, kv=kv)
    return patched, report(patched)


def stream_report(model, samples=None):
    """(``samples`` unchanged, the report text of a MODEL that "Stream Blocks" patched). ``samples`` is the sampler's
    output: wiring it in makes ComfyUI run this after the sampler, so the report covers that run."""
    return samples, report(model)


def node_classes():
    """The node classes (imports ``comfy_api``: call it inside ComfyUI or a test that has it)."""
    from comfy_api.latest import io

    class StreamBlocks(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id=NODE_ID,
                display_name=DISPLAY_NAME,
                category=CATEGORY,
                description=DESCRIPTION,
                inputs=[
                    io.Model.Input("model"),
                    io.String.Input("budget", default="auto", tooltip=BUDGET_TOOLTIP),
                    io.Int.Input("chunk_tokens", default=0, min=0, max=1 << 24, step=256,
                                 tooltip="rows per chunk, fixed (the budget is then not planned); 0 lets the planner "
                                         "choose from the budget"),
                    io.Int.Input("min_tokens", default=4096, min=0, max=1 << 24, step=256,
                                 tooltip="shorter calls run the stock block"),
                    io.String.Input("reserve", default="",
                                    tooltip='kept free under budget "auto", beside --reserve-vram ("2GiB"); '
                                            'empty: 512MiB'),
                    io.Boolean.Input("self_check", default=False,
                                     tooltip="run the first streamed call stock too and report the difference"),
                    io.Combo.Input("kv", options=list(KV_CHOICES), default="device", optional=True,
                                   tooltip=KV_TOOLTIP),
                ],
                outputs=[io.Model.Output(display_name="model"),
                         io.String.Output(display_name="report", tooltip=REPORT_TOOLTIP)],
            )

        @classmethod
        def execute(cls, model, budget="auto", chunk_tokens=0, min_tokens=4096, reserve="", self_check=False,
                    kv="device"):
            patched, text = stream_blocks(model, budget, chunk_tokens, min_tokens, reserve, self_check, kv)
            return io.NodeOutput(patched, text)

    class StreamReport(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id=REPORT_NODE_ID,
                display_name=REPORT_DISPLAY_NAME,
                category=CATEGORY,
                description=("What each block of a streamed MODEL did in the runs so far: streamed (plan, chunk, "
                             "predicted peak, who attended the chunks) or stock and why. Wire the sampler's output "
                             "through it so it runs after the sampler, and its report output to \"Preview as Text\" "
                             "to read it."),
                inputs=[io.Model.Input("model", tooltip='the MODEL output of "Stream Blocks"'),
                        io.Latent.Input("samples", tooltip="the sampler's output (passed through unchanged)")],
                outputs=[io.Latent.Output(display_name="samples"),
                         io.String.Output(display_name="report", tooltip=REPORT_TOOLTIP)],
                is_output_node=True,
                not_idempotent=True,
            )

        @classmethod
        def execute(cls, model, samples):
            samples, text = stream_report(model, samples)
            # ui: the text in the prompt's history (/history) for API clients; the browser shows it through the
            # report output and "Preview as Text"
            return io.NodeOutput(samples, text, ui={"text": [text]})

    return [StreamBlocks, StreamReport]


async def comfy_entrypoint():
    from comfy_api.latest import ComfyExtension

    classes = node_classes()

    class StreamplanExtension(ComfyExtension):
        async def get_node_list(self):
            return classes

    return StreamplanExtension()
