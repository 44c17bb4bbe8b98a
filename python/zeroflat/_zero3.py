"""zeroflat.hf.from_pretrained under DeepSpeed ZeRO-3: each rank reads only its own partition of
every parameter, straight into one buffer laid out as the Stage 3 optimizer's flat partitions
(``lp_param_buffer``), and the parameters become ZeRO-3 parameters whose ``ds_tensor``s are
views of it, made by DeepSpeed's own ``zero.Init`` conversion as if the model had been built
inside ``zero.Init``. No all-gather, no rank reading the whole checkpoint, no initialization."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C
from ._common import bool_option, layout_options
from ._errors import NoFeasiblePlan
from ._load import _Prepared, _prepare, call_loader, engine_and_comm, meta_parameters

log = logging.getLogger("zeroflat")

# --- which DeepSpeed config -------------------------------------------------------------------


def live_config() -> Optional[dict]:
    """The DeepSpeed config of the live ``HfDeepSpeedConfig`` when it says ZeRO-3, exactly as
    Transformers' ``from_pretrained`` asks (``is_deepspeed_zero3_enabled``), else None."""
    try:
        from transformers.integrations.deepspeed import (deepspeed_config,
                                                         is_deepspeed_zero3_enabled)
    except ImportError:
        return None
    return deepspeed_config() if is_deepspeed_zero3_enabled() else None


def resolve(zero3: Any) -> Optional[dict]:
    """The DeepSpeed config ``from_pretrained(zero3=...)`` loads for, or None for ZeRO-1/2:
    ``"auto"`` the live ``HfDeepSpeedConfig``'s when it says stage 3; ``True`` the same, and an
    error when there is none; ``False`` never; a dict, a path to a JSON file, or an object with
    a ``config`` dict (an ``HfDeepSpeedConfig``), whose ``zero_optimization.stage`` must be 3."""
    if isinstance(zero3, str) and zero3 == "auto":
        return live_config()
    if zero3 is False or zero3 is None:
        return None
    if zero3 is True:
        config = live_config()
        if config is None:
            raise ValueError("zero3=True, but no live HfDeepSpeedConfig says ZeRO-3 (make "
                             "TrainingArguments(deepspeed=...) first, or pass the DeepSpeed "
                             "config as zero3=)")
        return config
    if isinstance(zero3, (str, os.PathLike)):
        with open(zero3) as f:
            config = json.load(f)
    elif isinstance(zero3, dict):
        config = zero3
    elif isinstance(getattr(zero3, "config", None), dict):
        config = zero3.config
    else:
        raise TypeError(f"zero3 is {zero3!r}: expected \"auto\", True, False, a DeepSpeed config "
                        "dict, a path to one, or an HfDeepSpeedConfig")
    stage = (config.get("zero_optimization") or {}).get("stage")
    if stage != 3:
        raise ValueError(f"zero3: the DeepSpeed config's zero_optimization.stage is {stage!r}, "
                         "not 3")
    return config


def init_object(config: dict, process_group):
    """DeepSpeed's own ``zero.Init`` for ``config`` (not entered: its conversion of parameters
    into ZeRO-3 parameters, its dtype and devices), refused where this loader cannot make what
    it would make."""
    import deepspeed

    kwargs = {"config_dict_or_path": config}
    if process_group is not None and process_group is not dist.group.WORLD:
        kwargs["data_parallel_group"] = process_group
    init = deepspeed.zero.Init(**kwargs)
    if getattr(init, "zero_param_process_group", None) is not None:
        raise NotImplementedError("zero3: hpZ (zero_hpz_partition_size > 1) keeps a secondary "
                                  "partition zeroflat does not load")
    if getattr(init, "param_swapper", None) is not None:
        raise NotImplementedError("zero3: offload_param to nvme is not loaded by zeroflat "
                                  "(offload_param to cpu is)")
    if getattr(init, "quantized_weights", False) or getattr(
            init, "quantized_nontrainable_weights", False):
        raise NotImplementedError("zero3: quantized weights are not loaded by zeroflat")
    for name in ("_convert_to_deepspeed_param", "dtype", "local_device", "remote_device"):
        if not hasattr(init, name):
            raise NotImplementedError(
                f"zero3: this DeepSpeed ({deepspeed.__version__}) has no zero.Init.{name}, "
                "which zeroflat makes its ZeRO-3 parameters with")
    return init


# --- the order zero.Init would number the parameters in ----------------------------------------

