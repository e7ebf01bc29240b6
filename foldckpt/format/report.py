"""What ``foldckpt verify`` reports: each level's result with its problems, and the whole report
(``verify --json`` prints :meth:`VerifyReport.to_dict`).

Here, beside the :class:`~foldckpt.format.consistency.Problem` records they hold, rather than in
:mod:`foldckpt.verify`: :mod:`foldckpt.options` names the report in the type of
``VerifyOptions.on_level`` (the callback each level's result goes to), and ``verify`` imports the
options, so the type lives where both import it without a loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foldckpt.format.consistency import Problem


@dataclass(frozen=True)
class LevelResult:
    name: str
    ok: bool
    summary: str
    problems: tuple[Problem, ...] = ()
    elapsed_s: float = 0.0
    bytes_read: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "summary": self.summary,
            "problems": [problem.to_dict() for problem in self.problems],
            "elapsed_s": round(self.elapsed_s, 6),
            "bytes_read": self.bytes_read,
        }


@dataclass(frozen=True)
class VerifyReport:
    out_dir: Path
    levels: tuple[LevelResult, ...] = field(default_factory=tuple)
    elapsed_s: float = 0.0
    # sha256 of the foldckpt.json file, as `sha256sum` prints it: what a user pins.
    manifest_sha256: str | None = None
    # The allow-list asked for, and the unlisted entries it let through.
    allow_extra: tuple[str, ...] = ()
    allowed_extra: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(level.ok for level in self.levels)

    @property
    def problems(self) -> tuple[Problem, ...]:
        return tuple(problem for level in self.levels for problem in level.problems)

    def to_dict(self) -> dict[str, Any]:
        return {
            "out_dir": str(self.out_dir),
            "ok": self.ok,
            "manifest_sha256": self.manifest_sha256,
            "allow_extra": {"patterns": list(self.allow_extra), "allowed": list(self.allowed_extra)},
            "levels": [lv.to_dict() for lv in self.levels],
            "elapsed_s": round(self.elapsed_s, 6),
        }
