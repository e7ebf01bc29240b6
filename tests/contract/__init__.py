"""Contract tests: what foldckpt relies on in vLLM's source, read with ``ast`` (vLLM never imported)."""