class _Order:
    """Where ``zero.Init`` would have numbered each parameter (``ds_id``): it converts a
    module's own parameters when the module's construction completes (its outermost
    ``__init__`` returns), so a parameter's place is its module's completion and its place
    among the module's own parameters. Parameters replaced afterwards (tied weights) keep their
    number used, as under ``zero.Init``."""

    def __init__(self, then=None):
        self.then = then
        self.slots: Dict[Tuple[int, str], int] = {}
        self.count = 0
        self.modules: List[torch.nn.Module] = []  # alive, so that their ids stay theirs

    def completed(self, module: torch.nn.Module) -> None:
        self.modules.append(module)
        seen = set()
        for name, p in module.__dict__.get("_parameters", {}).items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            self.slots[(id(module), name)] = self.count
            self.count += 1
        if self.then is not None:
            self.then(module)

    def index(self, model: torch.nn.Module, name: str) -> Optional[int]:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        return self.slots.get((id(module), attr))


def _subclasses(cls) -> List[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return list(dict.fromkeys(out))


@contextlib.contextmanager
def construction_order(then=None):
    """While a model is constructed inside, the completion of every module's construction is
    recorded in an ``_Order`` (each module class's ``__init__`` wrapped, also of classes defined
    inside; the outermost call per module counts), and ``then(module)`` called."""
    order = _Order(then)
    entered: set = set()
    wrapped: List[Tuple[type, Any]] = []

    def wrap(cls):
        if "__init__" not in cls.__dict__ or getattr(cls.__dict__["__init__"], "_zeroflat_order",
                                                     False):
            return
        init = cls.__dict__["__init__"]

        @functools.wraps(init)
        def wrapper(module, *args, **kwargs):
            first = id(module) not in entered
            entered.add(id(module))
            try:
                init(module, *args, **kwargs)
            finally:
                if first:
                    entered.discard(id(module))
            if first:
                order.completed(module)

        wrapper._zeroflat_order = True
        cls.__init__ = wrapper
        wrapped.append((cls, init))

    module_cls = torch.nn.Module
    had_own = "__init_subclass__" in module_cls.__dict__
    old_subclass = module_cls.__dict__.get("__init_subclass__")

    def init_subclass(cls, **kwargs):
        super(module_cls, cls).__init_subclass__(**kwargs)
        wrap(cls)

    for cls in _subclasses(module_cls):
        wrap(cls)
    module_cls.__init_subclass__ = classmethod(init_subclass)
    try:
        yield order
    finally:
        if had_own:
            module_cls.__init_subclass__ = old_subclass
        else:
            del module_cls.__init_subclass__
        for cls, init in reversed(wrapped):
            cls.__init__ = init


@contextlib.contextmanager
def transformers_zero_init_off():
    """Transformers' own ``zero.Init`` around model construction off (a live ZeRO-3
    ``HfDeepSpeedConfig`` would turn it on in ``from_config``): by Transformers' own switch
    (``set_zero3_state``), or, in a release without it, its check answering no meanwhile."""
    try:
        from transformers import modeling_utils
    except ImportError:
        yield
        return
    switch = getattr(modeling_utils, "set_zero3_state", None)
    if switch is not None:
        with switch():
            yield
        return
    check = getattr(modeling_utils, "is_deepspeed_zero3_enabled", None)
    if check is None:
        yield
        return
    modeling_utils.is_deepspeed_zero3_enabled = lambda: False
    try:
        yield
    finally:
        modeling_utils.is_deepspeed_zero3_enabled = check


# --- the load ------------------------------------------------------------------------------


@dataclass
class Zero3Load:
    """What ``from_pretrained`` loaded under ZeRO-3 (``model.zeroflat_zero3``): ``flat``, this
    rank's buffer of the optimizer groups' partitions (``lp_param_buffer``'s layout), and
    ``frozen``, that of every other parameter (None when there are none); ``params`` and
    ``frozen_params`` the parameters in buffer order, ``offsets``/``frozen_offsets`` each one's
    element offset; ``reports`` the library's load documents."""

    flat: Optional[torch.Tensor]
    frozen: Optional[torch.Tensor]
    params: List[torch.nn.Parameter] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)
    frozen_params: List[torch.nn.Parameter] = field(default_factory=list)
    frozen_offsets: List[int] = field(default_factory=list)
    reports: List[dict] = field(default_factory=list)
    rank: int = 0
    dp: int = 1


