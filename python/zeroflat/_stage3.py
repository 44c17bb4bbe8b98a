"""The drop-in for DeepSpeed's Stage 3 optimizer (``DeepSpeedZeroOptimizer_Stage3``), installed
by ``zeroflat.deepspeed.install()`` with the ZeRO-1/2 hooks.

Stage 3 keeps each parameter's partition as ``param.ds_tensor``; its optimizer moves every
sub-group's partitions, in order, into one buffer of this rank (``lp_param_buffer``, whose ranges
are ``fp16_partitioned_groups_flat``) and re-points them as views, or, with ``offload_param``,
into one host buffer per optimizer param group. The hooks hand that step to zeroflat:

- the partitions are already back-to-back 1-D views of one storage (the loader built them so):
  that span is the buffer, no copy, no allocation (``stats["adopted"]``);
- otherwise zeroflat concatenates them (one rank's group, no padding) through its front door:
  probe, planner (device, staged or host tier), rollback; the release's own bytes;
- a buffer zeroflat cannot build as the release would is the release's own, with one warning
  saying why (``stats["fallbacks"]``).

Every rank of the optimizer's data-parallel group takes the same path (one all-reduce).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

import zeroflat
from . import _dropin
from ._comm import all_reduce_ints
from ._dropin import log, stats
from ._dropin import state as _state
from ._patches import Patch

KIND = "DeepSpeedZeroOptimizer_Stage3"


# --- what the ranks find ------------------------------------------------------------------------

def _span(tensors: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The 1-D view of the storage ``tensors`` cover when they are 1-D views of it of one dtype
    and device, back to back in this order (each starts where the previous one ends); else None.
    Tensors without elements have no bytes and sit anywhere."""
    if not tensors:
        return None
    first = tensors[0]
    if any(t.dtype != first.dtype or t.device != first.device or t.dim() != 1
           or not t.is_contiguous() for t in tensors):
        return None
    full = [t for t in tensors if t.numel()]
    if not full:
        return None
    storage = full[0].untyped_storage().data_ptr()
    at = full[0].storage_offset()
    base = at
    for t in full:
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != at:
            return None
        at += t.numel()
    return full[0].detach().as_strided((at - base,), (1,), base)


def _why_not(tensors: List[torch.Tensor], dtype: Optional[torch.dtype] = None,
             device: Optional[str] = None) -> Optional[str]:
    """Why zeroflat's concatenation would not be the buffer the release builds, or None."""
    if not tensors:
        return "the buffer has no partitions"
    first = tensors[0]
    if any(t.dtype != first.dtype for t in tensors):
        return "the partitions mix dtypes ({})".format(
            ", ".join(sorted({str(t.dtype) for t in tensors})))
    if dtype is not None and first.dtype != dtype:
        return (f"the partitions are {first.dtype} and the release converts them into a "
                f"{dtype} buffer")
    if any(t.device != first.device for t in tensors):
        return "the partitions are on different devices"
    if device is not None and first.device.type != device:
        return f"the partitions are on {first.device}, the release's buffer in {device} memory"
    if any(t.dim() != 1 or not t.is_contiguous() for t in tensors):
        return "a partition is not a 1-D contiguous tensor"
    if sum(t.numel() for t in tensors) == 0:
        return "the partitions have no elements"
    return None


def _agree(process_group, adopt: bool, build: bool, tag: str) -> Tuple[bool, bool]:
    """(every rank adopts, every rank can build): one all-reduce of two flags."""
    a, b = all_reduce_ints([int(adopt), int(build)], process_group, "min",
                           "the ranks' agreement on how Stage 3's buffer is built (an all-reduce)",
                           tag)
    return bool(a), bool(b)


# --- the buffer ---------------------------------------------------------------------------------

def _record(what: str, numel: int, how: str) -> None:
    stats["stage3"].append({"buffer": what, "numel": numel, "how": how})


