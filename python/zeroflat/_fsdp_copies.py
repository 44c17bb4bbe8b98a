"""The check that the ranks' copies of a checkpoint hold the same bytes (``copies``), for what an
FSDP2 load takes without the library's loads, which check their own: the shards used in place
(``storage="map"``) and the buffers every rank reads whole. The check is the library's
(``check_taken_copies``, loader.h: the loads' rule over byte ranges and values); this module
says which ranges each rank took (the library's ``shard_file_ranges``) and hands over the
bytes. A difference is every rank's error, named by the rank that found it, before any model
is changed."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import _C
from ._common import DTYPES
from ._errors import InvalidArgument


def file_ranges(prep, members, dtype: torch.dtype, q: int) -> List[Optional[Tuple[int, ...]]]:
    """Rank ``q``'s shard of each member as one (file, offset, bytes) range of the checkpoint's
    files, where it lies there as it is (the library's shard_file_ranges), else None."""
    ranges = _C.shard_file_ranges(prep.ck, [m.param for m in members], prep.mesh_shape,
                                  prep.coords, [m.placements for m in members], q, DTYPES[dtype])
    return [None if r is None else tuple(int(x) for x in r) for r in ranges]


def mapped_ranges(prep, q: int) -> List[Tuple[object, Tuple[int, int, int]]]:
    """(member, (file, offset, bytes)) of rank ``q``'s shards used in place, in the order every
    rank lists them (the library's shard_file_ranges: the same parameters on every rank)."""
    out = []
    for dtype in sorted(prep.by_dtype, key=str):
        members = [m for m in prep.by_dtype[dtype] if m.range is not None]
        if not members:
            continue
        for m, r in zip(members, file_ranges(prep, members, dtype, q)):
            if r is None:  # the library places the same parameters in place on every rank
                raise InvalidArgument(f"parameter {m.aliases[0]!r} lies in the files as it is "
                                      f"for this rank, not for rank {q}")
            out.append((m, r))
    return out


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def check(prep, comm, world: int, copies: str) -> int:
    """Raises InvalidArgument on every rank where some rank's copy holds other bytes than
    another's, in what this rank and the others used in place or read whole: the library's
    check (check_taken_copies). Collective. Returns the file bytes this rank read to compare
    (other ranks' windows)."""
    if world <= 1 or copies == "off" or comm is None:
        return 0
    per_rank = [mapped_ranges(prep, q) for q in range(world)]
    ranges = [[(f, offset, n, m.aliases[0]) for m, (f, offset, n) in rows] for rows in per_rank]
    mine = [_host_bytes(m.mapped) for m, _ in per_rank[comm.rank]]
    values = [(f"buffer {name!r}", _host_bytes(value)) for name, _, value in prep.whole]
    return int(_C.check_taken_copies(prep.ck, comm, ranges, mine, values, copies))
