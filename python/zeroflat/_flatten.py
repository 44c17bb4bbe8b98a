"""zeroflat.flatten_param_group: a group of parameters already in memory, flattened into
DeepSpeed's ZeRO-1/2 layout through the library's front door (engine.h)."""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

import torch
import torch.distributed as dist

from . import _C
from ._comm import TorchComm, comm_device
from ._common import (FlatGroup, bool_option, check_options, check_release_options,
                      dtype_name, engine_threads, framework_memory, int_option, layout_options,
                      partition_and_master, release_rules, select)
from ._errors import CommError, ExecutionError, InvalidArgument, NoFeasiblePlan


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
        dtype_name(p.dtype, _describe(i, p))
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


def _tensors(params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    out = list(params)
    for i, p in enumerate(out):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {i} is a {type(p).__name__}, not a torch.Tensor")
    return out


def flatten_param_group(params: Iterable[torch.Tensor], process_group=None, *,
                        round_robin: bool = False, alignment_factor: int = 2,
                        param_align_bytes: int = 0, tier: str = "auto",
                        margin_bytes: Optional[int] = None,
                        master_dtype: Optional[torch.dtype] = torch.float32,
                        verify: bool = False, threads: Optional[int] = None,
                        trainable_only: bool = True, check_values: bool = True,
                        deepspeed: Optional[str] = "installed",
                        expected_offsets: Optional[List[int]] = None,
                        expected_flat_numel: Optional[int] = None,
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
    environment has, or, where there is none, the newest tested release's; a version such as
    ``"0.18.6"``; ``"latest"``), as ``layout`` does: from 0.19.8 zero-element parameters stay
    out of the group (left alone), and the layout options must be ones that release has
    (alignment factor 2; parameter alignment 0, or 16 from 0.19.7). ``None``: zeroflat's layout,
    which takes every parameter and any alignment.

    ``expected_offsets`` and ``expected_flat_numel``: the caller's own account of the layout (a
    framework that laid the group out itself): each flattened parameter's first element in the
    buffer and the buffer's length. A layout that differs is ValueError (naming the first
    parameter that differs) on every rank, before anything moves.
    """
    dp = dist.get_world_size(process_group) if process_group is not None else 1
    local_error: Optional[Exception] = None
    rules = None
    group_params: List[torch.Tensor] = []
    indices: List[int] = []
    options = _C.FlattenOptions(layout=_C.LayoutOptions(dp=dp))
    try:
        all_params = _tensors(params)
        trainable_only = bool_option("trainable_only", trainable_only)
        round_robin = bool_option("round_robin", round_robin)
        verify = bool_option("verify", verify)
        check_values = bool_option("check_values", check_values)
        check_options(tier, master_dtype, threads, margin_bytes, alignment_factor,
                      param_align_bytes)
        rules = release_rules(deepspeed)
        indices, _ = select(all_params, rules, trainable_only)
        group_params = [all_params[i] for i in indices]
        _validate(group_params, indices)
        options.layout = layout_options(dp, round_robin, alignment_factor, group_params[0].dtype,
                                        param_align_bytes)
        if rules is not None:
            check_release_options(options.layout, rules)
        if expected_offsets is not None:
            options.expected_offsets = [int_option(f"expected_offsets[{i}]", o, 0)
                                        for i, o in enumerate(expected_offsets)]
        if expected_flat_numel is not None:
            options.expected_flat_numel = int_option("expected_flat_numel", expected_flat_numel,
                                                     0)
    except Exception as e:  # noqa: BLE001 - whatever it is, every rank must learn of it
        local_error = e
    if local_error is not None and dp == 1:
        raise local_error

    ok = local_error is None
    if ok:
        dtype = group_params[0].dtype
        device = group_params[0].device
        engine = _C.TorchDevice(str(device), engine_threads(threads, dp))
    else:
        # This rank only has to tell the others, in the same collective, that it refuses.
        dtype, device = torch.bfloat16, torch.device("cpu")
        engine = _C.TorchDevice("cpu", 1)
        group_params = []
    comm, rank = None, 0
    if process_group is not None:
        comm = TorchComm(process_group, engine, comm_device(process_group, device))
        rank = comm.rank

    if ok:
        framework_memory(options, device)

    shapes = [p.shape for p in group_params]
    before = []
    if verify and ok:
        before = [engine.checksum(p.data_ptr(), p.numel() * p.element_size()) for p in group_params]

    def release_originals() -> None:
        for p in group_params:
            p.data = torch.empty(0, dtype=dtype, device=device)

    if ok:
        options.tier = tier
        options.margin_bytes = None if margin_bytes is None else int(margin_bytes)
        options.master = master_dtype == torch.float32
        options.names = [f"parameter {i}" for i in indices]
        options.release = rules
    else:
        options.local_error = str(local_error)
    options.check_values = bool(check_values)
    options.must_match = [f"master_dtype {master_dtype}", f"verify {verify}",
                          f"trainable_only {trainable_only}",
                          f"deepspeed rules {rules.rules if rules else None}"]
    if rank == _fault_rank:
        options.fault_step = _fault_step
    try:
        report, flat_bytes, master_bytes, lay = _C.flatten(
            engine, comm if (comm is not None and dp > 1) else None,
            [p.data_ptr() for p in group_params], [list(p.shape) for p in group_params],
            options, release_originals=release_originals, defer_release=bool(_rebinds))
    except InvalidArgument:
        if local_error is not None:
            raise local_error from None  # this rank's own error, as it was found
        raise
    except CommError as e:
        if comm is not None and comm.failure is not None:
            raise e from comm.failure
        raise
    report["dp"] = dp
    report["deepspeed"] = rules.to_dict() if rules else None
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
        partition, master = partition_and_master(flat, lay, rank, master_bytes, master_dtype)
        fg = FlatGroup(flat=flat, partition=partition, master=master, tier=report["tier"],
                       layout=lay, report=report, params=group_params, rank=rank, dp=dp)
    if report["outcome"] != "done":
        raise ExecutionError(f"flattening failed: {report['error']}", report["outcome"], report,
                             fg) from (comm.failure if comm is not None else None)
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

