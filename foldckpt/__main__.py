"""``python -m foldckpt`` runs the command line."""

from foldckpt.cli import main

main()
