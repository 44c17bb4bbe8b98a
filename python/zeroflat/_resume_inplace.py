"""The resume's reads in place (``_resume._Resume.read``): which of the optimizer's own tensors a
buffer of the plan is read straight into and how its values are put back should the resume
fail (``lend``); the communicator of the loads, which run no collective of their own
(``OwnBytes``); and the digest of a rank's plan the ranks compare in the resume's one agreement
(``plan_digest``)."""

from __future__ import annotations

from typing import Optional

import torch

from . import _C
from ._errors import InvalidArgument


def lend(family, b):
    """The optimizer's own tensor that buffer ``b`` may be read straight into (no buffer of
    the load's own: no fresh memory to fault in, no copy after), and how to put its values
    back exactly should the resume fail before the engine takes what was read; (None, None)
    where the load takes a buffer of its own. Lent only where putting back is exact: the fp32
    master while it is the up-cast of its 16-bit partition (an engine not yet stepped), an
    optimizer state while all its elements are zero. ``family``: the running optimizer
    (_resume_family)."""
    if b.group is None or b.target in ("module", "frozen"):
        return None, None
    k = int(b.group)
    masters = family.masters()
    if k >= len(masters):
        return None, None
    master = masters[k]
    if b.target == "fp32":
        bit16 = family.bit16(k)
        if (not _plain(master, torch.float32) or bit16 is None
                or not _plain(bit16, bit16.dtype, master) or not _upcast_of(master, bit16)):
            return None, None
        return master, lambda: master.copy_(bit16)
    state = family.opt.optimizer.state.get(master, {}).get(b.target)
    if (not torch.is_tensor(state) or not _plain(state, torch.float32, master)
            or bool(state.any())):
        return None, None
    return state, state.zero_


def plan_digest(plan) -> str:
    """Every buffer of this rank's plan in a line the ranks compare in the resume's one
    agreement, after the reads: targets, groups, placements, element counts, layout choices."""
    import hashlib

    h = hashlib.sha256()
    for b in plan.buffers:
        lay = b.layout
        h.update(repr((b.target, b.group, b.placement, list(b.numels), lay.dp, lay.round_robin,
                       lay.alignment_factor, lay.param_align_bytes, lay.dtype)).encode())
    return f"plan {h.hexdigest()}"


class OwnBytes:
    """The communicator of a resume's loads: this rank's place in the group, and no collective
    (each rank reads only its own bytes; what every rank must hold identically, and the
    outcome, are agreed once after the last load)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.failure = None

    def all_reduce(self, values, op):
        return list(values)

    def barrier(self) -> None:
        pass

    def abort(self, why: str) -> None:
        pass

    def all_gather_inplace(self, *args):
        raise InvalidArgument("a resume's load of this rank's own bytes gathers nothing")

    all_gather_part = all_gather_inplace


def _plain(t: torch.Tensor, dtype: torch.dtype, like: Optional[torch.Tensor] = None) -> bool:
    """A contiguous host tensor of ``dtype`` (with as many elements as ``like``)."""
    return (t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
            and (like is None or t.numel() == like.numel()))


def _upcast_of(master: torch.Tensor, bit16: torch.Tensor) -> bool:
    """Whether ``master`` holds exactly (bit for bit: -0.0 is not 0.0 here, and a NaN equals its
    own up-cast) the up-cast of ``bit16``: the library's one pass over both (no temporary; torch's
    way, a copy and a compare per chunk, took a tenth of a small resume)."""
    return bool(_C.holds_upcast(master.view(-1), bit16.view(-1)))
