"""zeroflat for PyTorch: flatten a parameter group into DeepSpeed's ZeRO-1/2 layout, or load
it straight from a checkpoint into that layout.

    fg = zeroflat.flatten_param_group(params, process_group)
    fg.flat, fg.partition, fg.master, fg.tier, fg.layout, fg.report

    with zeroflat.meta_parameters():
        model = build_model()                       # no memory, no initialization
    groups = zeroflat.load_param_groups(model, "checkpoint/", process_group)

Every trainable parameter of the group becomes a view into one flat buffer (padded so that it
splits evenly over the ranks of ``process_group``), with its value unchanged; this rank's
partition and its fp32 master copy come with it. The planner picks the way of flattening that
fits (on the device, sharded across the ranks, staged through the host, or on the host) before
anything moves; a failure at any step leaves every parameter holding its original values.
See docs/python.md.
"""

from __future__ import annotations

import importlib.metadata
import json
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import _C, _shm

__version__ = _C.__version__

ResourceExhausted = _C.ResourceExhausted
"""The system refused a host thread (a process or memory limit): ask for fewer ``threads``."""

__all__ = [
    "ExecutionError",
    "load_param_groups",
    "meta_parameters",
    "ResourceExhausted",
    "FlatGroup",
    "NoFeasiblePlan",
    "flatten_param_group",
    "flatten_param_groups",
    "layout",
]

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_TIERS = ("auto", "device", "sharded", "staged", "host")


class NoFeasiblePlan(MemoryError):
    """No way of flattening fits in the memory the ranks have; nothing was touched."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


class ExecutionError(RuntimeError):
    """A step failed while flattening.

    ``outcome`` says what the parameters hold now: ``"rolled back"`` (their original storage,
    untouched), ``"recovered"`` (their original values, as views into a completed flat buffer,
    which ``flat_group`` then holds) or ``"lost"`` (recovery failed too; the message says what
    this rank still had).
    """

    def __init__(self, message: str, outcome: str, report: dict,
                 flat_group: Optional["FlatGroup"] = None):
        super().__init__(message)
        self.outcome = outcome
        self.report = report
        self.flat_group = flat_group


@dataclass
class FlatGroup:
    """One flattened parameter group on this rank."""

    flat: torch.Tensor
    """1-D, the group's dtype: every flattened parameter (as views) and zero padding."""
    partition: torch.Tensor
    """This rank's partition: ``flat[rank * n : (rank + 1) * n]``, a view."""
    master: Optional[torch.Tensor]
    """``partition`` up-cast to ``master_dtype`` (a copy), or None."""
    tier: str
    """How it was flattened: ``device``, ``sharded``, ``staged`` or ``host``."""
    layout: dict
    """The layout, in the JSON shape of ``zeroflat layout --json``."""
    report: dict
    """The plan (every tier with its peak memory, traffic and why not), timings, peaks."""
    params: List[torch.Tensor] = field(default_factory=list)
    """The parameters in the buffer, in group order (``layout["offsets"][i]`` is params[i]'s)."""
    rank: int = 0
    dp: int = 1


def layout(numels: Sequence[int], dp: int = 1, *, round_robin: bool = False,
           alignment_factor: int = 2, dtype: torch.dtype = torch.bfloat16,
           param_align_bytes: int = 0, deepspeed: Optional[str] = None,
           frozen: Optional[Sequence[bool]] = None) -> dict:
    """The layout of a group with these element counts, without moving anything.

    ``deepspeed`` (a release such as ``"0.18.6"``, ``"latest"``, or ``"installed"``) lays the
    group out as that release does: the parameters it leaves out (``frozen[i]`` True; zero-element
    ones from 0.19.8) are listed in ``"left_out"`` and have no offset. ``None``: zeroflat's layout
    (docs/layout.md), which keeps every parameter given."""
    counts = [_int_option(f"numels[{i}]", n, 0) for i, n in enumerate(numels)]
    args = (_int_option("dp", dp, 1, _MAX_RANKS), _bool_option("round_robin", round_robin),
            _int_option("alignment_factor", alignment_factor, 1), _dtype_name(dtype, "dtype"),
            _int_option("param_align_bytes", param_align_bytes, 0))
    release = _release(deepspeed)
    if release is None:
        if frozen is not None:
            raise ValueError("frozen goes with deepspeed=: zeroflat's layout lays out every "
                             "parameter given")
        return json.loads(_C.layout_json(counts, *args))
    flags = [False] * len(counts) if frozen is None else [_bool_option(f"frozen[{i}]", f)
                                                         for i, f in enumerate(frozen)]
    return json.loads(_C.release_layout_json(counts, flags, *args, release))


