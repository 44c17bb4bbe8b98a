"""An all-gather of host buffers through shared memory, for ranks on one host.

Gloo moves a host all-gather through TCP sockets, one copy per peer and per direction, at well
under a gigabyte per second; ranks that share a host can instead meet in a small window of
shared memory (``/dev/shm``) and copy their slices through it at memory speed. The window is a
ring of two slot sets, ``2 x ranks`` slots of ``slot_bytes`` each, so a buffer of any size goes
through in rounds with one barrier each and the extra memory stays a few tens of megabytes.

Which ranks share a host is found the same way (``hosts``): each rank makes a file of its own in
``/dev/shm`` and looks for the others'; ranks that see each other's files share the host's
memory. Within a host the ranks then meet in a window; between hosts they use the process group.

Whether every rank of the group can map the same window is found by trying: rank 0 creates a
file of a random name and the window's size, every other rank opens it by name without creating
it, each rank has the pages of its own slots made (``MADV_POPULATE_WRITE``, all ranks at once,
so that a full ``/dev/shm`` is a clean error here rather than a SIGBUS later), and the ranks
agree; anything short of every rank mapping it means the caller keeps to the process group's
own all-gather. The file is unlinked as soon as every rank has it mapped: nothing is left
behind, whatever happens next.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from typing import Optional, Sequence

import torch
import torch.distributed as dist

_WINDOW_BYTES = 32 << 20  # the whole ring, all ranks' slots together
_PAGE = 4096
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels answer EINVAL
_DIR = "/dev/shm"


def enabled() -> bool:
    """``ZEROFLAT_SHM_ALLGATHER=0`` keeps host all-gathers on the process group's backend."""
    return os.environ.get("ZEROFLAT_SHM_ALLGATHER", "1").strip().lower() not in ("0", "false",
                                                                                 "no", "off")


