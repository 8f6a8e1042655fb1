"""diffusers: its attention and MLP modules, the model forwards streamplan follows (Wan, MiniMax-H3), its hooks and
its context parallelism."""
