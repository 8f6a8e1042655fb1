"""The ComfyUI nodes (V3 schema, ``comfy_api.latest``): "Stream Blocks" patches a MODEL so its diffusion-model
blocks stream (``streamplan.comfy.patch``) and returns the patched MODEL with a report of the settings and blocks;
"Stream Report" reads, after a sampler has run, what each block did (streamed, with which plan and whose attention,
or stock and why).

``stream_blocks`` and ``stream_report`` are the nodes' whole behaviour as plain functions; the node classes are built
when ComfyUI's ``comfy_api`` imports (``comfy_entrypoint``, ``node_classes``)."""
from __future__ import annotations

from .patch import patch, report

NODE_ID = "StreamplanStreamBlocks"
DISPLAY_NAME = "Stream Blocks (streamplan)"
REPORT_NODE_ID = "StreamplanStreamReport"
REPORT_DISPLAY_NAME = "Stream Report (streamplan)"
CATEGORY = "advanced/model"


def _budget(text: str):
    text = (text or "").strip()
    if text.lower() in ("", "auto"):
        return "auto"
    if text.lower() == "none":
        return None
    return text


def stream_blocks(model, budget: str = "auto", chunk_tokens: int = 0, min_tokens: int = 4096, reserve: str = "",
                  self_check: bool = False):
    """(patched clone, report text). ``budget``: "auto", "none" (stream every long enough call at the default
    chunk) or a size ("12GiB"); ``chunk_tokens`` 0 lets the planner choose; ``reserve`` "" keeps the library
    default."""
    patched = patch(model, _budget(budget), chunk_tokens or None, min_tokens=min_tokens,
                    reserve=(reserve.strip() or None) if isinstance(reserve, str) else reserve,
                    self_check=self_check)
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
                description=("Runs every block of the diffusion model over the sequence in row chunks (same math, "
                             "less activation memory) once a call has at least min_tokens rows; for Wan and "
                             "MiniMax-H3 the model's input projection and output head too. What cannot stream runs "
                             "stock; the report says which and why."),
                inputs=[
                    io.Model.Input("model"),
                    io.String.Input("budget", default="auto",
                                    tooltip='"auto": ComfyUI\'s free memory less --reserve-vram and reserve; '
                                            '"none": no planning; or a size ("12GiB"): the activation room above '
                                            'what a block holds when it is entered'),
                    io.Int.Input("chunk_tokens", default=0, min=0, max=1 << 24, step=256,
                                 tooltip="rows per chunk; 0 lets the planner choose"),
                    io.Int.Input("min_tokens", default=4096, min=0, max=1 << 24, step=256,
                                 tooltip="shorter calls run the stock block"),
                    io.String.Input("reserve", default="",
                                    tooltip='kept free under budget "auto", beside --reserve-vram ("2GiB"); '
                                            'empty: 512MiB'),
                    io.Boolean.Input("self_check", default=False,
                                     tooltip="run the first streamed call stock too and report the difference"),
                ],
                outputs=[io.Model.Output(display_name="model"), io.String.Output(display_name="report")],
            )

        @classmethod
        def execute(cls, model, budget="auto", chunk_tokens=0, min_tokens=4096, reserve="", self_check=False):
            patched, text = stream_blocks(model, budget, chunk_tokens, min_tokens, reserve, self_check)
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
                             "through it so it runs after the sampler."),
                inputs=[io.Model.Input("model", tooltip='the MODEL output of "Stream Blocks"'),
                        io.Latent.Input("samples", tooltip="the sampler's output (passed through unchanged)")],
                outputs=[io.Latent.Output(display_name="samples"), io.String.Output(display_name="report")],
                is_output_node=True,
                not_idempotent=True,
            )

        @classmethod
        def execute(cls, model, samples):
            samples, text = stream_report(model, samples)
            return io.NodeOutput(samples, text, ui={"text": [text]})

    return [StreamBlocks, StreamReport]


async def comfy_entrypoint():
    from comfy_api.latest import ComfyExtension

    classes = node_classes()

    class StreamplanExtension(ComfyExtension):
        async def get_node_list(self):
            return classes

    return StreamplanExtension()