TESTED_DEEPSPEED_RELEASES = tuple(_C.tested_deepspeed_releases)


def installed_deepspeed() -> Optional[str]:
    """The version of the DeepSpeed this environment imports, without importing it; or None."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(deepspeed: Optional[str]) -> Optional[str]:
    """A release whose rules apply, or None for zeroflat's layout."""
    if deepspeed is None:
        return None
    if not isinstance(deepspeed, str):
        raise TypeError(f"deepspeed is {deepspeed!r}: expected a release such as '0.19.8', "
                        "'latest', 'installed' or None")
    if deepspeed == "installed":
        return installed_deepspeed()
    _C.deepspeed_rules(deepspeed)  # ValueError for text that is not a release
    return deepspeed


_U64_MAX = 2**64 - 1
_MAX_RANKS = 2**31 - 1


def _int_option(name: str, value: Any, lo: int, hi: int = _U64_MAX) -> int:
    """An integer argument, checked where it enters (not as pybind's "incompatible function
    arguments")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} is {value!r}: expected an integer")
    v = int(value)
    if v < lo or v > hi:
        raise ValueError(f"{name} {v}: expected {lo} to {hi}")
    return v


def _bool_option(name: str, value: Any) -> bool:
    """True or False only: a string such as "no" is not silently true."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    raise TypeError(f"{name} is {value!r}: expected True or False")


def _dtype_name(dtype: torch.dtype, what: str) -> str:
    if dtype not in _DTYPES:
        raise TypeError(f"{what} is {dtype}: zeroflat flattens bfloat16, float16 and float32")
    return _DTYPES[dtype]


def _describe(i: int, p: torch.Tensor) -> str:
    return f"parameter {i} (shape {list(p.shape)}, {p.dtype}, {p.device})"


def _validate(params: List[torch.Tensor], indices: List[int]) -> None:
    """Every check that can fail, before any parameter is touched."""
    if not params:
        raise ValueError("the group has no trainable parameters to flatten")
    first = params[0]
    for i, p in zip(indices, params):
        if p.is_sparse or p.layout != torch.strided:
            raise TypeError(f"{_describe(i, p)} is not a dense strided tensor")
        if p.device.type == "meta":
            raise ValueError(f"{_describe(i, p)} has no data (meta device)")
        _dtype_name(p.dtype, _describe(i, p))
        if p.dtype != first.dtype:
            raise ValueError(f"mixed dtypes in one group: {_describe(indices[0], first)} but "
                             f"{_describe(i, p)}; put them in separate groups")
        if p.device != first.device:
            raise ValueError(f"mixed devices in one group: {_describe(indices[0], first)} but "
                             f"{_describe(i, p)}")
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{_describe(i, p)}: zeroflat runs on cpu and cuda devices")
        if not p.is_contiguous():
            raise ValueError(f"{_describe(i, p)} is not contiguous (stride {list(p.stride())})")
    # Two parameters over the same bytes (tied weights) would be untied by flattening both.
    spans = []
    for i, p in zip(indices, params):
        if p.numel() == 0:
            continue
        start = p.data_ptr()
        spans.append((start, start + p.numel() * p.element_size(), i, p))
    spans.sort(key=lambda s: s[0])
    for (a0, a1, ia, pa), (b0, b1, ib, pb) in zip(spans, spans[1:]):
        if b0 < a1:
            lo, hi = sorted((ia, ib))
            plo, phi = (pa, pb) if ia == lo else (pb, pa)
            raise ValueError(f"{_describe(lo, plo)} and {_describe(hi, phi)} share storage "
                             "(tied weights?): flattening both would untie them; keep one of "
                             "them in the group")


