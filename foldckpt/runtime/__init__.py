"""Everything that runs inside vLLM: the plugin entry point, sidecar loading, the folded MLA op.

Importing this package imports nothing from vLLM; :mod:`foldckpt.runtime.plugin` does so lazily.
"""
