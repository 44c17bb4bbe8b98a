"""The collectives zeroflat runs over a torch.distributed group (the engine calls them from C++),
and the words for their failures.

When a collective fails, the process group's own error (gloo's "Connection closed by peer", a
timeout) says little about what zeroflat was doing or who is missing. Every collective here
fails as ``zeroflat.CommError`` instead: which collective, for what, on which rank, and which
ranks presumably are gone, with the process group's error chained as its ``__cause__``. The
ranks that are gone are found through the process group's store: every rank that sees a failure
leaves its mark there, and a rank whose mark does not come within a few seconds is presumably
gone (a rank still blocked in another collective is named too: "presumably").
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from . import _progress, _shm
from ._errors import CommError

U64_MAX = 2**64 - 1

# Every TorchComm of this process gets the next number; the ranks of a group make theirs in the
# same order (one per flatten or load call), so the number names the same call on every rank.
_instances = itertools.count()

# How long a rank that saw a failure waits for the others' marks in the store.
_ALIVE_SECONDS = 3.0


def comm_device(group, device: torch.device) -> torch.device:
    """Where a group's collectives take their tensors: a CUDA device for NCCL (``device``, or
    the current one for a rank that has none, such as one that only tells the others of its
    own error), else the host."""
    if str(dist.get_backend(group)) != "nccl":
        return torch.device("cpu")
    return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def gone_ranks(group, tag: str, seconds: float = _ALIVE_SECONDS) -> Optional[List[int]]:
    """The ranks of ``group`` (group ranks) that did not leave their mark under ``tag`` in the
    process group's store within ``seconds``, this rank's mark left first; None when the store
    cannot be reached (then rank 0 of the job, which serves it, is presumably gone)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank()
        store.set(f"zeroflat/alive/{tag}/{me}", "1")
        missing = [r for r in ranks if r != me]
        deadline = time.monotonic() + seconds
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"zeroflat/alive/{tag}/{r}"])]
            if missing:
                time.sleep(0.05)
        return [ranks.index(r) for r in missing]
    except Exception:  # noqa: BLE001 - no store, or it is gone: the caller says so
        return None


def failure_words(what: str, group, tag: str, error: BaseException) -> str:
    """zeroflat's words for a collective of ``group`` that raised ``error`` on this rank."""
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    gone = gone_ranks(group, tag)
    if gone is None:
        who = ("the process group's store does not answer either: rank 0 of the job, which "
               "serves it, is presumably gone")
    elif gone:
        who = (f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} of the group "
               f"{'are' if len(gone) > 1 else 'is'} presumably gone (no answer through the "
               f"process group's store within {_ALIVE_SECONDS:.0f} s; its log says why)")
        # What each of them last said of its progress: a rank still reading when the others'
        # wait ran out is late, not gone, and this says how far it had got.
        ranks = dist.get_process_group_ranks(group)
        said = [(r, _progress.last_beat(ranks[r])) for r in gone]
        said = [f"rank {r} last reported {text}" for r, text in said if text]
        if said:
            who += "; " + "; ".join(said)
    else:
        who = "every other rank still answers through the process group's store"
    return (f"{what} over the {size} ranks of the process group failed on rank {rank}: {who}; "
            f"the process group said {_first_line(error)}")


def collective(what: str, group, tag: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, a collective of ``group``; its failure as CommError in zeroflat's words, the
    process group's error chained."""
    try:
        return fn()
    except CommError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the backend raises
        raise CommError(failure_words(what, group, tag, e)) from e


def all_reduce_ints(values: List[int], group, op: str, what: str, tag: str) -> List[int]:
    """The element-wise ``op`` ("min" or "max") of every rank's ``values`` over ``group`` (the
    default group when None): one all-reduce on the device the backend needs (nccl: this rank's
    GPU); alone, ``values`` itself. Its failure is a CommError saying ``what``."""
    if not dist.is_initialized() or dist.get_world_size(group=group) == 1:
        return list(values)
    device = "cpu"
    if str(dist.get_backend(group)) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.int64, device=device)
    reduce_op = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
    collective(what, group, tag, lambda: dist.all_reduce(t, op=reduce_op, group=group))
    return [int(x) for x in t.tolist()]


