"""DeepSpeed drop-in: ZeRO stages 1, 2 and 3 build their flat parameter buffers through zeroflat.

    import zeroflat.deepspeed
    zeroflat.deepspeed.install()          # before deepspeed.initialize
    engine, optimizer, _, _ = deepspeed.initialize(...)

Every DeepSpeed release from 0.14 on: ``DeepSpeedZeroOptimizer`` (ZeRO-1 and 2) and, for bf16
ZeRO-1 with fp32 gradient accumulation, ``BF16_Optimizer`` obtain each parameter group's flat
buffer from ``zeroflat.flatten_param_group`` (zeroflat's probe, planner, tiers and rollback, over
the group's own data-parallel group); releases up to 0.18.6 would copy every rank's whole model
to the host and flatten it there. ``DeepSpeedZeroOptimizer_Stage3`` obtains its buffer of this
rank's partitions (``lp_param_buffer``; with offload_param, one per param group) the same way,
or adopts the one the partitions already are views of (``_stage3``); the buffers are the ones
that release would have built. ``engine.load_checkpoint`` and ``save_checkpoint`` go through
zeroflat too (``_resume``, ``_save``). See docs/deepspeed.md and docs/python.md.
"""

from __future__ import annotations

import contextlib
import linecache
import math
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch

import zeroflat
from . import _dropin, _load, _resume, _save, _stage3
from ._comm import all_reduce_ints
from ._common import engine_threads, select
from ._save import wait  # noqa: F401 - zeroflat.deepspeed.wait
from ._dropin import log, round_robin_offsets, stats
from ._dropin import state as _state
from ._patches import Patch, apply, patched, restore
from ._progress import check_callback
from ._trainer import trainer_param_groups

__all__ = ["SUPPORTED_VERSIONS", "install", "installed", "is_installed", "uninstall", "wait",
           "stats"]

# The releases the test suite compares with DeepSpeed's own buffers, bit for bit: the last patch
# of every line from 0.14 to 0.19, and 0.18.6, the last without the on-accelerator flatten.
SUPPORTED_VERSIONS = zeroflat.TESTED_DEEPSPEED_RELEASES

_lock = threading.Lock()
_applied = None  # the drop-in's patches in place (_patches.Applied), while installed

# How DeepSpeed fills a buffer when nothing else says otherwise: torch's concatenation. A group
# whose optimizer fills it another way (ZenFlow stores 2-D parameters transposed) is DeepSpeed's.
_STANDARD_FLATTEN = (torch._utils._flatten_dense_tensors, torch._C._nn.flatten_dense_tensors)


def _deepspeed_modules():
    try:
        import deepspeed
        from deepspeed.runtime.zero import stage_1_and_2
    except ImportError as e:
        raise RuntimeError(f"zeroflat.deepspeed: DeepSpeed is not importable: {e}") from e
    return deepspeed, stage_1_and_2


def _release_rules(deepspeed) -> "zeroflat._C.ReleaseRules":
    version = getattr(deepspeed, "__version__", "unknown")
    try:
        return zeroflat._C.deepspeed_rules(version)
    except ValueError as e:
        raise RuntimeError(f"zeroflat.deepspeed: {e}; nothing was changed") from e


def _independent(sources: List[torch.Tensor]) -> List[torch.Tensor]:
    """The group's values as tensors zeroflat can gather: a parameter that is a view with gaps
    (a column slice) or that shares bytes with another one (two Parameters over one storage) is
    copied first, as DeepSpeed's concatenation copies it; the buffer then unties them."""
    out = list(sources)
    spans = []
    for k, t in enumerate(out):
        if t.numel() == 0:
            continue
        if not t.is_contiguous():
            out[k] = t.detach().contiguous()
            continue
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), k))
    spans.sort()
    end = 0
    for lo, hi, k in spans:
        if lo < end:
            out[k] = out[k].detach().clone()
        end = max(end, hi)
    return out


