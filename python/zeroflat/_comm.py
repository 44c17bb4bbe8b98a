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
from ._errors import CommError, InvalidArgument

U64_MAX = 2**64 - 1

# Every TorchComm of this process gets the next number; the ranks of a group make theirs in the
# same order (one per flatten or load call), so the number names the same call on every rank.
_instances = itertools.count()

# How long a rank that saw a failure waits for the others' marks in the store.
_ALIVE_SECONDS = 3.0

# The hosts of each group this process gathered over, found once: the group's global ranks ->
# (the group, its _Hosts or False where the two-step all-gather does not apply: one host, hosts
# of unequal rank counts, no /dev/shm). A group made anew (a process group destroyed and
# initialized again) is looked at anew.
_hosts_of_group: dict = {}


class _Hosts:
    """A group's ranks on M hosts of R ranks each (M, R > 1): this rank's host-mates (a process
    group of R) and the ranks of the same local index on every host (a process group of M)."""

    def __init__(self, members: List[List[int]], host: int, local: int, host_group, across,
                 global_ranks: Optional[List[int]] = None):
        self.members = members  # group ranks of each host, ascending
        self.host = host
        self.local = local
        self.host_group = host_group
        self.across = across
        # The job's rank of each group rank (point-to-point operations name their peer so).
        self.global_ranks = global_ranks or list(range(sum(len(m) for m in members)))

    def open_window(self, part: int) -> Optional[_shm.SharedWindow]:
        """A window for this host's ranks to exchange parts of ``part`` bytes (collective over
        the group), or None for every rank where the ranks of some host cannot map one (a full
        /dev/shm): every rank learns it alike."""
        window = _shm.SharedWindow.open(self.host_group, self.local, len(self.members[0]),
                                        part)
        # Every host's answer, so that all ranks take the same way.
        ok = torch.tensor([1 if window is not None else 0], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.across)
        return window if ok.item() else None

    def all_gather(self, buf: torch.Tensor, slice_bytes: int, window: _shm.SharedWindow,
                   offset: int = 0, nbytes: Optional[int] = None) -> None:
        """The group's all-gather in two steps, so that only other hosts' bytes cross between
        hosts, once each: the ranks of local index c on every host pass their slices around a
        ring (point to point, straight into their places in ``buf``), while each host's ranks
        exchange their own slices through ``window`` (``open_window``); then they complete one
        another's buffers with the other hosts' slices, host by host. Only bytes ``[offset,
        +nbytes)`` of each slice where they are given."""
        part = slice_bytes - offset if nbytes is None else nbytes

        def at(r: int) -> torch.Tensor:
            return buf[r * slice_bytes + offset: r * slice_bytes + offset + part]
        ring = sorted(m[self.local] for m in self.members)  # the group of local index c
        me = ring.index(self.members[self.host][self.local])
        n = len(ring)
        send_to = self.global_ranks[ring[(me + 1) % n]]
        recv_from = self.global_ranks[ring[(me - 1) % n]]
        own = self.members[self.host]
        for step in range(n - 1):
            # Step k passes on the slice received at step k - 1 (this rank's own at first).
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, at(ring[(me - step) % n]), send_to, group=self.across),
                dist.P2POp(dist.irecv, at(ring[(me - step - 1) % n]), recv_from,
                           group=self.across)])
            if step == 0:  # meanwhile, the host's own slices through shared memory
                window.exchange(buf, [r * slice_bytes + offset for r in own], part)
            for w in works:
                w.wait()
        for m in self.members:
            if m is not own:
                window.exchange(buf, [r * slice_bytes + offset for r in m], part)


def _new_group(ranks: List[int], everyone: bool):
    """A gloo group of these global ranks: made by every rank of the job (``everyone``) or only
    by its members."""
    if everyone:
        return dist.new_group(ranks, backend="gloo")
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


