"""Execution: a streamed call from its plan to its output. ``dispatch`` picks the handler by spec type; the handlers
(``graph_call``, ``model_call``, ``part_calls``) check the call, ask the planner, and run it through the executors
(``graph_run`` for a captured block, ``attention_run`` / ``mlp_run`` for recognised parts) and the K/V stores."""
