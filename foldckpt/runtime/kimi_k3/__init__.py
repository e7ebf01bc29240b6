"""Kimi-K3's MLA folded in each of vLLM's two implementations (``nvidia``, ``amd``), and the
model-registry hook that installs the right one when vLLM builds a Kimi-K3 model (``registry``).

Importing this package imports nothing from vLLM: only :mod:`~foldckpt.runtime.kimi_k3.registry`
does, when vLLM resolves the registry entries the plugin pointed at it.
"""