def _buffer(opt, what: str, tensors: List[torch.Tensor], release: Callable[[], torch.Tensor], *,
            dtype: Optional[torch.dtype] = None, device: Optional[str] = None,
            host_pins: bool = False) -> torch.Tensor:
    """The buffer the release would build from ``tensors`` (this rank's partitions, in order),
    each re-pointed into it as the release re-points them: adopted, built by zeroflat, or
    ``release()``'s own."""
    reason = _why_not(tensors, dtype, device)
    span = _span(tensors) if reason is None else None
    unpinned = span is not None and host_pins and not span.is_pinned()
    if unpinned:
        span = None  # the release page-locks this buffer; a plain host span is not its buffer
    if reason is not None:
        cause = reason
    elif unpinned:
        cause = "the release page-locks this host buffer and they are not page-locked"
    elif span is not None:
        cause = "another rank's partitions are not back-to-back views of one buffer"
    else:
        cause = ("they are not back to back in the optimizer's order (sub-groups of each param "
                 "group in turn, parameters in group order, frozen ones left out)")
    if reason is None and host_pins:
        reason = ("the release page-locks this host buffer and zeroflat's host buffers are not "
                  "page-locked")
    group = getattr(opt, "dp_process_group", None)
    adopt, build = _agree(group, span is not None, reason is None, f"stage3-{id(opt)}-{what}")
    if reason is None and not build:
        reason = "another rank's partitions cannot be concatenated by zeroflat"
    numel = sum(t.numel() for t in tensors)
    if adopt:
        flat, how, reason = span, "adopted", None
        log.info("zeroflat: %s %s adopted the partitions' buffer", KIND, what)
    else:
        _say_not_adopted(what, tensors, cause)
    if not adopt and reason is None:
        flat, how, reason = _concatenate(tensors, what)
        if flat is not None:
            log.info("zeroflat: %s %s built with the %s tier", KIND, what, how)
    if reason is not None:
        _record(what, numel, "release")
        _dropin.fallback(f"{KIND} {what}", reason)
        return release()
    _dropin.built(KIND, how)
    _record(what, numel, how)
    at = 0
    for t in tensors:  # as the release re-points them
        t.data = flat.narrow(0, at, t.numel())
        at += t.numel()
    return flat


def _say_not_adopted(what: str, tensors: List[torch.Tensor], cause: str) -> None:
    """One warning (and ``stats["not_adopted"]``) when this rank's partitions lie in one buffer,
    as a loader leaves them, and are not adopted all the same."""
    full = [t for t in tensors if t.numel()]
    if len(full) < 2 or len({t.untyped_storage().data_ptr() for t in full}) != 1:
        return
    size = sum(t.numel() * t.element_size() for t in full)
    message = (f"zeroflat: {KIND} {what}: this rank's partitions lie in one buffer but it was "
               f"not adopted ({size} bytes copied): {cause}")
    stats["not_adopted"].append(message)
    log.warning("%s", message)


def _concatenate(tensors: List[torch.Tensor], what: str):
    """(flat, tier, None) from zeroflat's front door, or (None, None, why) with nothing moved. The
    release's buffer is the partitions back to back: the library checks its layout is that."""
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += t.numel()
    try:
        fg = zeroflat.flatten_param_group(
            tensors, None, alignment_factor=1, param_align_bytes=0, master_dtype=None,
            trainable_only=False, check_values=False, deepspeed=None, expected_offsets=offsets,
            expected_flat_numel=at, _rebinds=True)
    except (TypeError, ValueError, zeroflat.NoFeasiblePlan) as e:  # nothing moved
        return None, None, str(e)
    except zeroflat.ExecutionError as e:
        if e.outcome != "recovered":
            raise
        fg = e.flat_group  # the values are safe in the completed buffer
        log.warning("zeroflat: %s %s: %s", KIND, what, e)
    return fg.flat, fg.tier, None


# --- the hooks (installed by _patches: hook(original, *args, **kwargs)) --------------------------

def _current(opt=None):
    cur = getattr(_state, "zero3", None)
    return cur if opt is None or cur is opt else None


def _init(original, self, *args, **kwargs):
    """DeepSpeedZeroOptimizer_Stage3.__init__: the optimizer being built is marked on this
    thread."""
    outer = getattr(_state, "zero3", None)
    _state.zero3 = self
    try:
        original(self, *args, **kwargs)
    finally:
        _state.zero3 = outer