class TorchComm:
    """The collectives the engine needs, over a torch.distributed group (called from C++).
    ``failure`` keeps the process group's own error of the first collective that failed, for the
    caller to chain."""

    def __init__(self, group, device: "Any", comm_device: torch.device):
        self.group = group
        self.device = device
        self.comm_device = comm_device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.aborted: Optional[str] = None
        self.failure: Optional[BaseException] = None
        self._tag = f"{'-'.join(map(str, dist.get_process_group_ranks(group)))}/{next(_instances)}"
        self._window: Any = None  # the shared-memory window of ranks on one host, once tried

    def _check(self) -> None:
        if self.aborted is not None:
            # The engine gave the group up after a failure it reports itself.
            raise CommError("not tried: this rank gave up the group's collectives after the "
                            "failure above")

    def _run(self, what: str, fn: Callable[[], Any]) -> Any:
        self._check()
        try:
            return collective(what, self.group, self._tag, fn)
        except CommError as e:
            if self.failure is None:
                self.failure = e.__cause__ or e
            raise

    def all_gather_inplace(self, ptr: int, slice_bytes: int) -> None:
        self.all_gather_tensor(self.device.tensor(ptr), slice_bytes)

    def all_gather_tensor(self, buf: torch.Tensor, slice_bytes: int,
                          what: str = "the all-gather of the flat buffer's partitions") -> None:
        """Every rank's slice ``[rank * slice_bytes, +slice_bytes)`` of the byte tensor ``buf``
        into every rank's ``buf``, in place (ranks of one host meet in shared memory)."""
        # Every rank's byte count before anything is copied: a shorter peer would be overrun.
        most, least = self._all_reduce([slice_bytes, U64_MAX - slice_bytes], "max", what)
        if most != U64_MAX - least:
            raise ValueError(f"the ranks passed all-gather slices of {U64_MAX - least} to "
                             f"{most} bytes; nothing was copied")
        buf = buf[: slice_bytes * self.size]
        self._run(what, lambda: self._all_gather(buf, slice_bytes))

    def _all_gather(self, buf: torch.Tensor, slice_bytes: int) -> None:
        if buf.device.type == "cpu" and self.comm_device.type == "cpu" and _shm.enabled():
            # Ranks on one host meet in shared memory rather than in gloo's sockets.
            # Opened at the first gather, again for a larger one (every rank sees the same
            # slice_bytes, checked above); never again once some rank could not map it.
            if self._window is None or (self._window and self._window.slot_bytes
                                        < _shm.slot_bytes(self.size, slice_bytes)):
                self._window = None  # the smaller window unmapped before the next is made
                self._window = _shm.SharedWindow.open(self.group, self.rank, self.size,
                                                      slice_bytes) or False
            if self._window:
                self._window.all_gather(buf, slice_bytes)
                return
        mine = buf[self.rank * slice_bytes: (self.rank + 1) * slice_bytes]
        try:
            dist.all_gather_into_tensor(buf, mine, group=self.group)
        except (RuntimeError, NotImplementedError, AttributeError) as e:
            if isinstance(e, RuntimeError) and "support" not in str(e):
                raise  # a failure, not a backend without the single-tensor form
            # Backends without the single-tensor form: the chunks are views into buf, so the
            # result lands in place all the same.
            dist.all_gather(list(buf.chunk(self.size)), mine.clone(), group=self.group)

    def all_reduce(self, values: List[int], op: str) -> List[int]:
        return self._all_reduce(values, op, "the ranks' agreement (an all-reduce)")

    def _all_reduce(self, values: List[int], op: str, what: str) -> List[int]:
        # Unsigned 64-bit values through int64 tensors: shifting by 2**63 keeps their order.
        t = torch.tensor([v - 2**63 for v in values], dtype=torch.int64, device=self.comm_device)
        self._run(what, lambda: dist.all_reduce(
            t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=self.group))
        return [int(v) + 2**63 for v in t.tolist()]

    def barrier(self) -> None:
        self._run("a barrier", lambda: dist.barrier(group=self.group))

    def abort(self, why: str) -> None:
        self.aborted = why
