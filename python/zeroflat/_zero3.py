"""DeepSpeed ZeRO-3 as a placement of ``zeroflat.load_param_groups``: each rank reads only its own
partition of every parameter, straight into one buffer laid out as the Stage 3 optimizer's flat
partitions (``lp_param_buffer``), and the parameters become ZeRO-3 parameters whose
``ds_tensor``s are views of it, made by DeepSpeed's own ``zero.Init`` conversion as if the model
had been built inside ``zero.Init``. No all-gather, no rank reading the whole checkpoint, no
initialization.

Here: which DeepSpeed config (and the refusals decided from it before anything process-wide is
made), DeepSpeed's ``zero.Init`` object, the order ``zero.Init`` numbers parameters in (recorded
while a model is built under ``zeroflat.meta_parameters()``), building a model as ``zero.Init``
would make its tensors, and the placement itself (``Partitions``)."""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ._patches import KEEP, Patch, apply, patched, restore

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


def is_init(zero3: Any) -> bool:
    """Whether ``zero3`` is a ``deepspeed.zero.Init`` object (made by the caller)."""
    return hasattr(zero3, "_convert_to_deepspeed_param")


def resolve(zero3: Any) -> Any:
    """What ``zero3=`` names: None for ZeRO-1/2, else a DeepSpeed config dict (or the
    ``zero.Init`` object given). ``"auto"``: the live ``HfDeepSpeedConfig``'s when it says stage
    3; ``True`` the same, and an error when there is none; ``False``/None never; a dict, a path
    to a JSON file, or an object with a ``config`` dict (an ``HfDeepSpeedConfig``), whose
    ``zero_optimization.stage`` must be 3; or a ``deepspeed.zero.Init`` object."""
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
    if is_init(zero3):
        return zero3
    if isinstance(zero3, (str, os.PathLike)):
        with open(zero3) as f:
            config = json.load(f)
    elif isinstance(zero3, dict):
        config = zero3
    elif isinstance(getattr(zero3, "config", None), dict):
        config = zero3.config
    else:
        raise TypeError(f"zero3 is {zero3!r}: expected \"auto\", True, False, a DeepSpeed config "
                        "dict, a path to one, an HfDeepSpeedConfig, or a deepspeed.zero.Init")
    section = config.get("zero_optimization") if isinstance(config, dict) else None
    if not isinstance(section, dict):
        raise ValueError(f"zero3: the DeepSpeed config's zero_optimization is {section!r}: "
                         "expected a section such as {\"stage\": 3, ...}")
    stage = section.get("stage")
    if stage != 3:
        raise ValueError(f"zero3: the DeepSpeed config's zero_optimization.stage is {stage!r}, "
                         "not 3")
    return config


