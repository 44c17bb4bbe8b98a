"""The check that the ranks' copies of a checkpoint hold the same bytes (``copies``), for what an
FSDP2 load takes without the library's loads, which check their own (copies.cc): the shards used
in place (``storage="map"``) and the buffers every rank reads whole.

The same rule as the loads': each rank digests windows of the bytes it took (``"sampled"``: 16
windows of 64 KiB spread over all its mapped bytes, placed by its rank; ``"full"``: every byte),
and every rank's digests of its whole buffers; the ranks exchange them in one all-reduce; each
rank then digests the same windows as its own copy of the files holds them for the others, and
compares. A difference is named by the rank that finds it (file, bytes, parameter or buffer), and
one more all-reduce makes it every rank's error, before any model is changed."""

from __future__ import annotations

import hashlib
import os
from typing import List, Optional, Tuple

import torch

from . import _C
from ._comm import all_reduce_ints
from ._common import DTYPES, path_text
from ._errors import InvalidArgument

_WINDOW = 64 << 10
_WINDOWS = 16
_CHUNK = 16 << 20


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


def _spans(total: int, q: int, full: bool) -> List[Tuple[int, int]]:
    """The windows [lo, hi) of a rank's mapped bytes (all of them, one after another)."""
    if full or total <= _WINDOW * _WINDOWS:
        return [(a, min(total, a + _CHUNK)) for a in range(0, total, _CHUNK)]
    stride = total // _WINDOWS
    shift = (q * 7919) % (stride - _WINDOW + 1)
    return [(w * stride + shift, w * stride + shift + _WINDOW) for w in range(_WINDOWS)]


def _pieces(ranges, lo: int, hi: int) -> List[Tuple[int, int, int]]:
    """(k, start, end): the bytes [lo, hi) of ranges laid end to end, range by range."""
    out, at = [], 0
    for k, (_, _, n) in enumerate(ranges):
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append((k, a - at, b - at))
        at += n
        if at >= hi:
            break
    return out


def _digest(chunks) -> int:
    h = hashlib.blake2b(digest_size=8)
    for c in chunks:
        h.update(c)
    return int.from_bytes(h.digest(), "little") >> 2  # >= 0 and within int64


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def check(prep, rank: int, world: int, group, copies: str, path: str) -> int:
    """Raises InvalidArgument on every rank where some rank's copy holds other bytes than
    another's, in what this rank and the others used in place or read whole. Collective.
    Returns the file bytes this rank read to compare (other ranks' windows)."""
    if world <= 1 or copies == "off":
        return 0
    per_rank = [mapped_ranges(prep, q) for q in range(world)]
    spans = [_spans(sum(r[2] for _, r in per_rank[q]), q, copies == "full")
             for q in range(world)]
    whole = [_digest([_bytes(value)]) for _, _, value in prep.whole]
    base = [sum(len(s) + len(whole) for s in spans[:q]) for q in range(world)]
    values = [0] * (base[-1] + len(spans[-1]) + len(whole))
    if not values:  # nothing in place, no buffer (the same count on every rank)
        return 0
    mine = [r for _, r in per_rank[rank]]
    views = [_bytes(m.mapped) for m, _ in per_rank[rank]]
    for i, (lo, hi) in enumerate(spans[rank]):
        values[base[rank] + i] = _digest(views[k][a:b] for k, a, b in _pieces(mine, lo, hi))
    values[base[rank] + len(spans[rank]): base[rank] + len(spans[rank]) + len(whole)] = whole
    what = f"the ranks' comparison of their copies of {path} (an all-reduce)"
    theirs = all_reduce_ints(values, group, "max", what, "fsdp-copies")
    found, fds, read = None, {}, [0]

    def pread(f: int, offset: int, n: int) -> bytes:
        if f not in fds:
            fds[f] = os.open(os.fsencode(prep.ck.files[f]), os.O_RDONLY)
        read[0] += n
        return os.pread(fds[f], n, offset)
    try:
        for q in (q for q in range(world) if q != rank):
            ranges = [r for _, r in per_rank[q]]
            for i, (lo, hi) in enumerate(spans[q]):
                parts = _pieces(ranges, lo, hi)
                if _digest(pread(ranges[k][0], ranges[k][1] + a, b - a)
                           for k, a, b in parts) != theirs[base[q] + i]:
                    k, a, _ = parts[0]
                    f, offset, _ = ranges[k]
                    found = (f"rank {q} used {hi - lo} bytes from its copy, starting at byte "
                             f"{offset + a} of {path_text(prep.ck.files[f])} (parameter "
                             f"{per_rank[q][k][0].aliases[0]!r}), and this rank's copy (rank "
                             f"{rank}) holds other bytes somewhere in them")
                    break
            for j, (name, _, _) in enumerate(prep.whole):
                if found is None and theirs[base[q] + len(spans[q]) + j] != whole[j]:
                    found = (f"buffer {name!r} as rank {q} read it from its copy differs from "
                             f"this rank's (rank {rank})")
            if found is not None:
                break
    except Exception as e:  # noqa: BLE001 - every rank must reach the second all-reduce
        found = f"the check itself failed on rank {rank}: {type(e).__name__}: {e}"
    finally:
        for fd in fds.values():
            os.close(fd)
    bad = all_reduce_ints([rank + 1 if found else 0], group, "max", what, "fsdp-copies")[0]
    if bad:
        said = found if found is not None else (f"rank {bad - 1} found a difference (its error "
                                                "names the file and the bytes)")
        raise InvalidArgument(f"the ranks' copies of {path} hold different bytes: {said}; every "
                              "rank must read an identical copy (nothing of any model was "
                              "changed)")
    return read[0]
