"""What flattening and loading share: the FlatGroup they return, the layout, DeepSpeed's release
rules (asked of the library, never written down here), and the checks of arguments where they
enter."""

from __future__ import annotations

import importlib.metadata
import os
import numbers
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch

from . import _C
from ._errors import InvalidArgument

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
# A safetensors file's dtypes as torch names them (also what DCP's metadata carries).
FILE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
               "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
               "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
TIERS = ("auto", "device", "sharded", "staged", "host")
U64_MAX = 2**64 - 1
MAX_RANKS = 2**31 - 1

TESTED_DEEPSPEED_RELEASES = tuple(_C.tested_deepspeed_releases)


@dataclass
class FlatGroup:
    """One flattened (or loaded) parameter group on this rank."""

    flat: torch.Tensor
    """1-D, the group's dtype: every flattened parameter (as views) and zero padding."""
    partition: torch.Tensor
    """This rank's partition: ``flat[rank * n : (rank + 1) * n]``, a view."""
    master: Optional[torch.Tensor]
    """``partition`` up-cast to ``master_dtype`` (a copy), or None."""
    tier: str
    """How it was built: ``device``, ``sharded``, ``staged``, ``host``, or ``load``."""
    layout: dict
    """The layout, in the JSON shape of ``zeroflat layout --json``."""
    report: dict
    """The library's document of this rank's flatten or load (report.h: outcome, timings, peaks,
    the plan with every tier and its steps, the probes), with ``dp`` and ``deepspeed``."""
    params: List[torch.Tensor] = field(default_factory=list)
    """The parameters in the buffer, in group order (``layout["offsets"][i]`` is params[i]'s)."""
    rank: int = 0
    dp: int = 1


# --- arguments --------------------------------------------------------------------------------

def native_path(path: Any) -> bytes:
    """A path as the operating system's bytes, for the binding: a name with bytes that are not
    UTF-8 (a str from os.fsdecode, its surrogate escapes) cannot cross as text."""
    return os.fsencode(os.fspath(path))


def path_text(path: Any) -> str:
    """A path for messages: as os.fsdecode gives it (bytes and PathLike included)."""
    try:
        return os.fsdecode(path)
    except TypeError:
        return str(path)


def int_option(name: str, value: Any, lo: int, hi: int = U64_MAX) -> int:
    """An integer argument, checked where it enters (not as pybind's "incompatible function
    arguments")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} is {value!r}: expected an integer")
    v = int(value)
    if v < lo or v > hi:
        raise ValueError(f"{name} {v}: expected {lo} to {hi}")
    return v


def bool_option(name: str, value: Any) -> bool:
    """True or False only: a string such as "no" is not silently true."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    raise TypeError(f"{name} is {value!r}: expected True or False")


WRITE_PRIORITIES = ("idle", "low", "normal")


def priority_option(name: str, value: Any) -> str:
    """A background writer's priority (include/zeroflat/save.h, WritePriority): "idle" (runs
    when a core would otherwise idle), "low" (10 nicer) or "normal"."""
    if isinstance(value, str) and value in WRITE_PRIORITIES:
        return value
    raise ValueError(f"{name} is {value!r}: expected one of {', '.join(WRITE_PRIORITIES)}")


def dtype_name(dtype: torch.dtype, what: str) -> str:
    if dtype not in DTYPES:
        raise TypeError(f"{what} is {dtype}: zeroflat flattens bfloat16, float16 and float32")
    return DTYPES[dtype]


def check_options(tier: str, master_dtype: Any, threads: Any, margin_bytes: Any,
                  alignment_factor: Any, param_align_bytes: Any) -> None:
    if not isinstance(tier, str) or tier not in TIERS:
        raise ValueError(f"tier {tier!r}: expected one of {', '.join(TIERS)}")
    if master_dtype is not None:
        if not isinstance(master_dtype, torch.dtype):
            raise TypeError(f"master_dtype is {master_dtype!r}: expected a torch floating-point "
                            "dtype or None")
        if not master_dtype.is_floating_point:
            raise TypeError(f"master_dtype {master_dtype} is not a floating-point type")
    if threads is not None:
        int_option("threads", threads, 1, _C.max_threads)
    if margin_bytes is not None:
        int_option("margin_bytes", margin_bytes, 0)
    int_option("alignment_factor", alignment_factor, 1)
    int_option("param_align_bytes", param_align_bytes, 0)


def layout_options(dp: int, round_robin: bool, alignment_factor: int, dtype: torch.dtype,
                   param_align_bytes: int) -> "_C.LayoutOptions":
    return _C.LayoutOptions(dp=dp, round_robin=round_robin, alignment_factor=alignment_factor,
                            dtype=dtype_name(dtype, "dtype"),
                            param_align_bytes=param_align_bytes)


# --- DeepSpeed's release rules ------------------------------------------------------------------

