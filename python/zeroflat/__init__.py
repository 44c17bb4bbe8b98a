"""zeroflat for PyTorch: flatten a parameter group into DeepSpeed's ZeRO-1/2 layout.

    fg = zeroflat.flatten_param_group(params, process_group)
    fg.flat, fg.partition, fg.master, fg.tier, fg.layout, fg.report

Every trainable parameter of the group becomes a view into one flat buffer (padded so that it
splits evenly over the ranks of ``process_group``), with its value unchanged; this rank's
partition and its fp32 master copy come with it. The planner picks the way of flattening that
fits (on the device, sharded across the ranks, staged through the host, or on the host) before
anything moves; a failure at any step leaves every parameter holding its original values.
See docs/python.md.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import _C

__version__ = _C.__version__

__all__ = [
    "ExecutionError",
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
           param_align_bytes: int = 0) -> dict:
    """The layout of a group with these element counts, without moving anything."""
    return json.loads(_C.layout_json([int(n) for n in numels], int(dp), bool(round_robin),
                                     int(alignment_factor), _dtype_name(dtype, "dtype"),
                                     int(param_align_bytes)))


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

    def _check(self) -> None:
        if self.aborted is not None:
            raise RuntimeError(self.aborted)

    def all_gather_inplace(self, ptr: int, slice_bytes: int) -> None:
        self._check()
        buf = self.device.tensor(ptr)[: slice_bytes * self.size]
        mine = buf[self.rank * slice_bytes: (self.rank + 1) * slice_bytes]
        try:
            dist.all_gather_into_tensor(buf, mine, group=self.group)
        except (RuntimeError, NotImplementedError, AttributeError):
            # Backends without the single-tensor form: the chunks are views into buf, so the
            # result lands in place all the same.
            dist.all_gather(list(buf.chunk(self.size)), mine.clone(), group=self.group)

    def all_reduce(self, values: List[int], op: str) -> List[int]:
        self._check()
        t = torch.tensor(values, dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX,
                        group=self.group)
        return [int(v) for v in t.tolist()]

    def barrier(self) -> None:
        self._check()
        dist.barrier(group=self.group)

    def abort(self, why: str) -> None:
        self.aborted = why


def _comm_device(group, device: torch.device) -> torch.device:
    backend = dist.get_backend(group)
    return device if str(backend) == "nccl" else torch.device("cpu")


def _check_same_everywhere(params: List[torch.Tensor], indices: List[int], comm: _TorchComm,
                           options: tuple) -> None:
    """Ranks must pass the same shapes and options, or the layouts (and buffers) differ."""
    signature = [(list(p.shape), str(p.dtype)) for p in params]
    digest = hashlib.sha256(repr((signature, options)).encode()).digest()
    mine = int.from_bytes(digest[:7], "little")
    lo, hi = comm.all_reduce([mine], "min")[0], comm.all_reduce([mine], "max")[0]
    if lo == hi:
        return
    everyone: List[Any] = [None] * comm.size
    dist.all_gather_object(everyone, (signature, options), group=comm.group)
    for r, (theirs, their_options) in enumerate(everyone):
        if their_options != options:
            raise ValueError(f"rank {r} passed options {their_options}, rank {comm.rank} "
                             f"{options}: every rank must flatten the group the same way")
        if len(theirs) != len(signature):
            raise ValueError(f"rank {r} passed {len(theirs)} trainable parameters, rank "
                             f"{comm.rank} {len(signature)}: every rank must pass the same group")
        for k, (a, b) in enumerate(zip(signature, theirs)):
            if a != b:
                raise ValueError(f"parameter {indices[k]} differs between ranks: shape {a[0]} "
                                 f"({a[1]}) on rank {comm.rank}, {b[0]} ({b[1]}) on rank {r}")
    raise ValueError("the ranks passed different groups")


def _free_memory(device: torch.device, local: int) -> tuple:
    """(capacity, free, host_free, integrated) for this rank, before agreement; `local` ranks
    share this host's memory."""
    host_total, host_free, _ = _C.host_memory()
    if device.type == "cpu":
        capacity = host_total // local
        return capacity, min(host_free // local, capacity), host_free // local, True
    free, total = torch.cuda.mem_get_info(device)
    # What torch's caching allocator holds but does not use is free for this process.
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    integrated = bool(getattr(torch.cuda.get_device_properties(device), "is_integrated", False))
    return total, min(free, total), host_free // local, integrated


def _trainable(params: Iterable[torch.Tensor], trainable_only: bool) -> tuple:
    all_params = list(params)
    for i, p in enumerate(all_params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {i} is a {type(p).__name__}, not a torch.Tensor")
    indices = [i for i, p in enumerate(all_params) if p.requires_grad or not trainable_only]
    return [all_params[i] for i in indices], indices


def flatten_param_group(params: Iterable[torch.Tensor], process_group=None, *,
                        round_robin: bool = False, alignment_factor: int = 2,
                        param_align_bytes: int = 0, tier: str = "auto",
                        margin_bytes: Optional[int] = None,
                        master_dtype: Optional[torch.dtype] = torch.float32,
                        verify: bool = False, threads: Optional[int] = None,
                        trainable_only: bool = True, _fault_step: Optional[int] = None,
                        _fault_rank: int = 0) -> FlatGroup:
    """Flattens the trainable parameters of one group into DeepSpeed's ZeRO-1/2 layout.

    Parameters with ``requires_grad=False`` are left alone, as DeepSpeed leaves them (unless
    ``trainable_only`` is False: then every tensor given is flattened). Every
    rank of ``process_group`` must call with the same shapes (checked). After the call each
    flattened parameter's ``.data`` is a view into ``FlatGroup.flat`` at its layout offset,
    with its value unchanged, and its original storage is released.

    Raises TypeError / ValueError for a group that cannot be flattened (naming the parameter's
    index and shape) and NoFeasiblePlan when nothing fits, before any parameter is touched;
    ExecutionError when a step fails (the parameters keep their values; see its ``outcome``).
    """
    group_params, indices = _trainable(params, trainable_only)
    _validate(group_params, indices)
    if tier not in _TIERS:
        raise ValueError(f"tier {tier!r}: expected one of {', '.join(_TIERS)}")
    if master_dtype is not None and not master_dtype.is_floating_point:
        raise TypeError(f"master_dtype {master_dtype} is not a floating-point type")
    dtype = group_params[0].dtype
    device = group_params[0].device
    dtype_name = _DTYPES[dtype]
    numels = [p.numel() for p in group_params]
    shapes = [p.shape for p in group_params]
    dp = dist.get_world_size(process_group) if process_group is not None else 1
    # Ranks sharing this host (its cores and memory): the launcher's count, else the whole group.
    local = _C.local_ranks() or dp
    engine = _C.TorchDevice(str(device), int(threads or 0) or _C.default_threads(local))
    comm, rank = None, 0
    if process_group is not None:
        comm = _TorchComm(process_group, engine, _comm_device(process_group, device))
        rank = comm.rank
    options = (bool(round_robin), int(alignment_factor), int(param_align_bytes), tier)
    if comm is not None and dp > 1:
        _check_same_everywhere(group_params, indices, comm, options)
    # Layout errors (a bad alignment, say) surface here, before anything moves.
    lay = layout(numels, dp, round_robin=round_robin, alignment_factor=alignment_factor,
                 dtype=dtype, param_align_bytes=param_align_bytes)

    if device.type == "cuda":
        # The engine's copies run on its own stream: what torch queued on the parameters must
        # be done first.
        torch.cuda.current_stream(device).synchronize()
    capacity, free, host_free, integrated = _free_memory(device, local)
    if comm is not None and dp > 1:
        free, host_free, capacity = comm.all_reduce([free, host_free, capacity], "min")
        free = min(free, capacity)

    before = []
    if verify:
        before = [engine.checksum(p.data_ptr(), p.numel() * p.element_size()) for p in group_params]

    def release_originals() -> None:
        for p in group_params:
            p.data = torch.empty(0, dtype=dtype, device=device)

    doc_text, flat_bytes = _C.flatten(
        engine, comm if (comm is not None and dp > 1) else None, rank,
        [p.data_ptr() for p in group_params], numels, dp, bool(round_robin),
        int(alignment_factor), dtype_name, int(param_align_bytes), int(capacity), int(free),
        None if margin_bytes is None else int(margin_bytes), int(host_free),
        local, bool(integrated), tier,
        _fault_step if rank == _fault_rank else None, release_originals)
    report = json.loads(doc_text)
    report["dp"] = dp
    report["rank"] = rank
    if report["outcome"] == "infeasible":
        raise NoFeasiblePlan(f"no way of flattening fits: {report['reason']}; nothing was "
                             "touched", report)

    fg = None
    if flat_bytes is not None:
        flat = flat_bytes[: lay["flat_bytes"]].view(dtype)
        for p, off, n, shape in zip(group_params, lay["offsets"], numels, shapes):
            p.data = flat[off: off + n].view(shape)
        part_n = lay["partition_numel"]
        partition = flat[rank * part_n: (rank + 1) * part_n]
        master = None
        if master_dtype is not None:
            master = partition.detach().to(master_dtype, copy=True)
        fg = FlatGroup(flat=flat, partition=partition, master=master, tier=report["tier"],
                       layout=lay, report=report, params=group_params, rank=rank, dp=dp)
    if report["outcome"] != "done":
        raise ExecutionError(f"flattening failed: {report['error']}", report["outcome"], report,
                             fg)
    assert fg is not None
    if verify:
        _verify(fg, engine, before)
    return fg


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