class _TorchComm:
    """The collectives the engine needs, over a torch.distributed group (called from C++)."""

    def __init__(self, group, device: "_C.TorchDevice", comm_device: torch.device):
        self.group = group
        self.device = device
        self.comm_device = comm_device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.aborted: Optional[str] = None
        self._window: Any = None  # the shared-memory window of ranks on one host, once tried

    def _check(self) -> None:
        if self.aborted is not None:
            raise RuntimeError(self.aborted)

    def all_gather_inplace(self, ptr: int, slice_bytes: int) -> None:
        self._check()
        # Every rank's byte count before anything is copied: a shorter peer would be overrun.
        most, least = self.all_reduce([slice_bytes, _U64_MAX - slice_bytes], "max")
        if most != _U64_MAX - least:
            raise ValueError(f"the ranks passed all-gather slices of {_U64_MAX - least} to "
                             f"{most} bytes; nothing was copied")
        buf = self.device.tensor(ptr)[: slice_bytes * self.size]
        if buf.device.type == "cpu" and self.comm_device.type == "cpu" and _shm.enabled():
            # Ranks on one host meet in shared memory rather than in gloo's sockets.
            # Opened at the first gather, again for a larger one (every rank sees the same
            # slice_bytes, checked above); never again once some rank could not map it.
            if self._window is None or (self._window and self._window.slot_bytes
                                        < _shm.slot_bytes(self.size, slice_bytes)):
                self._window = None  # the smaller window unmapped before the next is made
                self._window = _shm.SharedWindow.open(self.group, self.rank, self.size,
                                                      slice_bytes) or False
            if self._window:
                self._window.all_gather(buf, slice_bytes)
                return
        mine = buf[self.rank * slice_bytes: (self.rank + 1) * slice_bytes]
        try:
            dist.all_gather_into_tensor(buf, mine, group=self.group)
        except (RuntimeError, NotImplementedError, AttributeError):
            # Backends without the single-tensor form: the chunks are views into buf, so the
            # result lands in place all the same.
            dist.all_gather(list(buf.chunk(self.size)), mine.clone(), group=self.group)

    def all_reduce(self, values: List[int], op: str) -> List[int]:
        self._check()
        # Unsigned 64-bit values through int64 tensors: shifting by 2**63 keeps their order.
        t = torch.tensor([v - 2**63 for v in values], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX,
                        group=self.group)
        return [int(v) + 2**63 for v in t.tolist()]

    def barrier(self) -> None:
        self._check()
        dist.barrier(group=self.group)

    def abort(self, why: str) -> None:
        self.aborted = why


def _comm_device(group, device: torch.device) -> torch.device:
    backend = dist.get_backend(group)
    return device if str(backend) == "nccl" else torch.device("cpu")