def _defragment(original, tensors):
    """defragment (0.19: the stage3 module's utility; up to 0.18: the optimizer's static method):
    lp_param_buffer from zeroflat, or adopted."""
    opt = _current()
    if opt is None or getattr(opt, "offload_param", False):
        return original(tensors)
    mine = [p.ds_tensor for sub_group in getattr(opt, "fp16_groups", []) for p in sub_group]
    given = list(tensors)
    if len(mine) != len(given) or any(a is not b for a, b in zip(mine, given)):
        return original(tensors)  # not the optimizer's own call during its __init__
    return _buffer(opt, "lp_param_buffer", given, lambda: original(tensors))


def _host_pins() -> bool:
    """Whether the accelerator page-locks the host buffers it is handed (CUDA does; the CPU
    accelerator hands them back as they are)."""
    from deepspeed.accelerator import get_accelerator

    probe = torch.empty(1)
    return get_accelerator().pin_memory(probe) is not probe


def _cpu_memory(original, self):
    """_create_param_groups_fp16_flat_cpu_memory: with offload_param, one host buffer per
    optimizer param group, which _move_to_flat_buffer then fills sub-group by sub-group."""
    if _current(self) is None:
        return original(self)
    own = self.trainable_param_groups
    groups = list(own)
    if getattr(self, "params_in_nvme_and_cpu", False):
        for j in range(len(groups)):
            _record(f"param group {j}", 0, "release")
            _dropin.fallback(f"{KIND} param group {j}", "its parameters are offloaded to NVMe "
                             "(the release sizes it by max_in_cpu)")
        return original(self)
    pins = _host_pins()

    def release_one(j):
        # The release's own function for this one group (each group's buffer depends on that
        # group alone when nothing is on NVMe).
        self.trainable_param_groups = [groups[j]]
        try:
            original(self)
        finally:
            self.trainable_param_groups = own
        return self.param_groups_fp16_flat_cpu_memory.pop()

    for j, g in enumerate(groups):
        tensors = [p.ds_tensor for p in g["params"]]
        flat = _buffer(self, f"param group {j}", tensors, lambda j=j: release_one(j),
                       dtype=self.dtype, device="cpu", host_pins=pins)
        self.param_groups_fp16_flat_cpu_memory.append(flat)


def _move(original, self, param_list, flat_buffer, avoid_copy=False):
    """_move_to_flat_buffer: a partition that already is its place in the buffer is not copied
    onto itself (the release's own avoid_copy)."""
    if flat_buffer is not None and not avoid_copy and _current(self) is not None:
        at, size = 0, flat_buffer.element_size()
        in_place = True
        for p in param_list:
            src = p.ds_tensor
            if (src.dtype != flat_buffer.dtype or src.device != flat_buffer.device
                    or (src.numel() and src.data_ptr() != flat_buffer.data_ptr() + at * size)):
                in_place = False
                break
            at += src.ds_numel
        avoid_copy = in_place
    return original(self, param_list, flat_buffer, avoid_copy=avoid_copy)


def patches() -> Tuple[List[Patch], Optional[str]]:
    """Stage 3's patches in the installed release, or none and why not."""
    try:
        from deepspeed.runtime.zero import stage3
    except ImportError as e:
        return [], f"deepspeed.runtime.zero.stage3 is not importable ({e})"
    cls = getattr(stage3, "DeepSpeedZeroOptimizer_Stage3", None)
    if cls is None:
        return [], "it has no DeepSpeedZeroOptimizer_Stage3"
    out = [Patch(cls, "__init__", hook=_init)]
    if isinstance(vars(cls).get("defragment"), staticmethod):
        out.append(Patch(cls, "defragment", hook=_defragment))
    elif callable(vars(stage3).get("defragment")):
        out.append(Patch(stage3, "defragment", hook=_defragment))
    else:
        return [], "its Stage 3 optimizer has no defragment step to build lp_param_buffer"
    for name, hook in (("_create_param_groups_fp16_flat_cpu_memory", _cpu_memory),
                       ("_move_to_flat_buffer", _move)):
        if not callable(vars(cls).get(name)):
            return [], f"its Stage 3 optimizer has no {name} (offload_param's buffers)"
        out.append(Patch(cls, name, hook=hook))
    return out, None
