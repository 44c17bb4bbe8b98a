"""What the DeepSpeed drop-in's parts share (``deepspeed`` for ZeRO-1/2, ``_stage3`` for Stage 3):
its counters, its log, the release's rules, and the state of the optimizer being built on this
thread."""

from __future__ import annotations

import logging
import threading
from typing import Callable, List, Optional

log = logging.getLogger("zeroflat.deepspeed")

# What the drop-in did since the process started (zeroflat.deepspeed.stats).
stats = {"release": None, "groups": 0, "fallbacks": 0, "tiers": [], "optimizers": [],
         "fallback_reasons": [], "not_flattened": [], "adopted": 0, "not_adopted": [],
         "stage3": [], "stage3_refused": None, "resumes": [], "resume_fallbacks": [], "saves": [], "save_fallbacks": [],
         "broadcasts_skipped": 0, "clones_skipped": 0, "masters_taken": 0}

# The optimizer being built on this thread, and what its flatten steps recorded.
state = threading.local()

# The installed release's layout rules (zeroflat._C.ReleaseRules), while installed.
rules: Optional[object] = None

# The caller's progress callback for the drop-in's long reads (a resume), while installed.
progress: Optional[Callable[..., None]] = None


def fallback(what: str, reason: str) -> None:
    """One buffer left to DeepSpeed itself: counted, and said once."""
    stats["fallbacks"] += 1
    stats["fallback_reasons"].append(f"{what}: {reason}")
    log.warning("zeroflat: %s built by DeepSpeed itself: %s", what, reason)


def built(kind: str, tier: str) -> None:
    """One buffer built (or adopted) by zeroflat."""
    stats["groups"] += 1
    stats["tiers"].append(tier)
    stats["optimizers"].append(kind)
    if tier == "adopted":
        stats["adopted"] += 1


def round_robin_offsets(opt, i: int, numels: List[int], padding: List[int]) -> List[int]:
    """Where DeepSpeedZeroOptimizer's group i puts its parameters (round-robin order, numels and
    paddings in that order) in its flat buffer: the release's own offsets (0.19.8 keeps them),
    else a concatenation with each parameter's padding after it, as unflatten reads it back."""
    offsets = getattr(opt, "round_robin_bit16_offsets", None)
    if offsets is not None and len(offsets) > i:
        return list(offsets[i])
    out, at = [], 0
    for n, pad in zip(numels, padding):
        out.append(at)
        at += n + pad
    return out