def _why_not(opt, sources, alignment: int, world: int) -> Optional[str]:
    """Why zeroflat's buffer would not be the one this optimizer builds, or None (the layout
    itself is checked by the library against the optimizer's own bookkeeping: flatten's
    expected_offsets)."""
    if not any(opt.flatten is f for f in _STANDARD_FLATTEN):
        return (f"this optimizer fills its buffer with {getattr(opt.flatten, '__module__', '?')}."
                f"{getattr(opt.flatten, '__name__', '?')} (ZenFlow stores 2-D parameters "
                "transposed), not a plain concatenation")
    if alignment % world != 0:
        return f"alignment {alignment} is not a multiple of the group size {world}"
    if any(t.dtype != sources[0].dtype for t in sources):
        return "the group mixes dtypes"
    return None


def _adoptable(sources, offsets: List[int], flat_numel: int) -> Optional[torch.Tensor]:
    """The flat buffer zeroflat's loader built, when the group's parameters are exactly its
    views at the offsets this optimizer would give them and it has this optimizer's length."""
    flat = _load.loaded_buffer(sources)
    if flat is None or flat.numel() != flat_numel:
        return None
    base = flat.storage_offset()
    storage = flat.untyped_storage().data_ptr()
    for t, off in zip(sources, offsets):
        if (t.dtype != flat.dtype or t.device != flat.device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage
                or t.storage_offset() != base + off):
            return None
    return flat


def _all_agree(ok: bool, process_group, tag: str) -> bool:
    """Whether every rank of the group says ok (one all-reduce)."""
    return bool(all_reduce_ints([int(ok)], process_group, "min",
                                "the ranks' agreement on adopting a loaded buffer (an all-reduce)",
                                tag)[0])


@dataclass
class _Record:
    """What became of one group of the optimizer being built."""

    index: int
    adopted: bool
    loaded: Optional[_load.LoadedBuffer]  # a buffer the loader built that it has views of
    bytes: int  # the group's flat buffer