def _partition_numel(numel: int, world: int) -> int:
    return -(-numel // world)


_CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


@contextlib.contextmanager
def zero_init_tensors(init):
    """While a model is constructed inside, tensors are made as inside ``zero.Init``
    (Transformers' way): DeepSpeed's own wrappers of torch's constructors give floating-point
    tensors ``init``'s dtype (``torch.arange`` excepted, as Transformers excepts it), so that
    the buffers are what ``zero.Init`` makes; where the release can say so, without moving
    them to the device (the parameters go to the meta device, the buffers later)."""
    add = getattr(init, "_add_tensor_creation_wrappers", None)
    if add is None:
        yield
        return
    try:
        from transformers.integrations.deepspeed import prevent_arange_dtype_change
    except ImportError:
        prevent_arange_dtype_change = contextlib.nullcontext
    saved = {name: getattr(torch, name) for name in _CONSTRUCTORS}
    had_new = "__new__" in torch.Tensor.__dict__
    saved_new = torch.Tensor.__dict__.get("__new__")
    overrides = getattr(init, "tensor_overrides", None)
    with prevent_arange_dtype_change():
        if overrides is not None:
            init.tensor_overrides = [o for o in overrides if getattr(o, "name", "") == "dtype"]
        try:
            add()
            yield
        finally:
            for name, fn in saved.items():
                setattr(torch, name, fn)
            if had_new:
                torch.Tensor.__new__ = saved_new
            elif "__new__" in torch.Tensor.__dict__:
                del torch.Tensor.__new__
            if overrides is not None:
                init.tensor_overrides = overrides


def build_meta(build, init):
    """``build()`` (the model's construction) without memory and without initialization, its
    tensors made as inside ``init`` (DeepSpeed's ``zero.Init``), with the order ``zero.Init``
    would have numbered its parameters in; each module's buffers that the release keeps in
    fp32 (``zero.Init._keep_in_fp32``, where it has it) as it keeps them."""
    keep = getattr(init, "_keep_in_fp32", None)
    with transformers_zero_init_off(), zero_init_tensors(init), \
            construction_order(keep) as order, meta_parameters():
        model = build()
    return model, order


def load(model: torch.nn.Module, order: _Order, path: str, init, process_group, *,
         param_groups, dtype: torch.dtype, cold: bool = False,
         threads: Optional[int] = None) -> Zero3Load:
    """Every parameter of ``model`` (built by ``build_meta``) as a ZeRO-3 parameter of ``init``
    (DeepSpeed's ``zero.Init``), its ``ds_tensor`` this rank's partition read from checkpoint
    ``path`` into one buffer (the optimizer groups', ``param_groups``) or the other (every other
    parameter). Collective over ``process_group``; errors agreed as ``load_param_groups``
    agrees them."""
    dp = dist.get_world_size(process_group) if process_group is not None else 1
    local_error: Optional[BaseException] = None
    prep: Optional[_Prepared] = None
    remote = str(getattr(init.remote_device, "value", init.remote_device))
    local = torch.device(init.local_device)
    target = torch.device("cpu") if remote == "cpu" else local
    try:
        cold = bool_option("cold", cold)
        prep = _prepare(model, path, dp, param_groups, dtype, target, False, 2, 0, None, None,
                        None, threads, True, zero3=True)
    except Exception as e:  # noqa: BLE001 - whatever it is, every rank must learn of it
        local_error = e
    if local_error is not None and dp == 1:
        raise local_error

    ok = prep is not None
    engine, nthreads, comm, rank = engine_and_comm(target, threads if ok else 1, dp,
                                                   process_group)
    ck_path = prep.ck.path if ok else str(path)

    # Two loads on every rank: the optimizer groups' buffer, then the other parameters'. The
    # first carries any rank's own error, so that every rank raises at the same point.
    parts = []
    if ok:
        trainable, other = prep.groups[:-1], prep.groups[-1]
        parts = [[lp for g in trainable for lp in g.params], list(other.params)]
        members = [[p for g in trainable for p in g.members], list(other.members)]
    results = []
    for k in range(2):
        if k == 1 and ok and not parts[1]:
            # No other parameters: the first load agreed on the model, so every rank skips it.
            results.append(({}, None))
            continue
        options = _C.LoadOptions(layout=_C.LayoutOptions(dp=dp), cold=cold, threads=nthreads)
        if ok:
            options.layout = layout_options(dp, False, 2, dtype, 0)
        if local_error is not None:
            options.local_error = f"{type(local_error).__name__}: {local_error}"
        options.must_match = (f"zero3 buffer {k}, device {target.type}, dtype {dtype}, "
                              f"model {prep.digest if ok else ''}")
        report, flat_bytes, _ = call_loader(
            _C.load_partitions, engine, comm if dp > 1 else None, prep.ck if ok else None,
            parts[k] if ok else [], options, local_error,
            f"loading the ZeRO-3 partitions of {ck_path}")
        report["dp"] = dp
        if report.get("outcome") == "infeasible":
            raise NoFeasiblePlan(f"this rank's partitions do not fit on {target}: "
                                 f"{report.get('reason')}; nothing was read", report)
        results.append((report, flat_bytes))
    assert local_error is None and prep is not None

    out = Zero3Load(flat=None, frozen=None, rank=rank, dp=dp)
    views: Dict[int, torch.Tensor] = {}
    for k, (report, flat_bytes) in enumerate(results):
        numels = [_partition_numel(p.numel(), dp) for p in members[k]]
        total = sum(numels)
        flat = None
        if flat_bytes is not None and total:
            flat = flat_bytes.view(dtype)[:total]
            if remote == "cpu" and getattr(init, "pin_memory", False):
                from deepspeed.accelerator import get_accelerator

                flat = get_accelerator().pin_memory(flat)
        offsets, at = [], 0
        for p, n in zip(members[k], numels):
            offsets.append(at)
            views[id(p)] = (flat[at: at + n] if flat is not None
                            else torch.empty(0, dtype=dtype, device=target))
            at += n
        if k == 0:
            out.flat, out.offsets = flat, offsets
        else:
            out.frozen, out.frozen_offsets = flat, offsets
        if report:
            out.reports.append(report)

    # Buffers the checkpoint holds, and the others, on the device zero.Init keeps them on.
    for name, value in prep.buffers:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        module._buffers[attr] = value.to(local)
    for module in model.modules():
        for attr, b in list(module._buffers.items()):
            if b is not None and b.device != local:
                module._buffers[attr] = b.to(local)

    made = _zero_parameters(model, order, init, views, dtype, local)
    out.params = [made[id(p)] for p in members[0]]
    out.frozen_params = [made[id(p)] for p in members[1]]
    return out


def _zero_parameters(model: torch.nn.Module, order: _Order, init, views: Dict[int, torch.Tensor],
                     dtype: torch.dtype, local: torch.device) -> Dict[int, torch.nn.Parameter]:
    """Every parameter of ``model`` replaced by a ZeRO-3 parameter made by DeepSpeed's own
    conversion (``init._convert_to_deepspeed_param``), in the order and with the ``ds_id`` that
    ``zero.Init`` would have given it, ``ds_tensor`` its view, then partitioned by DeepSpeed
    (``param.partition()``: the data an empty placeholder, NOT_AVAILABLE). Returns the new
    parameters by the old ones' ids."""
    from deepspeed.runtime.zero.partition_parameters import Init, PartitionedParamStatus

    aliases: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    unique = {id(p): p for p in model.parameters()}
    indexed = []
    extra = order.count
    for pid, p in unique.items():
        index = order.index(model, aliases[pid][0])
        if index is None:  # registered after its module was made: numbered after the others
            index, extra = extra, extra + 1
        indexed.append((index, pid, p))
    indexed.sort(key=lambda t: t[0])

    slots: Dict[int, List[Tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for key, q in module._parameters.items():
            if q is not None:
                slots.setdefault(id(q), []).append((module, key))
    base = Init.param_id
    made: Dict[int, torch.nn.Parameter] = {}
    for index, pid, old in indexed:
        # The whole shape without memory: what zero.Init's conversion reads of a parameter.
        shell = torch.empty(1, dtype=dtype, device=local).expand(old.shape)
        param = torch.nn.Parameter(shell, requires_grad=old.requires_grad)
        for k, v in vars(old).items():
            setattr(param, k, v)
        for module, key in slots[pid]:
            module._parameters[key] = param
        Init.param_id = base + index
        init._convert_to_deepspeed_param(param)
        view = views[pid]
        view.requires_grad = False
        param.ds_tensor = view
        view.ds_numel = view.numel()
        view.status = PartitionedParamStatus.AVAILABLE
        view.final_location = None
        param.ds_numel_aligned = view.numel() * dist.get_world_size(param.ds_process_group)
        param.data = torch.empty(0, dtype=dtype, device=local)
        param.partition()
        param._is_hf_initialized = True
        made[pid] = param
    Init.param_id = base + extra
    return made
