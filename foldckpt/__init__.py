"""foldckpt: fold MLA's q_b_proj and W_UK into one decode weight, offline, and serve it in vLLM."""

__version__ = "0.1.0"
