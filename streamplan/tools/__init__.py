"""What the ``streamplan`` command runs: the CLI, the embedded demo, the GPU benchmark suite, the real-width model
families, and the coverage catalogue."""