def _trainable(params: Iterable[torch.Tensor], trainable_only: bool) -> tuple:
    all_params = list(params)
    for i, p in enumerate(all_params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {i} is a {type(p).__name__}, not a torch.Tensor")
    indices = [i for i, p in enumerate(all_params) if p.requires_grad or not trainable_only]
    return [all_params[i] for i in indices], indices


def _check_options(tier: str, master_dtype: Any, threads: Any, margin_bytes: Any,
                   alignment_factor: Any, param_align_bytes: Any) -> None:
    if not isinstance(tier, str) or tier not in _TIERS:
        raise ValueError(f"tier {tier!r}: expected one of {', '.join(_TIERS)}")
    if master_dtype is not None:
        if not isinstance(master_dtype, torch.dtype):
            raise TypeError(f"master_dtype is {master_dtype!r}: expected a torch floating-point "
                            "dtype or None")
        if not master_dtype.is_floating_point:
            raise TypeError(f"master_dtype {master_dtype} is not a floating-point type")
    if threads is not None:
        _int_option("threads", threads, 1, _C.max_threads)
    if margin_bytes is not None:
        _int_option("margin_bytes", margin_bytes, 0)
    _int_option("alignment_factor", alignment_factor, 1)
    _int_option("param_align_bytes", param_align_bytes, 0)


def _check_release_options(rules: dict, alignment_factor: int, param_align_bytes: int) -> None:
    where = (f"DeepSpeed {rules['release']} (the deepspeed= rules; deepspeed=None for zeroflat's "
             "own layout)")
    if alignment_factor != 2:
        raise ValueError(f"alignment_factor {alignment_factor}: {where} pads every group to "
                         "2 x dp elements")
    if param_align_bytes not in (0, 16) or (param_align_bytes and
                                            not rules["has_parameter_alignment"]):
        raise ValueError(f"param_align_bytes {param_align_bytes}: {where} has "
                         + ("16-byte parameter_alignment only" if rules["has_parameter_alignment"]
                            else "no parameter_alignment (it came in 0.19.7)"))


def flatten_param_group(params: Iterable[torch.Tensor], process_group=None, *,
                        round_robin: bool = False, alignment_factor: int = 2,
                        param_align_bytes: int = 0, tier: str = "auto",
                        margin_bytes: Optional[int] = None,
                        master_dtype: Optional[torch.dtype] = torch.float32,
                        verify: bool = False, threads: Optional[int] = None,
                        trainable_only: bool = True, check_values: bool = True,
                        deepspeed: Optional[str] = "installed",
                        _fault_step: Optional[int] = None, _fault_rank: int = 0,
                        _rebinds: bool = False) -> FlatGroup:
    """Flattens the trainable parameters of one group into DeepSpeed's ZeRO-1/2 layout.

    Parameters with ``requires_grad=False`` are left alone, as DeepSpeed leaves them (unless
    ``trainable_only`` is False: then every tensor given is flattened). Every rank of
    ``process_group`` must call it, with the same shapes and options: the ranks compare them
    before anything moves. After the call each flattened parameter's ``.data`` is a view into
    ``FlatGroup.flat`` at its layout offset, with its value unchanged, and its original storage
    is released.

    The work is the library's front door: the device's free-memory probe (``report["probe"]``,
    the same document as ``zeroflat probe --json``), one collective in which the ranks agree,
    the planner, the chosen tier's steps and the fp32 master partition.

    Raises TypeError / ValueError for a group or options that cannot be flattened (naming the
    parameter's index and shape), on every rank at once when any rank's group is bad or the
    ranks differ, and NoFeasiblePlan when nothing fits, before any parameter is touched;
    ExecutionError when a step fails (the parameters keep their values; see its ``outcome``).
    ``check_values`` (the sharded and staged tiers only) first checks that the ranks hold the
    same values, since each rank would otherwise end up with the owners' values of every slice.

    ``deepspeed`` names the release whose layout rules apply (``"installed"``: the DeepSpeed this
    environment has, if any; a version such as ``"0.18.6"``; ``"latest"``), as ``layout`` does:
    from 0.19.8 zero-element parameters stay out of the group (left alone), and the layout
    options must be ones that release has (alignment factor 2; parameter alignment 0, or 16 from
    0.19.7). ``None``: zeroflat's layout, which takes every parameter and any alignment.
    """
    group_params, indices = _trainable(params, _bool_option("trainable_only", trainable_only))
    dp = 1
    if process_group is not None:
        dp = dist.get_world_size(process_group)
    local_error: Optional[Exception] = None
    lay = None
    rules, release = None, None
    try:
        round_robin = _bool_option("round_robin", round_robin)
        verify = _bool_option("verify", verify)
        check_values = _bool_option("check_values", check_values)
        _check_options(tier, master_dtype, threads, margin_bytes, alignment_factor,
                       param_align_bytes)
        release = _release(deepspeed)
        if release is not None:
            rules = _C.deepspeed_rules(release)
            _check_release_options(rules, alignment_factor, param_align_bytes)
            if rules["skips_zero_element"]:
                kept = [k for k, p in enumerate(group_params) if p.numel() > 0]
                group_params = [group_params[k] for k in kept]
                indices = [indices[k] for k in kept]
        _validate(group_params, indices)
        lay = layout([p.numel() for p in group_params], dp, round_robin=round_robin,
                     alignment_factor=alignment_factor, dtype=group_params[0].dtype,
                     param_align_bytes=param_align_bytes)
    except (TypeError, ValueError) as e:
        local_error = e
    if local_error is not None and dp == 1:
        raise local_error

    if local_error is None:
        dtype = group_params[0].dtype
        device = group_params[0].device
        # Ranks sharing this host split its cores: the launcher's count, else the whole group.
        local = _C.local_ranks() or dp
        engine = _C.TorchDevice(str(device), int(threads or 0) or _C.default_threads(local))
    else:
        # This rank only has to tell the others, in the same collective, that it refuses.
        dtype, device = torch.bfloat16, torch.device("cpu")
        engine = _C.TorchDevice("cpu", 1)
    comm, rank = None, 0
    if process_group is not None:
        comm = _TorchComm(process_group, engine, _comm_device(process_group, device))
        rank = comm.rank

    cached_free = held = 0
    if local_error is None and device.type == "cuda":
        # The engine's copies run on its own stream: what torch queued on the parameters must
        # be done first. What torch's allocator caches but does not use is free to this process.
        torch.cuda.current_stream(device).synchronize()
        held = torch.cuda.memory_reserved(device)
        cached_free = held - torch.cuda.memory_allocated(device)

    shapes = [p.shape for p in group_params]
    before = []
    if verify and local_error is None:
        before = [engine.checksum(p.data_ptr(), p.numel() * p.element_size()) for p in group_params]

    def release_originals() -> None:
        for p in group_params:
            p.data = torch.empty(0, dtype=dtype, device=device)

    ok = local_error is None
    build_master = ok and master_dtype == torch.float32
    try:
        doc_text, flat_bytes, master_bytes = _C.flatten(
            engine, comm if (comm is not None and dp > 1) else None,
            [p.data_ptr() for p in group_params] if ok else [],
            [list(p.shape) for p in group_params] if ok else [], dp, bool(round_robin),
            int(alignment_factor) if ok else 2, _DTYPES[dtype],
            int(param_align_bytes) if ok else 0, tier if ok else "auto",
            None if (margin_bytes is None or not ok) else int(margin_bytes), build_master,
            bool(check_values), int(cached_free), int(held),
            [f"parameter {i}" for i in indices] if ok else [],
            f"master_dtype {master_dtype}, verify {verify}, trainable_only {trainable_only}, "
            f"deepspeed rules {rules['rules'] if rules else None}",
            "" if ok else f"{type(local_error).__name__}: {local_error}",
            _fault_step if rank == _fault_rank else None, bool(_rebinds), release_originals)
    except ValueError:
        if local_error is not None:
            raise local_error from None  # this rank's own error, as it was found
        raise
    report = json.loads(doc_text)
    report["dp"] = dp
    report["rank"] = rank
    report["deepspeed"] = rules
    if report["outcome"] == "infeasible":
        raise NoFeasiblePlan(f"no way of flattening fits: {report['reason']}; nothing was "
                             "touched", report)

    fg = None
    if flat_bytes is not None:
        flat = flat_bytes[: lay["flat_bytes"]].view(dtype)
        if not report.get("release_deferred"):
            for p, off, shape in zip(group_params, lay["offsets"], shapes):
                p.data = flat[off: off + shape.numel()].view(shape)
        # else (_rebinds: the caller, DeepSpeed, points every parameter into flat itself right
        # after, which frees the originals there, as its own flatten leaves them)
        partition, master = _partition_and_master(flat, lay, rank, master_bytes, master_dtype)
        fg = FlatGroup(flat=flat, partition=partition, master=master, tier=report["tier"],
                       layout=lay, report=report, params=group_params, rank=rank, dp=dp)
    if report["outcome"] != "done":
        raise ExecutionError(f"flattening failed: {report['error']}", report["outcome"], report,
                             fg)
    assert fg is not None
    if verify:
        _verify(fg, engine, before)
    return fg


def _partition_and_master(flat: torch.Tensor, lay: dict, rank: int,
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


def _verify(fg: FlatGroup, engine: "_C.TorchDevice", before: List[int]) -> None:
    """Every parameter's bytes against the checksum taken before, every padding element zero."""
    flat = fg.flat
    for k, (p, want) in enumerate(zip(fg.params, before)):
        got = engine.checksum(p.data_ptr(), p.numel() * p.element_size())
        if got != want:
            raise ExecutionError(f"verification failed: parameter {k} changed while flattening",
                                 "done", fg.report, fg)
    cursor = 0
    spans = sorted(zip(fg.layout["offsets"], (p.numel() for p in fg.params)))
    for off, n in spans + [(flat.numel(), 0)]:
        if off > cursor and bool(flat[cursor:off].ne(0).any()):
            raise ExecutionError(f"verification failed: padding [{cursor}, {off}) is not zero",
                                 "done", fg.report, fg)
        cursor = max(cursor, off + n)
    fg.report["verified"] = True


def flatten_param_groups(param_groups: Iterable[Any], process_group=None,
                         **kwargs) -> List[FlatGroup]:
    """Flattens several groups one after another (``optimizer.param_groups``, or lists of
    tensors); the originals released by one make room for the next."""
    out = []
    for g in param_groups:
        params = g["params"] if isinstance(g, dict) else g
        out.append(flatten_param_group(params, process_group, **kwargs))
    return out


from ._load import load_param_groups, meta_parameters  # noqa: E402  (needs the names above)
