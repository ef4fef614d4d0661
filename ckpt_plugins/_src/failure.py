"""Failures as data: what one rank tells the others when its part of a save or load failed, and
the one exception every rank raises from all of them."""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import List, Optional, Sequence, Type

from . import errors
from .errors import CheckpointError


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure: the exception's class name, message and traceback text, travelling
    between ranks."""
    rank: int
    kind: str
    message: str
    trace: str = ""  # where it was raised, on the failing rank

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> "RankFailure":
        return cls(rank, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)))

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}"


def _error_class(kind: str) -> Optional[Type[CheckpointError]]:
    cls = getattr(errors, kind, None)
    return cls if isinstance(cls, type) and issubclass(cls, CheckpointError) else None


def failure_error(failures: Sequence[RankFailure], what: str, then: str = "",
                  default: Type[CheckpointError] = CheckpointError) -> CheckpointError:
    """The one exception every rank raises for `failures`: its message names each failing rank
    and cause ("load of X failed: rank 1: CorruptCheckpointError: ..."); its class is the first
    failure's where that is a CheckpointError, else `default`. `failures` stays on it."""
    failures = sorted(failures, key=lambda f: f.rank)
    cls = _error_class(failures[0].kind) or default
    exc = cls(f"{what} failed: " + "; ".join(map(str, failures)) + (f". {then}" if then else ""))
    exc.failures = list(failures)
    for failure in failures:  # shown under the error's own traceback, on every rank
        if failure.trace and hasattr(exc, "add_note"):
            exc.add_note(f"rank {failure.rank}'s traceback:\n{failure.trace.rstrip()}")
    return exc


def collect(gathered: Sequence[Optional[RankFailure]]) -> List[RankFailure]:
    return [f for f in gathered if f is not None]
