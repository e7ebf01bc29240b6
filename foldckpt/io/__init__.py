"""Bytes on disk: strict safetensors headers, direct I/O, durable files, hashing (no torch at import)."""
