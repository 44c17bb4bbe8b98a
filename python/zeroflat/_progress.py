"""Progress of a rank's long reads (a load, a resume): bytes read, rate and time left, in the
library's own words (``_C.describe_progress``, the same as the command line's lines), through
``logging`` (the ``zeroflat`` logger, INFO) and to a callback the caller passes, at most every
10 s (``ZEROFLAT_PROGRESS_SECONDS`` sets it). A read that ends sooner logs nothing; the callback
always gets a last report (``finished``) after a read that succeeded.

Each rank reports its own reads: once a rank has read everything and waits for the others in a
collective, its line says so, so that the rank still reading is the one whose line does not.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from . import _C

log = logging.getLogger("zeroflat")

DEFAULT_SECONDS = 10.0


@dataclass(frozen=True)
class Progress:
    """One report of a rank's reads, as the callback gets it."""
    rank: int
    what: str         # what is read ("load", "resume from DIR")
    done: int         # bytes read so far
    total: int        # bytes this rank reads in all (0: not known yet)
    seconds: float    # since the reads began
    finished: bool    # the last report: every read of this call is over
    line: str         # the words the log line uses

    @property
    def rate(self) -> float:
        """Bytes per second so far (0 before anything was read)."""
        return self.done / self.seconds if self.done and self.seconds > 0 else 0.0

    @property
    def seconds_left(self) -> Optional[float]:
        """At the rate so far; None while unknown."""
        if self.finished:
            return 0.0
        if not self.total or not self.rate:
            return None
        return max(0, self.total - self.done) / self.rate


def interval_seconds() -> float:
    """ZEROFLAT_PROGRESS_SECONDS when it is a positive number (at most a million: a longer
    wait is no line during any load, and overflows the waits' timeouts), else 10."""
    text = os.environ.get("ZEROFLAT_PROGRESS_SECONDS")
    if text:
        try:
            value = float(text)
        except ValueError:
            value = 0.0
        if value > 0 and math.isfinite(value):
            return min(value, 1e6)
    return DEFAULT_SECONDS


def check_callback(progress) -> None:
    if progress is not None and not callable(progress):
        raise TypeError(f"progress={progress!r}: expected None or a callable taking one "
                        "zeroflat.Progress")


def _progress_key(rank: int) -> str:
    return f"zeroflat/progress/{rank}"


def beat(text: str) -> None:
    """This rank's last word on its progress, with the time, in the default process group's
    store (nothing where there is none)."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return
        store = dist.distributed_c10d._get_default_store()
        store.set(_progress_key(dist.get_rank()), f"{time.time():.3f} {text}")
    except Exception:  # noqa: BLE001 - only a help for another rank's error message
        pass


def last_beat(rank: int) -> Optional[str]:
    """Rank ``rank``'s (a rank of the job) last word on its progress and how long ago it said
    it, or None when it left none."""
    try:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        key = _progress_key(rank)
        if not store.check([key]):
            return None
        when, _, text = store.get(key).decode("utf-8", "replace").partition(" ")
        return f"{max(0.0, time.time() - float(when)):.0f} s before: {text}"
    except Exception:  # noqa: BLE001
        return None


class Watch:
    """Reports the reads counted in ``counts`` (the ``_C.ReadProgress`` the loads are given)
    from a thread of its own while the ``with`` block runs."""

    def __init__(self, what: str, rank: int, world: int,
                 callback: Optional[Callable[[Progress], None]] = None, expected: int = 0):
        check_callback(callback)
        self.what, self.rank, self.world, self.callback = what, rank, world, callback
        self.counts = _C.ReadProgress()
        self.counts.expected = int(expected)
        self.interval = interval_seconds()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start = 0.0
        self._reported = False

    def __enter__(self) -> "Watch":
        self._start = time.monotonic()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="zeroflat-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind, value, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # After a success, the callback learns of the end; the log only of the end of a read it
        # reported on.
        if kind is None and (self._reported or self.callback is not None):
            self._report(finished=True, log_it=self._reported)
        if kind is None:
            self._beat(finished=True)

    def report(self, finished: bool = False) -> Progress:
        done, total = int(self.counts.done), int(self.counts.total)
        if finished:
            total = done  # what was read in the end (an expected total is an estimate)
        seconds = time.monotonic() - self._start
        line = _C.describe_progress(done, total, seconds)
        if finished:
            line += f", done in {seconds:.1f} s"
        elif self.world > 1 and total and done >= total:
            line += "; waiting for the other ranks"
        return Progress(self.rank, self.what, done, total, seconds, finished, line)

    def _report(self, finished: bool = False, log_it: bool = True) -> None:
        p = self.report(finished)
        if log_it:
            self._reported = True
            log.info("zeroflat: rank %d: %s: %s", p.rank, p.what, p.line)
        if self.callback is not None:
            try:
                self.callback(p)
            except Exception:  # noqa: BLE001 - the load goes on; the caller learns why once
                log.exception("zeroflat: the progress callback raised; it is not called again")
                self.callback = None

    def _beat(self, finished: bool = False) -> None:
        """Leaves this rank's progress in the process group's store, where the other ranks read
        it when a wait for this one fails (``_comm.failure_words``): a late rank is named with
        what it was doing, not only as missing."""
        if self.world <= 1:
            return
        p = self.report(finished)
        beat(f"{p.what}: {p.line}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._report()
            self._beat()


class Phases:
    """Where a call's time goes: ``end(name)`` adds the seconds since the last ``end`` (or the
    start) to phase ``name``; ``seconds`` holds them, in the order first ended."""

    def __init__(self, start: Optional[float] = None):
        self.seconds: Dict[str, float] = {}
        self._mark = time.perf_counter() if start is None else start

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._mark
        self._mark = now
