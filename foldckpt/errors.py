"""The one exception type users see.

Every failure caused by the input (a bad checkpoint, a wrong flag, a full disk) raises
:class:`FoldckptError` with a message that names the file or tensor and says what to do. The CLI
prints it on one line without a traceback and exits with :data:`EXIT_BAD_INPUT`.
"""

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_BAD_INPUT = 2


class FoldckptError(Exception):
    """A user-facing error: bad input, bad usage, or an environment problem (disk full, permissions)."""
