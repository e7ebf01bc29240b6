"""``python -m foldckpt.tune``: measure the fold GEMM on this GPU and write its tuning table."""

import sys

from foldckpt.tune.cli import main

sys.exit(main())