def _enabled(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def refusal(config: dict) -> Optional[str]:
    """Why zeroflat cannot load for this ZeRO-3 config, decided from the config alone (before
    ``zero.Init`` makes any process-wide state, such as hpZ's process groups), or None."""
    z = config.get("zero_optimization") or {}
    if int(z.get("zero_hpz_partition_size") or 1) > 1:
        return ("zero3: hpZ (zero_hpz_partition_size > 1) keeps a secondary partition zeroflat "
                "does not load")
    if str((z.get("offload_param") or {}).get("device", "none")).lower() == "nvme":
        return "zero3: offload_param to nvme is not loaded by zeroflat (offload_param to cpu is)"
    if _enabled(z.get("zero_quantized_weights")) or _enabled(
            z.get("zero_quantized_nontrainable_weights")):
        return "zero3: quantized weights are not loaded by zeroflat"
    return None


def init_object(zero3: Any, process_group):
    """DeepSpeed's own ``zero.Init`` for a config resolved by ``resolve`` (not entered: its
    conversion of parameters into ZeRO-3 parameters, its dtype and devices), or the one given;
    refused (NotImplementedError) where this loader cannot make what it would make, from the
    config before anything is made."""
    if is_init(zero3):
        init = zero3
    else:
        why = refusal(zero3)
        if why is not None:
            raise NotImplementedError(why)
        import deepspeed

        kwargs = {"config_dict_or_path": zero3}
        if process_group is not None and process_group is not dist.group.WORLD:
            kwargs["data_parallel_group"] = process_group
        init = deepspeed.zero.Init(**kwargs)
    # The same refusals on what the object says (a zero.Init made by the caller).
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
            import deepspeed

            raise NotImplementedError(
                f"zero3: this DeepSpeed ({deepspeed.__version__}) has no zero.Init.{name}, "
                "which zeroflat makes its ZeRO-3 parameters with")
    return init


# --- the order zero.Init would number the parameters in ----------------------------------------

class Order:
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


# The order each model built under meta_parameters() was made in, by its outermost module.
_ORDERS: "weakref.WeakKeyDictionary[torch.nn.Module, Order]" = weakref.WeakKeyDictionary()


def order_of(model: torch.nn.Module) -> Optional[Order]:
    return _ORDERS.get(model)


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
    recorded in an ``Order`` (each module class's ``__init__`` wrapped, also of classes defined
    inside; the outermost call per module counts), and ``then(module)`` called. Every model
    completed inside is remembered with its order (``order_of``)."""
    order = Order(then)
    entered: set = set()
    completed: List[torch.nn.Module] = []

    def init(original, module, *args, **kwargs):
        first = id(module) not in entered
        entered.add(id(module))
        try:
            original(module, *args, **kwargs)
        finally:
            if first:
                entered.discard(id(module))
        if first:
            order.completed(module)
            completed.append(module)

    def own_init(cls) -> List[Patch]:
        return [Patch(cls, "__init__", hook=init)] if "__init__" in cls.__dict__ else []

    module_cls = torch.nn.Module
    applied = apply([p for cls in _subclasses(module_cls) for p in own_init(cls)])

    def init_subclass(cls, **kwargs):
        super(module_cls, cls).__init_subclass__(**kwargs)
        applied.entries.extend(apply(own_init(cls)).entries)

    try:
        with patched([Patch(module_cls, "__init_subclass__", value=classmethod(init_subclass))]):
            yield order
    finally:
        restore(applied)
        # The outermost modules completed inside: the models built.
        inner = {id(m) for c in completed for m in c.modules() if m is not c}
        for m in completed:
            if id(m) not in inner:
                _ORDERS[m] = order


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
    overrides = getattr(init, "tensor_overrides", None)
    # DeepSpeed's wrappers replace these attributes themselves; they are put back after.
    kept = [Patch(torch, name, value=KEEP) for name in _CONSTRUCTORS]
    kept.append(Patch(torch.Tensor, "__new__", value=KEEP))
    if overrides is not None:
        kept.append(Patch(init, "tensor_overrides",
                          value=[o for o in overrides if getattr(o, "name", "") == "dtype"]))
    with prevent_arange_dtype_change(), patched(kept):
        add()
        yield


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
    with patched([Patch(modeling_utils, "is_deepspeed_zero3_enabled", value=lambda: False,
                        optional=True)]):
        yield


@contextlib.contextmanager
def building(init):
    """A model built inside is made as inside ``zero.Init`` (``init``): its tensors in
    ``init``'s dtype, each module's buffers that the release keeps in fp32 kept so
    (``zero.Init._keep_in_fp32``, where it has it), Transformers' own ``zero.Init`` off."""
    with transformers_zero_init_off(), zero_init_tensors(init):
        yield getattr(init, "_keep_in_fp32", None)


# --- the placement ------------------------------------------------------------------------------

class Partitions:
    """ZeRO-3's placement of ``load_param_groups``: two buffers (the optimizer groups' trainable
    parameters, groups in order, as the Stage 3 optimizer's lp_param_buffer; and every other
    parameter), each rank reading its own partition of every parameter (the library's load with
    the "partitions" placement);
    then every parameter a ZeRO-3 parameter of ``init``."""

    kind = "partitions"  # the library's placement (loader.h's LoadPlacement)
    tier = "load-partitions"

    def __init__(self, zero3: Any, process_group):
        self.init = init_object(zero3, process_group)
        self.process_group = self.init.ds_process_group
        if dist.get_world_size(self.process_group) == 1:
            self.process_group = None
        self.dtype = self.init.dtype
        remote = str(getattr(self.init.remote_device, "value", self.init.remote_device))
        self.local = torch.device(self.init.local_device)
        self.offloaded = remote == "cpu"
        self.target = torch.device("cpu") if self.offloaded else self.local

    def buffers(self, groups: List[List[torch.nn.Parameter]], model: torch.nn.Module,
                rules) -> List[List[torch.nn.Parameter]]:
        """Every trainable parameter of a group stays in it (Stage 3 leaves none out), the
        groups' in one buffer; one last buffer holds every other parameter (frozen ones, and
        those of no group), partitioned too."""
        trainable = [p for g in groups for p in g if p.requires_grad]
        ids = {id(p) for p in trainable}
        return [trainable, [p for p in model.parameters() if id(p) not in ids]]

    def layout_options(self, dp: int, dtype: torch.dtype):
        from ._common import layout_options

        return layout_options(dp, False, 2, dtype, 0)

    def finish(self, model: torch.nn.Module, loaded: List[tuple], prep, rank: int, dp: int,
               master_dtype: Optional[torch.dtype], engine=None) -> list:
        """The loaded partitions as the parameters' ds_tensors (each buffer's views at the
        offsets its layout gives), the buffers on zero.Init's device, every parameter a ZeRO-3
        parameter. Returns a FlatGroup per non-empty buffer: its flat and partition are the
        rank's buffer, its master that buffer up-cast (or None)."""
        from ._common import FlatGroup

        out = []
        views: Dict[int, torch.Tensor] = {}
        for members, report, flat_bytes, master_bytes, lay in loaded:
            if report is None:  # an empty buffer, not loaded
                continue
            flat = None
            if flat_bytes is not None and lay["flat_numel"]:
                flat = flat_bytes[: lay["flat_bytes"]].view(self.dtype)
                if self.offloaded and getattr(self.init, "pin_memory", False):
                    from deepspeed.accelerator import get_accelerator

                    flat = get_accelerator().pin_memory(flat)
            for p, off, n in zip(members, lay["offsets"], lay["numels"]):
                views[id(p)] = (flat[off: off + n] if flat is not None
                                else torch.empty(0, dtype=self.dtype, device=self.target))
            if members:
                out.append((members, report, flat, master_bytes, lay))
        # Buffers the checkpoint holds, and the others, on the device zero.Init keeps them on.
        for name, value in prep.buffers:
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            module._buffers[attr] = value.to(self.local)
        for module in model.modules():
            for attr, b in list(module._buffers.items()):
                if b is not None and b.device != self.local:
                    module._buffers[attr] = b.to(self.local)
        made = _zero_parameters(model, order_of(model), self.init, views, self.dtype, self.local)
        groups = []
        for members, report, flat, master_bytes, lay in out:
            if flat is None:
                flat = torch.empty(0, dtype=self.dtype, device=self.target)
            master = None
            if master_bytes is not None:
                master = master_bytes[: flat.numel() * 4].view(torch.float32)
            elif master_dtype is not None:
                master = flat.detach().to(master_dtype, copy=True)
            groups.append(FlatGroup(flat=flat, partition=flat, master=master,
                                    tier=report["tier"], layout=lay, report=report,
                                    params=[made[id(p)] for p in members], rank=rank, dp=dp))
        return groups


def _zero_parameters(model: torch.nn.Module, order: Optional[Order], init,
                     views: Dict[int, torch.Tensor], dtype: torch.dtype,
                     local: torch.device) -> Dict[int, torch.nn.Parameter]:
    """Every parameter of ``model`` replaced by a ZeRO-3 parameter made by DeepSpeed's own
    conversion (``init._convert_to_deepspeed_param``), in the order and with the ``ds_id`` that
    ``zero.Init`` would have given it (the recorded construction order; without one, each
    module's own parameters after its children's, as modules complete), ``ds_tensor`` its view,
    then partitioned by DeepSpeed (``param.partition()``: the data an empty placeholder,
    NOT_AVAILABLE). Returns the new parameters by the old ones' ids."""
    from deepspeed.runtime.zero.partition_parameters import Init, PartitionedParamStatus

    if order is None:
        order = Order()
        for module in _post_order(model):
            order.completed(module)
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


def _post_order(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules as their constructions would complete: children before their parent."""
    out: List[torch.nn.Module] = []
    seen = set()

    def visit(m):
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append(m)

    visit(model)
    return out
