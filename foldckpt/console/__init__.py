"""How a command runs at the console: progress on stderr, SIGINT and SIGTERM (no torch at import)."""
