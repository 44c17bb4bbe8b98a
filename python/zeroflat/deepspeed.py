"""DeepSpeed drop-in: ZeRO stage 1 and 2 build their flat parameter buffers through zeroflat.

    import zeroflat.deepspeed
    zeroflat.deepspeed.install()          # before deepspeed.initialize
    engine, optimizer, _, _ = deepspeed.initialize(...)

``DeepSpeedZeroOptimizer`` then obtains each parameter group's flat buffer from
``zeroflat.flatten_param_group`` (zeroflat's probe, planner, tiers and rollback, the ranks of
the group's own data-parallel group) instead of flattening it itself; everything else is
DeepSpeed's own code, and the buffers, partitions, padding and fp32 master partitions are the
ones it would have built. See docs/deepspeed.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Optional

import torch

import zeroflat

__all__ = ["SUPPORTED_VERSIONS", "install", "installed", "is_installed", "uninstall", "stats"]

log = logging.getLogger("zeroflat.deepspeed")

# DeepSpeed versions whose ZeRO-1/2 initialization this drop-in was tested against (the test
# suite compares every buffer with DeepSpeed's own, bit for bit).
SUPPORTED_VERSIONS = ("0.19.8",)

_lock = threading.Lock()
_saved: Optional[dict] = None
_state = threading.local()
stats = {"groups": 0, "fallbacks": 0, "tiers": []}


def _deepspeed_modules():
    try:
        import deepspeed
        from deepspeed.runtime.zero import stage_1_and_2
    except ImportError as e:
        raise RuntimeError(f"zeroflat.deepspeed: DeepSpeed is not importable: {e}") from e
    return deepspeed, stage_1_and_2


def _check_version(deepspeed, allow_untested: bool) -> None:
    version = getattr(deepspeed, "__version__", "unknown")
    base = version.split("+")[0]
    if base not in SUPPORTED_VERSIONS and not allow_untested:
        raise RuntimeError(
            f"zeroflat.deepspeed: DeepSpeed {version} is not a version this drop-in was tested "
            f"with ({', '.join(SUPPORTED_VERSIONS)}); nothing was changed. Install a tested "
            "version, or call install(allow_untested=True) to try it anyway (the equality tests "
            "in python/tests/test_deepspeed.py say whether it holds).")


def _flatten_hook(original):
    def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False,
                                      param_padding=None):
        i = len(getattr(self, "bit16_groups_flat", ()))
        groups = getattr(self, "round_robin_bit16_groups", ())
        # Only the call that builds group i's bit16 buffer during __init__ is ours.
        if (not getattr(_state, "in_init", False) or use_cpu_data or i >= len(groups)
                or tensor_list is not groups[i]):
            return original(self, tensor_list, alignment, use_cpu_data, param_padding)
        return _flatten_group(self, i, tensor_list, alignment, param_padding, original)

    flatten_dense_tensors_aligned.__wrapped__ = original
    flatten_dense_tensors_aligned.__zeroflat__ = True
    return flatten_dense_tensors_aligned


def _flatten_group(opt, i, tensors, alignment, param_padding, original):
    import torch.distributed as dist

    group = opt.real_dp_process_group[i]
    world = dist.get_world_size(group=group)
    tensors = list(tensors)
    padding = list(param_padding) if param_padding is not None else [0] * len(tensors)
    # zeroflat's layout must be DeepSpeed's to the element; if it is not, DeepSpeed flattens.
    align_bytes = 16 if getattr(opt, "parameter_alignment", False) else 0
    reason = None
    if alignment % world != 0:
        reason = f"alignment {alignment} is not a multiple of the group size {world}"
    else:
        try:
            lay = zeroflat.layout([t.numel() for t in tensors], world,
                                  alignment_factor=alignment // world, dtype=tensors[0].dtype,
                                  param_align_bytes=align_bytes)
            ds_offsets = list(opt.round_robin_bit16_offsets[i])
            ds_numel = sum(t.numel() for t in tensors) + sum(padding)
            ds_numel += (-ds_numel) % alignment
            if lay["offsets"] != ds_offsets or lay["flat_numel"] != ds_numel:
                reason = "zeroflat's layout differs from DeepSpeed's for this group"
        except (TypeError, ValueError) as e:
            reason = str(e)
    if reason is None:
        try:
            fg = zeroflat.flatten_param_group(tensors, group, alignment_factor=alignment // world,
                                              param_align_bytes=align_bytes, master_dtype=None,
                                              trainable_only=False)
        except (TypeError, ValueError) as e:  # refused before anything moved
            reason = str(e)
        else:
            stats["groups"] += 1
            stats["tiers"].append(fg.tier)
            log.info("zeroflat: param group %d flattened with the %s tier (%s)", i, fg.tier,
                     fg.report.get("reason", ""))
            return fg.flat
    stats["fallbacks"] += 1
    log.warning("zeroflat: param group %d flattened by DeepSpeed itself: %s", i, reason)
    return original(opt, tensors, alignment, False, param_padding)


def _init_hook(original):
    def __init__(self, *args, **kwargs):
        # DeepSpeed moves a group to the host when its own memory test fails; zeroflat plans
        # that decision (and the other tiers) itself, so the test must pass while it runs.
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
        had_own = "available_memory" in vars(accel)
        own = vars(accel).get("available_memory")
        accel.available_memory = lambda *a, **k: 1 << 62
        _state.in_init = True
        try:
            original(self, *args, **kwargs)
        finally:
            _state.in_init = False
            if had_own:
                accel.available_memory = own
            else:
                del accel.available_memory

    __init__.__wrapped__ = original
    __init__.__zeroflat__ = True
    return __init__


def install(*, allow_untested: bool = False) -> None:
    """Makes DeepSpeed's ZeRO-1/2 optimizer build its flat buffers through zeroflat.

    Checks the DeepSpeed version first and refuses an untested one (RuntimeError, nothing
    changed). Installing twice is harmless. Either every patch is in place or none is."""
    global _saved
    deepspeed, s12 = _deepspeed_modules()
    _check_version(deepspeed, allow_untested)
    cls = getattr(s12, "DeepSpeedZeroOptimizer", None)
    for name in ("__init__", "flatten_dense_tensors_aligned"):
        if cls is None or not callable(getattr(cls, name, None)):
            raise RuntimeError(f"zeroflat.deepspeed: DeepSpeed {deepspeed.__version__} has no "
                               f"DeepSpeedZeroOptimizer.{name}; nothing was changed")
    with _lock:
        if _saved is not None:
            return
        saved = {"__init__": cls.__dict__["__init__"],
                 "flatten_dense_tensors_aligned": cls.__dict__["flatten_dense_tensors_aligned"]}
        try:
            cls.flatten_dense_tensors_aligned = _flatten_hook(saved["flatten_dense_tensors_aligned"])
            cls.__init__ = _init_hook(saved["__init__"])
        except BaseException:
            for name, fn in saved.items():
                setattr(cls, name, fn)
            raise
        _saved = {"cls": cls, **saved}


def uninstall() -> None:
    """Puts DeepSpeed back as it was. Harmless when not installed."""
    global _saved
    with _lock:
        if _saved is None:
            return
        cls = _saved["cls"]
        cls.__init__ = _saved["__init__"]
        cls.flatten_dense_tensors_aligned = _saved["flatten_dense_tensors_aligned"]
        _saved = None


def is_installed() -> bool:
    return _saved is not None


@contextlib.contextmanager
def installed(*, allow_untested: bool = False):
    """``with zeroflat.deepspeed.installed(): deepspeed.initialize(...)``"""
    was = is_installed()
    install(allow_untested=allow_untested)
    try:
        yield
    finally:
        if not was:
            uninstall()
