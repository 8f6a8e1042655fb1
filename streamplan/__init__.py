"""streamplan: long-sequence transformer inference in bounded activation memory, with the model's own math."""
from .api import StreamHandle, apply
from .budget import parse_budget
from .consumers import AttentionConsumer, ConsumerCaps, register_consumer, unregister_consumer
from .meter import measure_peak
from .planner import BudgetError
from .verify import verify

__all__ = ["apply", "verify", "StreamHandle", "measure_peak", "parse_budget", "BudgetError", "register_consumer",
           "unregister_consumer", "ConsumerCaps", "AttentionConsumer"]
__version__ = "0.1.0"
