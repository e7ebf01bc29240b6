"""The one exception type users see, and the exit codes.

Every failure caused by the input (a bad checkpoint, a wrong flag, a full disk) raises
:class:`FoldckptError` with a message that names the file or tensor and says what to do. The CLI
prints it on one line without a traceback and exits with :data:`EXIT_BAD_INPUT`. Anything else
that escapes is a bug: one line, :data:`EXIT_INTERNAL`, and the traceback in a file. SIGINT and
SIGTERM end the command with ``128 + signal number`` (130, 143); an interrupted ``convert``
resumes when rerun.
"""

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_SIGNAL_BASE = 128  # + the signal number: 130 for SIGINT, 143 for SIGTERM


class FoldckptError(Exception):
    """A user-facing error: bad input, bad usage, or an environment problem (disk full, permissions).

    The message is complete (it names the file); ``path`` and ``tensor``, where known, say the same
    for programs, and ``detail`` is the message without its ``<path>: `` prefix, so that nobody
    parses message text. :meth:`at` builds the usual ``<path>: <detail>`` error.
    """

    def __init__(
        self, message: str, *, path: object = None, tensor: str | None = None, detail: str | None = None
    ) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.tensor = tensor
        self.detail = message if detail is None else detail

    @classmethod
    def at(cls, path: object, detail: str, tensor: str | None = None) -> "FoldckptError":
        return cls(f"{path}: {detail}", path=path, tensor=tensor, detail=detail)


class ManifestError(FoldckptError):
    """``foldckpt.json`` exists but is not a manifest this conversion can be trusted by (edited,
    damaged, inconsistent, or not the pinned one): verification fails (exit 1), serving refuses."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that no ``except
    Exception`` swallows it; every durable step is journaled, so unwinding loses nothing."""

    def __init__(self, signum: int, name: str) -> None:
        super().__init__(name)
        self.signum = signum
        self.name = name

    @property
    def exit_code(self) -> int:
        return EXIT_SIGNAL_BASE + self.signum