def hosts_of(group, rank: int, size: int):
    """The group's _Hosts, False where the ranks are on one host or the two-step all-gather does
    not apply. Collective over ``group`` the first time for each group."""
    ranks = dist.get_process_group_ranks(group)
    key = tuple(ranks)
    known = _hosts_of_group.get(key)
    if known is not None and known[0] is group:
        return known[1]
    host_of = _shm.hosts(group, rank, size) if _shm.enabled() else None
    found: Any = False
    if host_of is not None:
        members = [[r for r in range(size) if host_of[r] == h] for h in range(max(host_of) + 1)]
        per_host = len(members[0])
        if len(members) > 1 and per_host > 1 and all(len(m) == per_host for m in members):
            everyone = dist.get_world_size() == size
            mine = host_of[rank]
            local = members[mine].index(rank)
            host_group = across = None
            try:
                # Every rank makes the groups in the same order (all of them when the group is
                # the whole job, as new_group then requires; else its own two).
                for h, m in enumerate(members):
                    if everyone or h == mine:
                        g = _new_group([ranks[r] for r in m], everyone)
                        host_group = g if h == mine else host_group
                for c in range(per_host):
                    if everyone or c == local:
                        g = _new_group([ranks[m[c]] for m in members], everyone)
                        across = g if c == local else across
                found = _Hosts(members, mine, local, host_group, across, list(ranks))
            except TypeError:
                pass  # a torch whose new_group cannot synchronize only its members
    _hosts_of_group[key] = (group, found)
    return found


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


def raise_agreed(error: Optional[BaseException], group, what: str, tag: str,
                 refused: Callable[[int], BaseException]) -> None:
    """One all-reduce over ``group`` (the default group when None) telling every rank whether
    any failed; then this rank's own ``error`` is raised, or, where another rank failed,
    ``refused(that rank)`` (the lowest global rank that failed names it)."""
    me = dist.get_rank()
    failed = all_reduce_ints([me + 1 if error is not None else 0], group, "max", what, tag)[0]
    if error is not None:
        raise error
    if failed:
        raise refused(failed - 1)


