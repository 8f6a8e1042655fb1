"""Recognition that knows no host library: the generic recognizer (a block streamed from its captured graph), the
fail-closed checks every recognizer shares, and row-local modules outside blocks. The host libraries' recognizers live
in ``streamplan.integrations``."""
