"""Offline kernel tuning (``python -m foldckpt.tune``): measures the fold GEMM on a GPU and writes its table; never imported by vLLM workers."""
