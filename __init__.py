"""ComfyUI custom-node entry: ComfyUI imports this file when the repository is cloned into ComfyUI/custom_nodes/.
The node pack lives in ``streamplan/integrations/comfy/nodes.py``; this file only makes the clone's ``streamplan`` importable."""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)

from streamplan.integrations.comfy.nodes import comfy_entrypoint  # noqa: E402

__all__ = ["comfy_entrypoint"]