def slot_bytes(size: int, slice_bytes: int) -> int:
    """The slot a window for ``size`` ranks and slices of ``slice_bytes`` gets: the ring's share,
    no more than the slice needs (page-rounded)."""
    slot = max(_PAGE, (_WINDOW_BYTES // (2 * size)) // _PAGE * _PAGE)
    return min(slot, -(-slice_bytes // _PAGE) * _PAGE)


class SharedWindow:
    """A window of shared memory that every rank of ``group`` has mapped (see ``open``)."""

    def __init__(self, group, rank: int, size: int, slot_bytes: int, window: torch.Tensor):
        self.group = group
        self.rank = rank
        self.size = size
        self.slot_bytes = slot_bytes
        self.window = window
        # Rounds since the window opened: the ring's slot sets alternate across exchanges too,
        # so that an exchange needs no barrier after its last round (see exchange).
        self.rounds = 0

    @classmethod
    def open(cls, group, rank: int, size: int, slice_bytes: int) -> Optional["SharedWindow"]:
        """The window, or None when some rank cannot map it (another host, no /dev/shm, no room).
        Collective over ``group``: every rank calls it with the same ``size`` and
        ``slice_bytes``."""
        slot = slot_bytes(size, slice_bytes)
        total = 2 * size * slot
        name = _create(total) if rank == 0 else ""
        try:
            # The name, from the group's first rank, as bytes in a tensor (gloo moves host
            # tensors).
            text = torch.zeros(256, dtype=torch.uint8)
            raw = name.encode()
            text[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
            dist.broadcast(text, src=dist.get_global_rank(group, 0), group=group)
            name = bytes(text.tolist()).rstrip(b"\0").decode()
            if not name:
                return None
            try:
                window = _map(name, total, [(k * size + rank) * slot for k in range(2)], slot)
            except OSError:
                window = None
            ok = torch.tensor([1 if window is not None else 0], dtype=torch.int64)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        finally:
            # Every rank has it mapped, gave up, or failed: the name is no longer needed.
            if rank == 0 and name:
                try:
                    os.unlink(name)
                except OSError:
                    pass
        if not ok.item():
            return None
        return cls(group, rank, size, slot, window)

    def all_gather(self, buf: torch.Tensor, slice_bytes: int, offset: int = 0,
                   nbytes: Optional[int] = None) -> None:
        """Rank r's ``buf[r * slice_bytes, (r + 1) * slice_bytes)`` into every rank's ``buf``
        (uint8, on the host), in place; only bytes ``[offset, +nbytes)`` of each slice where
        they are given."""
        n = slice_bytes - offset if nbytes is None else nbytes
        self.exchange(buf, [j * slice_bytes + offset for j in range(self.size)], n)

    def exchange(self, buf: torch.Tensor, starts, slice_bytes: int) -> None:
        """Rank j's ``buf[starts[j], starts[j] + slice_bytes)`` into every rank's ``buf`` at the
        same place (uint8, on the host), in place; ``starts`` the same on every rank."""
        n_ranks, slot, me = self.size, self.slot_bytes, self.rank
        for off in range(0, slice_bytes, slot):
            n = min(slot, slice_bytes - off)
            # Slot set k % 2, k counted since the window opened: the barrier of round k - 1 (of
            # this exchange or the one before) saw every rank done reading this set in round
            # k - 2, so it is free to overwrite.
            k, self.rounds = self.rounds, self.rounds + 1
            base = (k % 2) * n_ranks * slot
            mine = base + me * slot
            own = starts[me] + off
            self.window[mine: mine + n].copy_(buf[own: own + n])
            dist.barrier(group=self.group)
            for j in range(n_ranks):
                if j != me:
                    at = base + j * slot
                    buf[starts[j] + off: starts[j] + off + n].copy_(self.window[at: at + n])
        # No barrier after the last round: this rank's buffer is complete, and the next round
        # on the window (the next exchange's first) writes the other slot set.


def hosts(group, rank: int, size: int) -> Optional[list]:
    """For each rank of ``group``, the number of its host (0, 1, ... in the order of each host's
    first rank), where a host is the ranks that see each other's files in /dev/shm; None when
    that is not a partition of the group (a rank without /dev/shm, a view that is not mutual).
    Collective over ``group``."""
    token = f"{os.getpid() & 0xFFFFFFFF:08x}{secrets.token_hex(4)}"  # 16 characters
    name = os.path.join(_DIR, f"zeroflat-host-{token}")
    made = False
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        made = True
    except OSError:
        pass
    try:
        mine = torch.tensor(list(token.encode()) if made else [0] * 16, dtype=torch.uint8)
        tokens = torch.zeros(size * 16, dtype=torch.uint8)
        dist.all_gather_into_tensor(tokens, mine, group=group)
        names = [bytes(tokens[j * 16:(j + 1) * 16].tolist()).decode("ascii", "replace")
                 for j in range(size)]
        # Only names of the form made above are looked for (16 hex digits): nothing a peer
        # sends can name another path.
        seen = torch.tensor([1 if made and re.fullmatch(r"[0-9a-f]{16}", n) and os.path.exists(
            os.path.join(_DIR, f"zeroflat-host-{n}")) else 0 for n in names], dtype=torch.uint8)
        rows = torch.zeros(size * size, dtype=torch.uint8)
        dist.all_gather_into_tensor(rows, seen, group=group)
    finally:
        # Every rank has looked (the all-gather above is past only once every rank looked).
        if made:
            try:
                os.unlink(name)
            except OSError:
                pass
    see = rows.view(size, size).tolist()
    host_of = [-1] * size
    count = 0
    for i in range(size):
        if host_of[i] >= 0:
            continue
        members = [j for j in range(size) if see[i][j]]
        # A host: every member sees exactly the same ranks, itself among them.
        if i not in members or any(see[j] != see[i] or host_of[j] >= 0 for j in members):
            return None
        for j in members:
            host_of[j] = count
        count += 1
    return host_of


def _create(total: int) -> str:
    """A new file of ``total`` bytes in /dev/shm (its pages not yet made), or "" when it cannot
    be made."""
    if not os.path.isdir(_DIR):
        return ""
    name = os.path.join(_DIR, f"zeroflat-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return ""
    try:
        os.ftruncate(fd, total)  # its pages are made by the ranks, each its own slots (_map)
    except OSError:
        os.close(fd)
        os.unlink(name)
        return ""
    os.close(fd)
    return name


def _map(name: str, total: int, own: Sequence[int] = (), own_bytes: int = 0) -> torch.Tensor:
    """The file ``name``, which must exist and hold ``total`` bytes, mapped shared, as uint8,
    with the pages of this rank's slots (``own_bytes`` from each offset in ``own``) made now:
    an OSError, not a SIGBUS at the first write, where /dev/shm has no room for them."""
    fd = os.open(name, os.O_RDWR)  # never O_CREAT: another host's file must not be made here
    try:
        if os.fstat(fd).st_size != total:
            raise OSError(f"{name} is not the window's size")
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            for at in own:
                try:
                    mm.madvise(_MADV_POPULATE_WRITE, at, own_bytes)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    os.posix_fallocate(fd, at, own_bytes)  # a kernel before 5.14
        except BaseException:
            mm.close()
            raise
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)
