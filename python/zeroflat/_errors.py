"""zeroflat's exceptions: the library's (common.h), raised as these classes by the binding, and the
two the Python package adds.

    Error (a RuntimeError)
    |-- InvalidArgument (also a ValueError)      a value outside the documented domain, or ranks
    |                                            that passed different ones; nothing was touched
    |-- OutOfMemory (also a MemoryError)         an allocation failed
    |-- Unsupported (also a NotImplementedError) valid, but this build or device cannot serve it
    |-- ResourceExhausted                        the system refused a thread or a file
    |-- CommError                                a collective failed; a peer is presumably gone
    |-- InternalError                            a bug in zeroflat
    |-- IoError (also an OSError)                a write, fsync or rename the system failed
    |-- NoFeasiblePlan (also a MemoryError)      nothing fits; nothing was touched
    '-- ExecutionError                           a step failed; see its ``outcome``
"""

from __future__ import annotations

from typing import Any, Optional

from . import _C

Error = _C.Error
InvalidArgument = _C.InvalidArgument
OutOfMemory = _C.OutOfMemory
Unsupported = _C.Unsupported
ResourceExhausted = _C.ResourceExhausted
CommError = _C.CommError
InternalError = _C.InternalError
IoError = _C.IoError


class NoFeasiblePlan(Error, MemoryError):
    """No way of flattening (or loading) fits in the memory the ranks have; nothing was
    touched. ``report`` has every candidate with its numbers."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


class ExecutionError(Error):
    """A step failed while flattening.

    ``outcome`` says what the parameters hold now: ``"rolled back"`` (their original storage,
    untouched), ``"recovered"`` (their original values, as views into a completed flat buffer,
    which ``flat_group``, a ``zeroflat.FlatGroup``, then holds) or ``"lost"`` (recovery failed too; the message says what
    this rank still had).
    """

    def __init__(self, message: str, outcome: str, report: dict,
                 flat_group: Optional[Any] = None):
        super().__init__(message)
        self.outcome = outcome
        self.report = report
        self.flat_group = flat_group