def _build(opt, kind: str, i: int, sources, alignment: int, process_group, offsets, padding,
           palign: int, original: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Group i's buffer from zeroflat, or from DeepSpeed (original()) with a warning saying why."""
    import torch.distributed as dist

    world = dist.get_world_size(group=process_group)
    padded = sum(t.numel() for t in sources) + sum(padding)
    flat_numel = padded + (-padded) % alignment
    reason = _why_not(opt, sources, alignment, world)
    # A buffer zeroflat's loader already built in exactly this layout is the group's buffer as it
    # is: no copy, no allocation. Every rank must find one, or none adopts.
    adopted = _adoptable(sources, offsets, flat_numel) if reason is None else None
    record = _Record(index=i, adopted=False,
                     loaded=next((e for t in sources if (e := _load.loaded_entry(t))), None),
                     bytes=flat_numel * (sources[0].element_size() if sources else 0))
    records = getattr(_state, "records", None)
    if records is not None:
        records.append(record)
    if _all_agree(adopted is not None, process_group, f"{kind}-{id(opt)}-{i}"):
        record.adopted = True
        _dropin.built(kind, "adopted")
        log.info("zeroflat: %s param group %d adopted the buffer zeroflat loaded", kind, i)
        return adopted
    if reason is None:
        try:
            # The optimizer's own bookkeeping (offsets, the buffer's length) is what the library
            # checks its layout against, before anything moves.
            fg = zeroflat.flatten_param_group(
                _independent(sources), process_group, alignment_factor=alignment // world,
                param_align_bytes=palign, master_dtype=None, trainable_only=False,
                deepspeed=_dropin.rules.release, expected_offsets=offsets,
                expected_flat_numel=flat_numel, _rebinds=True)
        except (TypeError, ValueError, zeroflat.NoFeasiblePlan) as e:  # nothing moved
            reason = str(e)
        except zeroflat.ExecutionError as e:
            if e.outcome != "recovered":
                raise
            fg = e.flat_group  # the values are safe in the completed buffer
            log.warning("zeroflat: %s group %d: %s", kind, i, e)
        if reason is None:
            _dropin.built(kind, fg.tier)
            log.info("zeroflat: %s param group %d flattened with the %s tier (%s)", kind, i,
                     fg.tier, fg.report.get("reason", ""))
            return fg.flat
    _dropin.fallback(f"{kind} group {i}", reason)
    return original()


def _names(groups: List[List[str]]) -> str:
    sizes = " and ".join(str(len(g)) for g in groups)
    return f"{len(groups)} group{'s' if len(groups) != 1 else ''} of {sizes} parameters"


def _matching_param_groups(model, wanted: List[List[str]], rules) -> str:
    """The param_groups= of zeroflat.hf.from_pretrained (or load_param_groups) that lays the
    buffers out for ``wanted``, the optimizer's groups as DeepSpeed formed them."""
    by_name = dict(model.named_parameters())

    def as_release_forms(groups) -> List[List[str]]:
        out = []
        for g in groups:
            kept, _ = select([by_name[n] for n in g], rules, trainable_only=True)
            if kept:
                out.append([g[k] for k in kept])
        return out

    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if as_release_forms([trainable]) == wanted:
        return "param_groups=None"
    try:
        if as_release_forms(trainer_param_groups(model)) == wanted:
            return 'param_groups="trainer"'
    except (ImportError, AttributeError, KeyError):
        pass
    shown = "; ".join("[" + ", ".join(repr(n) for n in g[:2]) + (", ..." if len(g) > 2 else "")
                      + "]" for g in wanted[:3])
    return (f"param_groups= the optimizer's {_names(wanted)} as lists of names ({shown}"
            f"{'; ...' if len(wanted) > 3 else ''})")


def _not_adopted(kind: str, groups: List[List[torch.Tensor]], records: List[_Record],
                 round_robin: bool) -> Optional[str]:
    """One warning for an optimizer whose groups met buffers zeroflat loaded but did not adopt
    them all: how its groups differ from those the buffers were laid out for, the bytes copied,
    and the param_groups= that would have matched."""
    missed = [r for r in records if r.loaded is not None and not r.adopted]
    if not missed:
        return None
    entry = missed[0].loaded
    model = entry.model()
    copied = sum(r.bytes for r in missed)
    head = (f"zeroflat: {kind}: {len(missed)} of {len(records)} param groups did not adopt the "
            f"buffers zeroflat loaded; their {copied} bytes were copied into new buffers")
    if model is None:
        return head
    names = {id(p): n for n, p in model.named_parameters()}
    wanted = [[names.get(id(t), "?") for t in g] for g in groups]
    wanted = [g for g in wanted if g]
    loaded = entry.groups
    if wanted == loaded and round_robin != entry.round_robin:
        how = (f"the groups are the ones loaded, but round_robin_gradients is "
               f"{'on' if round_robin else 'off'} and the buffers were loaded with round_robin="
               f"{entry.round_robin}; load with round_robin={round_robin} to have them adopted")
    elif wanted == loaded:
        how = "the groups are the ones loaded, but DeepSpeed lays them out otherwise (see above)"
    else:
        if sorted(map(sorted, wanted)) == sorted(map(sorted, loaded)):
            differ = "the same parameters in another order"
        else:
            differ = (f"the optimizer has {_names(wanted)}, the buffers were laid out for "
                      f"{_names(loaded)}")
        how = (f"{differ}; load with {_matching_param_groups(model, wanted, _dropin.rules)} "
               "to have them adopted")
    return f"{head}: {how}"


def _warn_not_adopted(kind: str, groups, round_robin: bool) -> None:
    records = getattr(_state, "records", None) or []
    try:
        message = _not_adopted(kind, [list(g) for g in groups or []], records, round_robin)
    except Exception as e:  # noqa: BLE001 - a warning must never break DeepSpeed's init
        message = f"zeroflat: {kind}: loaded buffers were not all adopted ({e})"
    if message is not None:
        stats["not_adopted"].append(message)
        log.warning("%s", message)


# --- the hooks (installed by _patches: hook(original, *args, **kwargs)) --------------------------

def _zero_flatten(original, self, tensor_list, alignment, *args, **kwargs):
    """DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned: group i's buffer from zeroflat."""
    # (tensor_list, alignment, use_cpu_data=False[, param_padding=None]) in every release.
    names = ("use_cpu_data", "param_padding")
    given = dict(zip(names, args), **kwargs)
    groups = getattr(self, "round_robin_bit16_groups", None)
    flats = getattr(self, "bit16_groups_flat", None)
    # Only the call that builds group i's buffer during __init__ is ours (step() and checkpoint
    # loading call it too).
    if (getattr(_state, "zero_init", None) is not self or not groups or flats is None
            or len(flats) != len(groups) - 1 or tensor_list is not groups[-1]):
        return original(self, tensor_list, alignment, *args, **kwargs)
    i = len(flats)
    # Releases up to 0.18.6 staged the parameters for the host: their values are in cpu_data
    # (which the install kept on the device), their .data is a placeholder.
    sources = ([p.cpu_data for p in tensor_list] if given.get("use_cpu_data")
               else list(tensor_list))
    padding = list(given.get("param_padding") or [0] * len(sources))
    offsets = round_robin_offsets(self, i, [t.numel() for t in sources], padding)
    palign = 16 if getattr(self, "parameter_alignment", False) else 0
    return _build(self, "DeepSpeedZeroOptimizer", i, sources, alignment,
                  self.real_dp_process_group[i], offsets, padding, palign,
                  lambda: original(self, tensor_list, alignment, *args, **kwargs))


def _bf16_flatten(original, self, tensor_list, alignment):
    """BF16_Optimizer._flatten_dense_tensors_aligned: group i's buffer from zeroflat."""
    groups = getattr(self, "bf16_groups", None)
    flats = getattr(self, "bf16_groups_flat", None)
    if (getattr(_state, "bf16_init", None) is not self or not groups or flats is None
            or len(flats) != len(groups) - 1 or tensor_list is not groups[-1]):
        return original(self, tensor_list, alignment)
    i = len(flats)
    sources = list(tensor_list)
    offsets, at = [], 0
    for t in sources:
        offsets.append(at)
        at += t.numel()
    return _build(self, "BF16_Optimizer", i, sources, alignment, self.real_dp_process_group[i],
                  offsets, [0] * len(sources), 0, lambda: original(self, tensor_list, alignment))


def _keep_on_device(optimizer) -> List[Patch]:
    """While a ZeRO optimizer is constructed on this thread, ``.cpu()`` of a trainable
    parameter's data returns the data itself: releases without the memory check
    (ReleaseRules.checks_accelerator_memory), and any release whose accelerator is not
    available, stage every parameter to the host before flattening, and zeroflat plans that move
    instead. Any other ``.cpu()`` is torch's."""
    ptrs = {p.data_ptr() for g in getattr(optimizer, "param_groups", []) for p in g["params"]
            if isinstance(p, torch.Tensor) and p.requires_grad and p.numel() > 0
            and p.device.type != "cpu"}
    if not ptrs:
        return []

    def cpu(original, t, *args, **kwargs):
        if (getattr(_state, "zero_init", None) is not None and not args and not kwargs
                and t.device.type != "cpu" and t.data_ptr() in ptrs):
            return t
        return original(t, *args, **kwargs)

    return [Patch(torch.Tensor, "cpu", hook=cpu)]


class _FastHostCopies:
    """While an optimizer is constructed on this thread, the large host buffers it makes from
    zeroflat's buffer (the bf16 partition's clone, its fp32 up-cast: the master partition) come
    from zeroflat's engine: a fresh mapping whose pages each thread of the engine faults in for
    its share, a chunk at a time in one call to the kernel (``prefault_for_write``), where torch
    takes a fault per 4 KiB page on one thread; and its large zeros (the gradient partitions
    the optimizer makes to initialize its state, and drops) are a fresh mapping left untouched,
    which reads as zeros, where torch writes every byte. The values are torch's to the bit
    (clone copies, bf16 or fp16 to fp32 is exact, zeros are zeros); anything else is torch's.

    A clone converted in the same expression (``x.clone().float()``, ``x.clone().to(...)``: how
    DeepSpeed's ZeRO-1/2 and bf16 optimizers make their fp32 master partition) is not made: the
    conversion is the only thing that ever sees it, and reads the same values from ``x``. Its
    bytes would be a fresh buffer of the partition's size, faulted in and dropped at once. The
    call's own source position says so (Python 3.11 on); a conversion that would not copy (to
    the clone's own dtype) gets a real clone first.

    Where zeroflat's load built this rank's fp32 master partition from the very partition being
    up-cast (``zeroflat.hf.from_pretrained``, or ``load_param_groups`` with its master), and the
    partition's bytes are still the ones it was built from (their checksum then and now), that
    master is the up-cast's result: no copy at all. Whatever the optimizer did not take is
    forgotten when it is built."""

    kMinBytes = 8 << 20
    _CONVERSIONS = (".float()", ".to(")

    def __init__(self):
        self.engine = None
        self.threads = zeroflat._C.default_threads(zeroflat._C.local_ranks() or 1)
        self.pending = []  # clones not made: views of their source, awaiting their conversion

    def _large(self, t):
        return (getattr(_state, "fast_host", False) and t.device.type == "cpu" and not t.is_sparse
                and t.is_contiguous() and not (t.requires_grad and torch.is_grad_enabled())
                and t.numel() * t.element_size() >= self.kMinBytes)

    def _engine(self):
        if self.engine is None:
            self.engine = zeroflat._C.TorchDevice("cpu", self.threads)
        return self.engine

    def _upcast(self, t):
        # The master partition zeroflat's load built from this very partition, when its bytes
        # are still the ones it was built from: no copy at all.
        taken = _load.take_master(t, self._engine())
        if taken is not None:
            stats["masters_taken"] += 1
            return taken.view(t.shape)
        return self._engine().upcast(t).view(torch.float32).view(t.shape)

    def _copy(self, t):
        return self._engine().clone(t).view(t.dtype).view(t.shape)

    def _clone(self, original, t, *args, **kwargs):
        if not args and not kwargs and self._large(t):
            if t.dtype in (torch.bfloat16, torch.float16) and _converted_at_once():
                view = t.view(t.shape)
                self.pending.append(view)
                return view
            return self._copy(t)
        return original(t, *args, **kwargs)

    def _skipped(self, t):
        """Whether t is a clone not made, now meeting its conversion (no longer pending)."""
        for i, view in enumerate(self.pending):
            if view is t:
                del self.pending[i]
                return True
        return False

    def _float(self, original, t, *args, **kwargs):
        skipped = self._skipped(t)
        if not args and not kwargs and t.dtype in (torch.bfloat16, torch.float16) \
                and self._large(t):
            stats["clones_skipped"] += skipped
            return self._upcast(t)
        return original(self._copy(t) if skipped else t, *args, **kwargs)

    def _to(self, original, t, *args, **kwargs):
        # .to(torch.float32) and .to(device=<cpu>, dtype=torch.float32), as the optimizers build
        # their fp32 master partitions.
        positional = args[0] if len(args) == 1 and isinstance(args[0], torch.dtype) else None
        dtype = kwargs.get("dtype", positional)
        device = kwargs.get("device")
        extra = (set(kwargs) - {"dtype", "device"}
                 or (args and not isinstance(args[0], torch.dtype)))
        skipped = self._skipped(t)
        if (dtype == torch.float32 and not extra and t.dtype in (torch.bfloat16, torch.float16)
                and (device is None or torch.device(device).type == "cpu") and self._large(t)):
            stats["clones_skipped"] += skipped
            return self._upcast(t)
        return original(self._copy(t) if skipped else t, *args, **kwargs)

    def _zeros(self, original, *args, **kwargs):
        # torch.zeros(n) or torch.zeros((n, m)), with at most dtype and device, on the host.
        shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) \
            else args
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        device = kwargs.get("device")
        if device is None:
            get_default = getattr(torch, "get_default_device", None)
            device = get_default() if get_default is not None else "cpu"
        if (getattr(_state, "fast_host", False) and shape
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                and not set(kwargs) - {"dtype", "device"} and isinstance(dtype, torch.dtype)
                and torch.device(device).type == "cpu"):
            itemsize = getattr(dtype, "itemsize", 0)  # torch 2.1 on; else torch's zeros
            nbytes = math.prod(shape) * itemsize
            if itemsize and nbytes >= self.kMinBytes:
                return self._engine().zeros(nbytes).view(dtype).view(tuple(shape))
        return original(*args, **kwargs)

    @contextlib.contextmanager
    def on(self):
        with patched([Patch(torch.Tensor, "clone", hook=self._clone),
                      Patch(torch.Tensor, "to", hook=self._to),
                      Patch(torch.Tensor, "float", hook=self._float),
                      Patch(torch, "zeros", hook=self._zeros)]):
            _state.fast_host = True
            try:
                yield
            finally:
                _state.fast_host = False
                self.pending.clear()


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _converted_at_once():
    """Whether the call of Tensor.clone being made (its caller: the first frame outside this
    package) is followed in its source by ``.float()`` or ``.to(`` on its result, from the
    call's end position (Python 3.11's code positions). False wherever that cannot be told."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    positions = getattr(frame.f_code, "co_positions", None) if frame is not None else None
    if positions is None or frame.f_lasti < 0:
        return False
    try:
        for i, position in enumerate(positions()):
            if i == frame.f_lasti // 2:
                break
        else:
            return False
    except (TypeError, ValueError):
        return False
    _, end_line, _, end_col = position
    if end_line is None or end_col is None:
        return False
    line = linecache.getline(frame.f_code.co_filename, end_line)
    # Columns count UTF-8 bytes.
    rest = line.encode()[end_col:].decode(errors="replace")
    return rest.startswith(_FastHostCopies._CONVERSIONS)


def _zero_init(original, self, init_optimizer, *args, **kwargs):
    """DeepSpeedZeroOptimizer.__init__: the optimizer being built is marked on this thread."""
    from deepspeed.accelerator import get_accelerator

    # A release with the memory check (ReleaseRules.checks_accelerator_memory) would move a
    # group to the host when its buffer does not fit beside the parameters; zeroflat plans that
    # decision (and the other tiers) itself, so the check passes meanwhile.
    while_init = _keep_on_device(init_optimizer)
    if _dropin.rules.checks_accelerator_memory:
        while_init.append(Patch(get_accelerator(), "available_memory",
                                value=lambda *a, **k: 1 << 62))
    _state.zero_init = self
    _state.records = []
    try:
        with patched(while_init), _FastHostCopies().on():
            original(self, init_optimizer, *args, **kwargs)
        _warn_not_adopted("DeepSpeedZeroOptimizer", getattr(self, "bit16_groups", None),
                          bool(getattr(self, "round_robin_gradients", False)))
    finally:
        _load.forget_masters(r.loaded for r in _state.records or [])
        _state.zero_init = None
        _state.records = None


def _bf16_init(original, self, *args, **kwargs):
    """BF16_Optimizer.__init__: the optimizer being built is marked on this thread."""
    _state.bf16_init = self
    _state.records = []
    try:
        with _FastHostCopies().on():
            original(self, *args, **kwargs)
        _warn_not_adopted("BF16_Optimizer", getattr(self, "bf16_groups", None), False)
    finally:
        _load.forget_masters(r.loaded for r in _state.records or [])
        _state.bf16_init = None
        _state.records = None


def _unfused_init(original, self, init_optimizer, *args, **kwargs):
    """FP16_UnfusedOptimizer.__init__: says so when a bf16 model lands here."""
    bf16 = any(p.dtype == torch.bfloat16 for g in init_optimizer.param_groups
               for p in g["params"])
    if bf16:
        # 0.17.x and 0.18.0-0.18.5 route bf16 + ZeRO-1 + fp32 gradient accumulation here (a
        # DeepSpeed bug): no ZeRO partitioning, no flat buffer for zeroflat to build.
        msg = (f"DeepSpeed {stats['release']} runs this bf16 model with "
               "FP16_UnfusedOptimizer (no ZeRO flat buffers): nothing for zeroflat to build")
        stats["not_flattened"].append(msg)
        log.warning("zeroflat: %s", msg)
    original(self, init_optimizer, *args, **kwargs)


def _broadcast_model(original, engine):
    """DeepSpeedEngine._broadcast_model: every parameter sent from the group's first rank to the
    others, so that all start alike. Where they already are alike (loaded from one checkpoint, or
    made from one seed), that moves the whole model over the network for nothing (seconds between
    nodes). The ranks first compare a checksum of their parameters (names, shapes, dtypes and
    bytes); only where every rank's is the same is the broadcast left out, else it runs as
    DeepSpeed's. Expert-parallel parameters (DeepSpeed's MoE) and partitioned ones (ZeRO-3) are
    always left to DeepSpeed."""
    import hashlib

    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param

    group = getattr(engine, "seq_data_parallel_group", None)
    if group is None or not dist.is_initialized() or dist.get_world_size(group=group) <= 1:
        return original(engine)
    params = [(n, p) for n, p in engine.module.named_parameters() if torch.is_tensor(p)]
    if any(is_moe_param(p) or hasattr(p, "ds_status") or hasattr(p, "ds_optim_param")
           for _, p in params):
        return original(engine)
    # Every rank takes part in the comparison, whatever happens here: a rank that cannot sum
    # its parameters says a value of its own (its rank), which no other rank's equals.
    rank = dist.get_rank(group=group)
    try:
        if any(p.is_cuda for _, p in params):
            torch.cuda.synchronize()  # the sums read what torch's queued work leaves there
        digest = hashlib.blake2b(digest_size=8)
        engines = {}
        threads = engine_threads(None, dist.get_world_size(group=group))
        for name, p in params:
            t = p.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            key = str(t.device)
            if key not in engines:
                engines[key] = zeroflat._C.TorchDevice(key, threads)
            total = engines[key].checksum(t.data_ptr(), t.numel() * t.element_size()) \
                if t.numel() else 0
            digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{total};".encode())
        mine = int.from_bytes(digest.digest(), "little") >> 1  # below 2**63: an int64
    except Exception as e:  # noqa: BLE001 - then DeepSpeed's broadcast, as always
        log.debug("zeroflat: the parameters' checksum failed on this rank (%s)", e)
        mine = -1 - rank
    low, high = all_reduce_ints([mine, -mine], group, "min", "the ranks' parameter checksums",
                                "broadcast")
    if mine >= 0 and low == -high:
        stats["broadcasts_skipped"] += 1
        log.info("zeroflat: every rank already holds the same parameters (checksums agree); "
                 "DeepSpeed's broadcast of the model left out")
        return None
    return original(engine)


def _patches(stage_1_and_2) -> List[Patch]:
    """Every method the drop-in wraps for ZeRO-1/2, where the release has it."""
    opt = stage_1_and_2.DeepSpeedZeroOptimizer
    out = [Patch(opt, "__init__", hook=_zero_init),
           Patch(opt, "flatten_dense_tensors_aligned", hook=_zero_flatten)]
    try:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    except ImportError:
        BF16_Optimizer = None
    if BF16_Optimizer is not None and "_flatten_dense_tensors_aligned" in vars(BF16_Optimizer):
        out += [Patch(BF16_Optimizer, "__init__", hook=_bf16_init),
                Patch(BF16_Optimizer, "_flatten_dense_tensors_aligned", hook=_bf16_flatten)]
    out.append(Patch("deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer",
                     "__init__", hook=_unfused_init, optional=True))
    out.append(Patch("deepspeed.runtime.engine.DeepSpeedEngine", "load_checkpoint",
                     hook=_resume.load_checkpoint))
    out.append(Patch("deepspeed.runtime.engine.DeepSpeedEngine", "save_checkpoint",
                     hook=_save.save_checkpoint))
    out.append(Patch("deepspeed.runtime.engine.DeepSpeedEngine", "_broadcast_model",
                     hook=_broadcast_model, optional=True))
    return out


def install(*, allow_untested: bool = False, progress: Optional[Callable[[Any], None]] = None,
            save_in_background: bool = True, save_priority: str = "idle",
            save_staging_bytes: Optional[int] = None) -> None:
    """Makes DeepSpeed's ZeRO-1/2 and Stage 3 optimizers build their flat buffers via zeroflat.

    Any DeepSpeed from 0.14 on: a release outside SUPPORTED_VERSIONS gets a warning (once;
    ``allow_untested=True`` silences it), and every group is still checked against that
    release's own bookkeeping before anything moves: a group that would differ is flattened by
    DeepSpeed itself, with a warning saying why. Older releases are refused (RuntimeError,
    nothing changed). A release whose Stage 3 optimizer lacks the steps the drop-in takes over
    keeps its own Stage 3, with a warning naming the release and why
    (``stats["stage3_refused"]``); its ZeRO-1/2 are served. Installing twice is harmless; every
    patch is in place or none is (docs/patches.md lists them).
    ``progress``: a callable given a ``zeroflat.Progress`` every 10 s of a long resume, as
    ``zeroflat.load_param_groups`` takes it (each rank logs it at INFO anyway).
    ``save_checkpoint`` returns once the state is snapshotted (``wait()``; with
    ``save_in_background=False`` once published), its writer at ``save_priority`` ("idle",
    "low", "normal"), its staging at most ``save_staging_bytes`` (default: the free host memory
    less 256 MiB; what does not fit is written first): docs/python.md, on saving."""
    global _applied
    check_callback(progress)
    _save.configure(save_in_background, save_priority, save_staging_bytes)
    deepspeed, s12 = _deepspeed_modules()
    rules = _release_rules(deepspeed)
    stage3, why = _stage3.patches()
    stage3_refused = None
    if why is not None:
        stage3_refused = (f"DeepSpeed {rules.release}: Stage 3 (DeepSpeedZeroOptimizer_Stage3) "
                          f"is left to DeepSpeed: {why}")
    with _lock:
        _dropin.progress = progress
        if _applied is not None:
            return
        if not rules.tested and not allow_untested:
            log.warning("zeroflat: DeepSpeed %s is not one of the releases the drop-in was "
                        "tested with (%s); its groups are checked against its own bookkeeping "
                        "and handed back where they differ", rules.release,
                        ", ".join(SUPPORTED_VERSIONS))
        _dropin.rules = rules
        try:
            _applied = apply(_patches(s12) + stage3)
        except BaseException:
            _dropin.rules = None
            raise
        stats["release"] = rules.release
        stats["stage3_refused"] = stage3_refused
        if stage3_refused:
            log.warning("zeroflat: %s", stage3_refused)


def uninstall() -> None:
    """Waits for a save being written and a replaced tag's removal, then puts DeepSpeed back."""
    global _applied
    wait()  # this rank's save, and a replaced tag's removal
    with _lock:
        if _applied is None:
            return
        restore(_applied)
        _applied = None
        _dropin.rules = None
        _dropin.progress = None


def is_installed() -> bool:
    return _applied is not None


@contextlib.contextmanager
def installed(**options):
    """``with zeroflat.deepspeed.installed(): ...``; install()'s options (those before restored)."""
    was, before, saving = is_installed(), _dropin.progress, _save.options()
    install(**options)
    try:
        yield
    finally:
        if not was:
            uninstall()
        else:
            _dropin.progress = before
            _save.configure(*saving)