def failing_word(error: Optional[BaseException], group) -> int:
    """This rank's word in an agreement on errors that carries other words too (one all-reduce,
    max): 0 when it has none, else world - rank (the maximum names the lowest rank that
    failed). ``raise_failed`` takes the maximum."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return world - rank if error is not None else 0


def raise_failed(failing: int, error: Optional[BaseException], group, what: str,
                 refused: Callable[[int, str], BaseException]) -> None:
    """After such an agreement whose maximum of ``failing_word`` is ``failing``: nothing when no
    rank failed; else (collective) one more all-reduce hands every rank the failing rank's
    words (its first 245 bytes, 7 to an int64, only that rank writing), and every rank raises:
    this rank its own error, the others ``refused(that rank, its words)``. ``raise_agreed`` is
    the same without the words, for an agreement of its own."""
    if failing == 0:
        return
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    raw = b""
    if error is not None and failing_word(error, group) == failing:
        raw = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[:245]
    raw = raw.ljust(245, b"\0")
    words = all_reduce_ints([int.from_bytes(raw[i:i + 7], "little") for i in range(0, 245, 7)],
                            group, "max", f"the ranks' agreement on {what} (its reason)",
                            f"agreement-{what}-why")
    said = b"".join(w.to_bytes(7, "little") for w in words).rstrip(b"\0")
    if error is not None:
        raise error
    raise refused(world - failing, said.decode("utf-8", "replace"))


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
        # The shared-memory windows, once tried (False: some rank could not map one): of the
        # group's ranks on one host, and of this rank's host-mates where the group spans hosts.
        # Kept for the comm's later all-gathers (a load's parts), mapped until it goes.
        self._window: Any = None
        self._host_window: Any = None

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

    def all_gather_part(self, ptr: int, slice_bytes: int, offset: int, nbytes: int) -> None:
        """Bytes ``[r * slice_bytes + offset, +nbytes)`` of every rank r's slice into every
        rank's buffer (the engine gathers a slice part by part while it reads the rest)."""
        what = "the all-gather of a part of the flat buffer's partitions"
        least, most = self._range([slice_bytes, offset, nbytes], what)
        if least != most:
            raise InvalidArgument("the ranks passed different parts of their all-gather "
                                  "slices; nothing was copied")
        buf = self.device.tensor(ptr)[: slice_bytes * self.size]
        self._run(what, lambda: self._all_gather(buf, slice_bytes, offset, nbytes))

    def all_gather_tensor(self, buf: torch.Tensor, slice_bytes: int,
                          what: str = "the all-gather of the flat buffer's partitions") -> None:
        """Every rank's slice ``[rank * slice_bytes, +slice_bytes)`` of the byte tensor ``buf``
        into every rank's ``buf``, in place (ranks of one host meet in shared memory)."""
        self.all_gather_tensors([(buf, slice_bytes)], what)

    def all_gather_tensors(self, items: List[Any], what: str) -> None:
        """all_gather_tensor of each ``(buf, slice_bytes)``, the ranks' byte counts compared
        once for all of them in the order given, then gathered the larger slices first (the
        window opened for them serves the rest)."""
        # Every rank's byte counts before anything is copied: a shorter peer would be overrun.
        least, most = self._range([n for _, n in items], what)
        if most != least:
            k = next(i for i in range(len(items)) if least[i] != most[i])
            raise InvalidArgument(f"{what}: the ranks passed slices of {least[k]} to {most[k]} "
                                  f"bytes (item {k}); nothing was copied")
        for buf, slice_bytes in sorted(items, key=lambda item: -item[1]):
            part = buf[: slice_bytes * self.size]
            self._run(what, lambda: self._all_gather(part, slice_bytes))

    def _range(self, values: List[int], what: str):
        """Each value's least and greatest over the ranks, in one all-reduce."""
        agreed = self._all_reduce(values + [U64_MAX - v for v in values], "max", what)
        n = len(values)
        return [U64_MAX - v for v in agreed[n:]], agreed[:n]

    def _all_gather(self, buf: torch.Tensor, slice_bytes: int, offset: int = 0,
                    nbytes: Optional[int] = None) -> None:
        """Bytes ``[r * slice_bytes + offset, +nbytes)`` of every rank r (its whole slice by
        default) into ``buf``, in place."""
        n = slice_bytes - offset if nbytes is None else nbytes
        starts = [r * slice_bytes + offset for r in range(self.size)]
        if buf.device.type == "cpu" and self.comm_device.type == "cpu" and _shm.enabled():
            # Ranks on several hosts, several on each: only other hosts' bytes cross between
            # hosts, then the ranks of each host meet in shared memory.
            hosts = hosts_of(self.group, self.rank, self.size)
            if hosts and self._host_window is not False:
                # The same part size on every rank (checked by the caller), so every rank
                # either keeps its window or opens the next with the others.
                if self._host_window is None or (self._host_window.slot_bytes < _shm.slot_bytes(
                        len(hosts.members[0]), n)):
                    self._host_window = None  # the smaller window unmapped first
                    self._host_window = hosts.open_window(n) or False
                if self._host_window:
                    hosts.all_gather(buf, slice_bytes, self._host_window, offset, n)
                    return
            # Ranks on one host meet in shared memory rather than in gloo's sockets.
            # Opened at the first gather, again for a larger one (every rank sees the same
            # slice_bytes, checked above); never again once some rank could not map it.
            if self._window is None or (self._window and self._window.slot_bytes
                                        < _shm.slot_bytes(self.size, slice_bytes)):
                self._window = None  # the smaller window unmapped before the next is made
                self._window = _shm.SharedWindow.open(self.group, self.rank, self.size,
                                                      slice_bytes) or False
            if self._window:
                self._window.all_gather(buf, slice_bytes, offset, n)
                return
        mine = buf[starts[self.rank]: starts[self.rank] + n]
        if n != slice_bytes:
            # A part of each slice: the peers' parts straight into their places.
            dist.all_gather([buf[s: s + n] for s in starts], mine.clone(), group=self.group)
            return
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
