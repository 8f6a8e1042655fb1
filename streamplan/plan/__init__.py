"""Planning: from a spec's memory model, the call's shape and a budget, the tier and chunk sizes a call runs with.
Plans are data (``planner.Plan``) handed to the executors; planning is arithmetic and runs no work."""