def installed_deepspeed() -> Optional[str]:
    """The version of the DeepSpeed this environment imports, without importing it; or None."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def release_rules(deepspeed: Optional[str]) -> Optional["_C.ReleaseRules"]:
    """The rules of the release ``deepspeed`` names, or None for zeroflat's own layout.
    ``"installed"``: the installed DeepSpeed's, else (none installed) the newest tested
    release's, as the library's default_deepspeed_rules says."""
    if deepspeed is None:
        return None
    if not isinstance(deepspeed, str):
        raise TypeError(f"deepspeed is {deepspeed!r}: expected a release such as '0.19.8', "
                        "'latest', 'installed' or None")
    if deepspeed == "installed":
        return _C.default_deepspeed_rules(installed_deepspeed() or "")
    return _C.deepspeed_rules(deepspeed)


def check_release_options(options: "_C.LayoutOptions", rules: "_C.ReleaseRules") -> None:
    """The library's check that ``options`` are ones the release has, with the argument that
    lets a caller step outside them."""
    try:
        _C.check_release_options(options, rules)
    except InvalidArgument as e:
        raise InvalidArgument(f"{e} (the rules of DeepSpeed {rules.release}, the deepspeed= "
                              "argument; deepspeed=None for zeroflat's own layout)") from None


def select(tensors: Sequence[torch.Tensor], rules: Optional["_C.ReleaseRules"],
           trainable_only: bool) -> Tuple[List[int], List[Tuple[int, str]]]:
    """Which of ``tensors`` go into the group's buffer (indices, in order) and which stay out
    and why: those with ``requires_grad=False`` when ``trainable_only``, and what the release
    leaves out besides (the library's select_for_release); every other one for zeroflat's own
    layout (``rules`` None)."""
    frozen = [bool(trainable_only and not t.requires_grad) for t in tensors]
    if rules is None:
        return ([i for i, f in enumerate(frozen) if not f],
                [(i, "frozen") for i, f in enumerate(frozen) if f])
    kept, left_out = _C.select_for_release([t.numel() for t in tensors], frozen, rules)
    return list(kept), list(left_out)


# --- layouts ------------------------------------------------------------------------------------

def layout(numels: Sequence[int], dp: int = 1, *, round_robin: bool = False,
           alignment_factor: int = 2, dtype: torch.dtype = torch.bfloat16,
           param_align_bytes: int = 0, deepspeed: Optional[str] = None,
           frozen: Optional[Sequence[bool]] = None) -> dict:
    """The layout of a group with these element counts, without moving anything.

    ``deepspeed`` (a release such as ``"0.18.6"``, ``"latest"``, or ``"installed"``) lays the
    group out as that release does: the parameters it leaves out (``frozen[i]`` True; zero-element
    ones from 0.19.8) are listed in ``"left_out"`` and have no offset. ``None``: zeroflat's layout
    (docs/layout.md), which keeps every parameter given."""
    counts = [int_option(f"numels[{i}]", n, 0) for i, n in enumerate(numels)]
    options = layout_options(int_option("dp", dp, 1, MAX_RANKS),
                             bool_option("round_robin", round_robin),
                             int_option("alignment_factor", alignment_factor, 1), dtype,
                             int_option("param_align_bytes", param_align_bytes, 0))
    rules = release_rules(deepspeed)
    if rules is None:
        if frozen is not None:
            raise ValueError("frozen goes with deepspeed=: zeroflat's layout lays out every "
                             "parameter given")
        return _C.layout_json(counts, options)
    flags = [False] * len(counts) if frozen is None else [bool_option(f"frozen[{i}]", f)
                                                         for i, f in enumerate(frozen)]
    check_release_options(options, rules)
    return _C.release_layout_json(counts, flags, options, rules)


def partition_and_master(flat: torch.Tensor, lay: dict, rank: int,
                         master_bytes: Optional[torch.Tensor],
                         master_dtype: Optional[torch.dtype]) -> tuple:
    """This rank's partition of ``flat``, and its master copy: the engine's fp32 master
    (``master_bytes``) when it built one, else an up-cast to ``master_dtype``, else None."""
    part_n = lay["partition_numel"]
    partition = flat[rank * part_n: (rank + 1) * part_n]
    if master_bytes is not None:
        return partition, master_bytes[: part_n * 4].view(torch.float32)
    if master_dtype is not None:
        return partition, partition.detach().to(master_dtype, copy=True)
    return partition, None


def framework_memory(options: "_C.FlattenOptions", device: torch.device) -> None:
    """What torch's caching allocator holds on a CUDA ``device``, as the probe's source
    (``ProbeContext``): what it holds but does not use is free to this process. The engine's
    copies run on its own stream, so what torch queued on the device is finished first."""
    if device.type != "cuda":
        return
    torch.cuda.current_stream(device).synchronize()
    options.framework_held_bytes = torch.cuda.memory_reserved(device)
    options.framework_cached_free_bytes = (options.framework_held_bytes
                                           - torch.cuda.memory_allocated(device))


def engine_threads(threads: Optional[int], dp: int) -> int:
    """Host threads for this rank's engine: the caller's, else the cores of this host split
    among its ranks (the launcher's count, else the whole group)."""
    return int(threads or 0) or _C.default_threads(_C.local_ranks() or dp)
