"""zeroflat.load_param_groups: a model's parameters built straight from a safetensors checkpoint
into DeepSpeed's buffers by the library's loader (loader.h): ZeRO-1/2's flat buffers (each rank
reads its partition and one all-gather completes the buffer, or, for ranks of one host, each
reads the whole buffer from the host's page cache), or ZeRO-3's partitions (``_zero3``: each
rank reads only its own partition of every parameter). ``run_loads`` is the package's one load
loop: these loads, FSDP2's shards (``fsdp``) and a resume's buffers (``_resume``) each hand it
their placement values.

Past 700 lines on purpose: the one loop serves every placement, and its options, their checks
and the errors every rank must agree on are read together; the ZeRO-3 specifics are in
``_zero3``."""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _C, _hf_names, _zero3
from ._comm import TorchComm, comm_device
from ._common import (DTYPES, FILE_DTYPES, TORCH_DTYPES, FlatGroup, bool_option, check_options,
                      check_release_options, dtype_name, engine_threads, framework_memory,
                      layout_options, native_path, partition_and_master, path_text,
                      release_rules, select)
from ._errors import CommError, Error, InvalidArgument, NoFeasiblePlan
from ._patches import Patch, patched
from ._progress import Progress, Watch, check_callback

log = logging.getLogger("zeroflat")

Shape = List[int]

# --- the buffers the loader built -------------------------------------------------------------


@dataclass
class LoadedBuffer:
    """A flat buffer the loader built, as the DeepSpeed drop-in finds it again: the buffer
    (weakly: one nothing uses any more is forgotten), the parameters in it, and the groups of
    the load that made it (what the buffers were laid out for)."""

    flat: "weakref.ref[torch.Tensor]"
    numel: int
    names: List[str]          # the parameters in the buffer, in group order
    index: int                # which of the load's groups
    groups: List[List[str]]   # every group of that load, as parameter names (trainable, kept)
    round_robin: bool
    model: "weakref.ref[torch.nn.Module]"
    # This rank's fp32 master partition as the load built it, offered to DeepSpeed's optimizer:
    # the drop-in hands it over where the optimizer up-casts this very partition with its bytes
    # as the load left them (master_sum, their checksum then), and forgets it once that
    # optimizer is built, handed over or not.
    master: Optional[torch.Tensor] = None
    master_offset: int = 0  # the partition's first element in the buffer
    master_sum: int = 0


# By the buffer storage's address.
_LOADED: Dict[int, LoadedBuffer] = {}


def loaded_entry(tensor: torch.Tensor) -> Optional[LoadedBuffer]:
    """The loaded buffer ``tensor`` is a view into (by its storage), or None."""
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    entry = _LOADED.get(ptr)
    if entry is None:
        return None
    flat = entry.flat()
    if flat is None or flat.untyped_storage().data_ptr() != ptr:
        _LOADED.pop(ptr, None)
        return None
    return entry


def loaded_buffer(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The flat buffer the loader built that the first of ``tensors`` is a view into, or None
    (the caller checks the others against it)."""
    if not tensors:
        return None
    entry = loaded_entry(tensors[0])
    return entry.flat() if entry is not None else None


def take_master(t: torch.Tensor, engine) -> Optional[torch.Tensor]:
    """The fp32 master partition the load built from exactly ``t`` (a loaded buffer's partition,
    contiguous), handed over once, when ``t``'s bytes are still the ones it was built from
    (``engine``'s checksum of them); else None. A master whose partition changed since the load
    is dropped."""
    entry = loaded_entry(t)
    if entry is None or entry.master is None:
        return None
    flat, master = entry.flat(), entry.master
    if (flat is None or t.dtype != flat.dtype or t.device != flat.device
            or not t.is_contiguous() or t.numel() != master.numel()
            or t.storage_offset() - flat.storage_offset() != entry.master_offset):
        return None
    entry.master = None
    if engine.checksum(t.data_ptr(), t.numel() * t.element_size()) != entry.master_sum:
        log.info("zeroflat: the buffer's partition changed since the load; its master partition "
                 "is made again from it")
        return None
    return master


def forget_masters(entries: Iterable[Optional[LoadedBuffer]]) -> None:
    """The master partitions the loads offered with these buffers are no longer offered."""
    for entry in entries:
        if entry is not None:
            entry.master = None


def _register(flat: torch.Tensor, entry: LoadedBuffer) -> None:
    for ptr in [p for p, e in _LOADED.items() if e.flat() is None]:
        del _LOADED[ptr]
    _LOADED[flat.untyped_storage().data_ptr()] = entry


@contextlib.contextmanager
def meta_parameters(zero3: Any = None):
    """While a model is constructed inside, every parameter it registers goes to the ``meta``
    device (no memory, no initialization cost); buffers stay real, so that values computed at
    construction (rotary frequencies) are kept. The order in which modules complete their
    construction is recorded with the model (what ZeRO-3 numbers parameters by).

    ``zero3`` (a DeepSpeed ZeRO-3 config: a dict, a path to its JSON file, an HfDeepSpeedConfig;
    or a ``deepspeed.zero.Init``): tensors are made as inside DeepSpeed's ``zero.Init`` (its
    dtype for floating-point buffers, the buffers it keeps in fp32), for a model to be loaded
    with ``load_param_groups(..., zero3=)``. Yields that ``zero.Init`` (pass it as ``zero3=`` to
    the load), else None."""
    init = None
    keep = None
    with contextlib.ExitStack() as stack:
        if zero3 is not None:
            config = _zero3.resolve(zero3)
            if config is None:
                raise ValueError(f"zero3={zero3!r} names no ZeRO-3 config")
            init = _zero3.init_object(config, None)
            keep = stack.enter_context(_zero3.building(init))
        stack.enter_context(_zero3.construction_order(keep))
        stack.enter_context(patched([Patch(torch.nn.Module, "register_parameter",
                                           hook=_register_on_meta)]
                                    + [Patch(torch.Tensor, fill, hook=_skip_on_meta)
                                       for fill in _RANDOM_FILLS]))
        yield init


# The in-place random fills a model's initialization calls: on a meta tensor they change
# nothing, yet torch runs them through its reference decompositions (about a millisecond each,
# half a second for a 48-layer MoE); skipped there, as a fill of nothing.
_RANDOM_FILLS = ("normal_", "uniform_")


def _skip_on_meta(original, tensor, *args, **kwargs):
    if tensor.device.type == "meta":
        return tensor
    return original(tensor, *args, **kwargs)


def _register_on_meta(original, module, name, param):
    original(module, name, param)
    p = module._parameters.get(name)
    if p is not None and p.device.type != "meta":
        extra = {k: v for k, v in vars(p).items()}
        moved = type(p)(p.to("meta"), requires_grad=p.requires_grad)
        for k, v in extra.items():
            setattr(moved, k, v)
        module._parameters[name] = moved


def checkpoint_of(checkpoint) -> "_C.Checkpoint":
    if isinstance(checkpoint, _C.Checkpoint):
        return checkpoint
    if not isinstance(checkpoint, (str, bytes, os.PathLike)):
        raise TypeError(f"checkpoint is {checkpoint!r}: expected a path to a .safetensors file "
                        "or a directory of them")
    return _C.Checkpoint(native_path(checkpoint))


# --- parameters to checkpoint tensors ---------------------------------------------------------

def stored_name(name: str, rules: list, ck: "_C.Checkpoint") -> Optional[str]:
    """The tensor that holds ``name`` under its own name or one it was renamed from, or None."""
    return next((c for c in _hf_names.checkpoint_names(name, rules) if ck.has(c)), None)


def sources_of(names: List[str], shape: Sequence[int], rules: list,
                ck: "_C.Checkpoint") -> Optional[Tuple[List[str], List[Shape]]]:
    """The checkpoint tensors holding a parameter known by these names (tied weights have
    several; a checkpoint usually holds one of them), each also under the names Transformers'
    renaming rules give it, with the shape each must have; or None. A tensor of another shape
    is ValueError naming both."""
    shape = list(shape)
    for name in names:
        stored = stored_name(name, rules, ck)
        if stored is not None:
            have = list(ck.find(stored).shape)
            if have != shape:
                raise ValueError(f"parameter {names[0]!r} has shape {shape}, but tensor "
                                 f"{stored!r} of {ck.path} has shape {have}")
            return [stored], [shape]
    candidates = [c for n in names for c in _hf_names.checkpoint_names(n, rules)]
    for n in candidates:
        fused = _hf_names.fused_sources(n, shape, rules, ck)
        if fused is not None:
            return fused
    return None


def read_whole(ck: "_C.Checkpoint", what: str, names: List[str], shapes: List[Shape], shape,
                dtype: Optional[torch.dtype],
                raw_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The tensors named (each of the shape given), read whole and concatenated, as a CPU
    tensor of ``shape`` (converted to ``dtype``, or, when it is None, the bytes as stored for a
    ``raw_dtype`` buffer: read as the file's dtype, then converted as load_state_dict's copy
    would where the two differ; so is a buffer of a dtype the library converts whose tensor is
    stored in one it does not, such as int64 into float32)."""
    stored = [ck.find(n) for n in names]
    for t, want in zip(stored, shapes):
        if list(t.shape) != list(want):
            raise ValueError(f"{what!r} takes tensor {t.name!r} of {ck.path} as {list(want)}, "
                             f"but it is {list(t.shape)}")
    if raw_dtype is not None and len(stored) == 1 and stored[0].type is None:
        dtype = None
    if dtype is None:
        file_dtype = FILE_DTYPES.get(stored[0].dtype)
        if file_dtype is None:
            raise ValueError(f"buffer {what!r} ({raw_dtype}): tensor {names[0]!r} of {ck.path} "
                             f"is {stored[0].dtype}, a dtype zeroflat does not read")
        out = torch.empty(shape, dtype=file_dtype)
        if out.numel() * out.element_size() != stored[0].bytes:
            raise ValueError(f"buffer {what!r} ({raw_dtype}) has {out.numel()} elements, but "
                             f"tensor {names[0]!r} of {ck.path} is {stored[0].dtype} with "
                             f"{stored[0].bytes} bytes")
        ck.read(names[0], out.view(-1).view(torch.uint8))
        return out if file_dtype == raw_dtype else out.to(raw_dtype)
    for t in stored:
        if t.type is None:
            raise ValueError(f"{what!r}: tensor {t.name!r} of {ck.path} is {t.dtype}, which "
                             "zeroflat does not convert")
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    if sum(t.numel for t in stored) != flat.numel():
        raise ValueError(f"{what!r}: the tensors {names[:2]}... hold "
                         f"{sum(t.numel for t in stored)} elements, not its {flat.numel()}")
    at = 0
    for t in stored:
        ck.read(t.name, flat[at: at + t.numel])
        at += t.numel
    return out


def left_untied(model: torch.nn.Module, name: str, other: str, path: str) -> None:
    """Says (one warning, Transformers' words) that ``name`` and ``other``, tied by the model,
    are left untied because ``path`` holds them with different values, and takes the pair out
    of ``model.all_tied_weights_keys``, as Transformers does."""
    log.warning("zeroflat: the model ties %r to %r, but %s holds both with different values: "
                "they are left untied, as Transformers leaves them (set tie_word_embeddings=False "
                "in the config to say so)", name, other, path)
    tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(tied, dict):
        for target, source in list(tied.items()):
            if {target, source} == {name, other}:
                tied.pop(target)


def untie_differing(model: torch.nn.Module, aliases: Dict[int, List[str]],
                     params: Dict[int, torch.nn.Parameter], rules: list, ck: "_C.Checkpoint",
                     dtype: Optional[torch.dtype], used: set) -> None:
    """Tied weights (one Parameter under several names) of which the checkpoint holds several
    names with different values are untied, as Transformers (5.x) leaves them when it loads such
    a checkpoint: each name gets its own Parameter and its own tensor, and a warning says so.
    Names whose tensors hold the same values stay tied. Under Transformers 4 they all stay tied,
    as it ties them (``_hf_names.keeps_tied``)."""
    keep = _hf_names.keeps_tied(model)
    for key, names in list(aliases.items()):
        if len(names) < 2:
            continue
        p = params[key]
        stored = {n: s for n in names if (s := stored_name(n, rules, ck)) is not None}
        if len(set(stored.values())) < 2:
            continue
        if keep:
            # Tied as Transformers 4 ties them: the first name's tensor; the others are the
            # model's names all the same, not tensors left over.
            used.update(stored.values())
            continue
        want = dtype or p.dtype
        if want not in DTYPES:
            continue  # refused later, where every parameter's dtype is checked
        shape = list(p.shape)
        values: Dict[str, torch.Tensor] = {}
        for s in dict.fromkeys(stored.values()):
            values[s] = read_whole(ck, s, [s], [shape], shape, want)
        first = next(n for n in names if n in stored)
        reference = values[stored[first]]
        used.update(stored.values())
        for n in names:
            if n == first or n not in stored or torch.equal(values[stored[n]], reference):
                continue
            module_name, _, attr = n.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            twin = torch.nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"),
                                      requires_grad=p.requires_grad)
            for k, v in vars(p).items():
                setattr(twin, k, v)
            module._parameters[attr] = twin
            left_untied(model, n, first, ck.path)
    aliases.clear()
    params.clear()
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        params[id(p)] = p


def target_of(device: Any) -> torch.device:
    """Where ZeRO-1/2's buffers live: ``device``, else the current CUDA device if there is one,
    else the CPU."""
    if device is None:
        return _default_device()
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if target.type not in ("cpu", "cuda"):
        raise ValueError(f"device {target}: zeroflat loads onto cpu and cuda devices")
    return target


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _groups_of(model: torch.nn.Module, param_groups) -> List[List[torch.nn.Parameter]]:
    """The optimizer's groups as lists of the model's parameters."""
    by_name = dict(model.named_parameters())
    if callable(param_groups):
        param_groups = param_groups(model)
    if param_groups is None:
        return [list(model.parameters())]
    if isinstance(param_groups, (str, bytes, dict, torch.Tensor)):
        raise TypeError(f"param_groups is a {type(param_groups).__name__}: expected a list of "
                        "groups (each a list of the model's parameters or their names, or a "
                        "dict with 'params'), or a callable that returns one")
    out = []
    for gi, g in enumerate(param_groups):
        items = g["params"] if isinstance(g, dict) else g
        if isinstance(items, (torch.Tensor, str)):
            items = [items]
        group = []
        for item in items:
            if isinstance(item, str):
                if item not in by_name:
                    raise ValueError(f"param_groups[{gi}] names {item!r}, which the model does "
                                     "not have")
                group.append(by_name[item])
            elif isinstance(item, torch.Tensor):
                group.append(item)
            else:
                raise TypeError(f"param_groups[{gi}] holds a {type(item).__name__}: expected "
                                "the model's parameters or their names")
        out.append(group)
    return out


def _parameter_slots(model: torch.nn.Module) -> Dict[int, List[Tuple[torch.nn.Module, str]]]:
    """Every (module, name) slot of the model, by the id of the parameter it holds (a tied
    parameter has several): found once for the whole model, not once per parameter."""
    slots: Dict[int, List[Tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, key))
    return slots


def _replace_everywhere(slots: Dict[int, List[Tuple[torch.nn.Module, str]]],
                        old: torch.nn.Parameter, new: torch.Tensor) -> torch.nn.Parameter:
    """Every module slot holding ``old`` (``slots``: _parameter_slots of the model) now holds
    one new Parameter over ``new`` (so tied weights stay tied). A parameter off the meta device
    keeps its object and takes the data."""
    if old.device.type != "meta" and old.dtype == new.dtype:
        old.data = new
        return old
    param = torch.nn.Parameter(new, requires_grad=old.requires_grad)
    for k, v in vars(old).items():
        setattr(param, k, v)
    for module, key in slots.get(id(old), ()):
        if module._parameters.get(key) is old:
            module._parameters[key] = param
    return param


# --- the placements ------------------------------------------------------------------------------

class _Flat:
    """ZeRO-1/2: one flat buffer per optimizer group, of the parameters the release keeps in it
    (trainable ones; zero-element ones left out from 0.19.8), every rank holding the whole
    buffer; the parameters become views into it; the rest is read whole into its own storage."""

    kind = "flat"  # the library's placement (loader.h's LoadPlacement)

    def __init__(self, round_robin: bool, alignment_factor: int, param_align_bytes: int,
                 target: torch.device):
        self.round_robin = round_robin
        self.alignment_factor = alignment_factor
        self.param_align_bytes = param_align_bytes
        self.target = target

    def buffers(self, groups, model, rules):
        """One buffer per group, of the parameters the optimizer keeps. An empty group has an
        empty one, loaded as nothing, with no FlatGroup: DeepSpeed's engine drops a client
        optimizer's empty groups before its ZeRO-1/2 optimizer numbers them, so the FlatGroups
        follow its ``bit16_groups``. A group of parameters none of which it keeps is refused:
        DeepSpeed keeps that group, and its ZeRO-1/2 optimizer fails on it (it reads the
        group's first kept parameter)."""
        out = []
        for k, group in enumerate(groups):
            kept, _ = select(group, rules, trainable_only=True)
            if group and not kept:
                raise ValueError(f"param_groups[{k}] holds {len(group)} parameter(s), none of "
                                 "which the optimizer keeps (frozen, or without elements "
                                 "under this release's rules): DeepSpeed's ZeRO-1/2 optimizer "
                                 "fails on such a group; leave it out")
            out.append([group[i] for i in kept])
        return out

    def layout_options(self, dp: int, dtype: torch.dtype):
        return layout_options(dp, self.round_robin, self.alignment_factor, dtype,
                              self.param_align_bytes)

    def finish(self, model, loaded, prep, rank: int, dp: int, master_dtype, engine=None) -> list:
        out = []
        slots = _parameter_slots(model)
        loaded_groups = [[prep.names[id(p)] for p in members]
                         for members, _, flat, _, _ in loaded if members]
        for members, report, flat_bytes, master_bytes, lay in loaded:
            if not members:
                continue
            dtype = TORCH_DTYPES[lay["dtype"]]
            flat = flat_bytes[: lay["flat_bytes"]].view(dtype)
            partition, master = partition_and_master(flat, lay, rank, master_bytes,
                                                     master_dtype)
            entry = LoadedBuffer(flat=weakref.ref(flat), numel=flat.numel(),
                                 names=[prep.names[id(p)] for p in members],
                                 index=len(out), groups=loaded_groups,
                                 round_robin=bool(self.round_robin), model=weakref.ref(model))
            if master_bytes is not None and engine is not None and partition.numel():
                entry.master = master
                entry.master_offset = partition.storage_offset() - flat.storage_offset()
                entry.master_sum = engine.checksum(partition.data_ptr(),
                                                   partition.numel() * partition.element_size())
            _register(flat, entry)
            params = [_replace_everywhere(slots, p, flat[off: off + p.numel()].view(p.shape))
                      for p, off in zip(members, lay["offsets"])]
            out.append(FlatGroup(flat=flat, partition=partition, master=master,
                                 tier=report["tier"], layout=lay, report=report, params=params,
                                 rank=rank, dp=dp))
        for name, p, value in prep.params:
            _replace_everywhere(slots, p, value.to(self.target))
        for name, value in prep.buffers:
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            module._buffers[attr] = value.to(self.target)
        return out


# --- the load ----------------------------------------------------------------------------------


@dataclass
class _Prepared:
    """Everything this rank found before the first collective: each buffer's parameters and
    their checkpoint tensors, and every other tensor of the model already read (on the host, not
    yet in the model)."""

    ck: "_C.Checkpoint"
    buffers_params: List[List[torch.nn.Parameter]]
    load_params: List[List["_C.LoadParam"]]
    dtypes: List[torch.dtype]
    names: Dict[int, str] = field(default_factory=dict)  # every parameter's name, by its id
    params: List[Tuple[str, torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    buffers: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    # What the ranks compare besides each buffer's shapes: every parameter's name and sources,
    # and every tensor outside the buffers (name, shape, dtype).
    entries: List[str] = field(default_factory=list)


def _prepare(model, checkpoint, placement, param_groups, dtype: Optional[torch.dtype], rules,
             strict: bool) -> _Prepared:
    """Every check of this rank and every read outside the buffers, before the ranks meet:
    whatever fails here is this rank's own error, which the first collective carries to the
    others."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model is a {type(model).__name__}: expected a torch.nn.Module")
    ck = checkpoint_of(checkpoint)

    names_rules = _hf_names.converters(model)
    aliases: Dict[int, List[str]] = {}
    by_id: Dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        by_id[id(p)] = p
    used: set = set()
    untie_differing(model, aliases, by_id, names_rules, ck, dtype, used)

    groups = _groups_of(model, param_groups)
    grouped = set()
    for g in groups:
        for p in g:
            if id(p) not in aliases:
                raise ValueError("a parameter of param_groups is not one of the model's")
            if id(p) in grouped:
                raise ValueError(f"parameter {aliases[id(p)][0]!r} is in two groups")
            grouped.add(id(p))

    # Every parameter's checkpoint tensors, found before anything is read.
    missing = []
    sources: Dict[int, Tuple[List[str], List[Shape]]] = {}
    for name, p in model.named_parameters():
        src = sources_of(aliases[id(p)], p.shape, names_rules, ck)
        if src is None:
            missing.append(name)
            continue
        sources[id(p)] = src
        used.update(src[0])
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ValueError(f"{ck.path} holds no tensor for {len(missing)} parameter(s) of the "
                         f"model: {shown}")
    buffers = []
    for name, b in model.named_buffers():
        stored = stored_name(name, names_rules, ck)
        if stored is not None:
            buffers.append((name, b, stored))
            used.add(stored)
        elif strict and b.device.type == "meta":
            raise ValueError(f"buffer {name!r} is on the meta device and {ck.path} does not "
                             "hold it")

    # The placement's buffers, each of one dtype.
    out = _Prepared(ck=ck, buffers_params=[], load_params=[], dtypes=[],
                    names={pid: a[0] for pid, a in aliases.items()})
    in_buffers = set()
    for k, members in enumerate(placement.buffers(groups, model, rules)):
        kinds = {dtype or p.dtype for p in members}
        if len(kinds) > 1:
            raise ValueError(f"group {k} mixes dtypes {sorted(map(str, kinds))}; pass dtype= "
                             "or split the group")
        gdtype = kinds.pop() if kinds else (dtype or torch.bfloat16)
        if gdtype not in DTYPES:
            raise TypeError(f"group {k} is {gdtype}: zeroflat loads bfloat16, float16 and "
                            "float32 parameters")
        params = []
        for p in members:
            srcs, shapes = sources[id(p)]
            name = out.names[id(p)]
            params.append(_C.LoadParam(name=name, shape=list(p.shape), sources=srcs,
                                       source_shapes=shapes))
            out.entries.append(f"buffer {k} {dtype_text(gdtype)}: {name} {list(p.shape)} <- "
                               f"{','.join(srcs)}")
        in_buffers.update(id(p) for p in members)
        out.buffers_params.append(list(members))
        out.load_params.append(params)
        out.dtypes.append(gdtype)

    # Everything else, read whole now (on the host), so that a failure is this rank's own.
    for name, p in model.named_parameters():
        if id(p) in in_buffers:
            continue
        want = dtype or p.dtype
        if want not in DTYPES:
            raise TypeError(f"parameter {name!r} is {want}: zeroflat loads bfloat16, float16 "
                            "and float32 parameters")
        srcs, shapes = sources[id(p)]
        out.params.append((name, p, read_whole(ck, name, srcs, shapes, p.shape, want)))
        out.entries.append(f"parameter {name} {list(p.shape)} {dtype_text(want)}")
    for name, b, stored in buffers:
        host = read_whole(ck, name, [stored], [list(b.shape)], b.shape,
                           b.dtype if b.dtype in DTYPES else None, raw_dtype=b.dtype)
        out.buffers.append((name, host))
        out.entries.append(f"buffer {name} {list(host.shape)} {host.dtype}")

    unused = [t.name for t in ck.tensors() if t.name not in used]
    if unused:
        log.warning("zeroflat: %d tensor(s) of %s are not the model's: %s%s", len(unused),
                    ck.path, ", ".join(unused[:5]), ", ..." if len(unused) > 5 else "")
    return out


def dtype_text(dtype: torch.dtype) -> str:
    return DTYPES.get(dtype, str(dtype))


def engine_and_comm(target: torch.device, threads: Optional[int], dp: int, process_group,
                    host_memory: Optional[str] = None):
    """The loader's engine on ``target`` (its thread count; its host buffers from
    ``host_memory`` unless ZEROFLAT_HOST_MEMORY says, as ``_C.TorchDevice`` takes it) and the
    collectives over ``process_group``
    (None for one process), with this rank."""
    nthreads = engine_threads(threads, dp)
    engine = _C.TorchDevice(str(target), nthreads, host_memory)
    if process_group is None:
        return engine, nthreads, None, 0
    comm = TorchComm(process_group, engine, comm_device(process_group, target))
    return engine, nthreads, comm, comm.rank


def call_loader(placement: "_C.LoadPlacement", engine, comm, ck, params, options,
                local_error: Optional[BaseException], what: str):
    """The library's one load (``_C.load``) of ``params`` placed as ``placement`` says, a
    collective call: this rank's own error (``local_error``, which ``options`` carries to the
    others) raised as it was found; a collective that failed, in whichever step, as CommError in
    zeroflat's words with the process group's own error chained."""
    try:
        return _C.load(engine, comm, ck, params, options, placement)
    except InvalidArgument:
        if local_error is not None:
            raise local_error from None  # this rank's own error, as it was found
        raise
    except Error as e:
        failure = comm.failure if comm is not None else None
        if failure is None and not isinstance(e, CommError):
            raise
        raise CommError(f"{what}: {e}") from (failure or e)


class Load:
    """One load of the loop (run_loads): where its parameters go (a ``_C.LoadPlacement``), the
    parameters, ``configure(options)`` (what its FlattenOptions take besides the loop's: the
    layout, a master, checks; an error raised there is this rank's, agreed with the others),
    ``must_match`` (what every rank must hold identically for it), ``into`` (a tensor of the
    caller's the load reads straight into, or None), ``what`` (the words of a failed
    collective), ``infeasible`` (the words of a plan that does not fit, ``{reason}`` the
    planner's), ``notes`` (entries added to its report) and ``source`` (its checkpoint, where
    not the loop's)."""

    __slots__ = ("placement", "params", "configure", "must_match", "into", "what", "infeasible",
                 "notes", "source")

    def __init__(self, placement: "_C.LoadPlacement", params: Sequence[Any], *,
                 configure: Optional[Callable[["_C.FlattenOptions"], None]] = None,
                 must_match: Sequence[str] = (), into: Optional[torch.Tensor] = None,
                 what: str = "loading", infeasible: str = "{reason}",
                 notes: Optional[Dict[str, Any]] = None, source: Any = None):
        self.placement, self.params, self.configure = placement, list(params), configure
        self.must_match, self.into, self.what = list(must_match), into, what
        self.infeasible, self.notes, self.source = infeasible, dict(notes or {}), source


def run_loads(loads: Sequence[Load], *, engine, comm, ck, threads: int, target: torch.device,
              counts, cold: bool = False, copies: str = "sampled",
              local_error: Optional[BaseException] = None, entries: Sequence[str] = (),
              after: Optional[Callable[[int, Any, Any, Any], None]] = None) -> List[tuple]:
    """The one load loop, for every placement and caller (ZeRO-1/2's flat buffers, ZeRO-3's
    partitions, FSDP2's shards, a resume's buffers): one library load per ``Load``, in order,
    and at least one (an empty flat one when there is none), collective over ``comm`` (None for
    one process). The first carries ``local_error`` (this rank's, raised on every rank at the
    loader's agreement) and ``entries`` (what the whole call must hold identically), so that
    every rank raises at the same point; a later load with no parameters is skipped on every
    rank alike. ``after(k, report, buffer, lay)`` runs as each load returns (an all-gather
    started beside the next read). Returns (report, buffer, master, lay) per load, Nones for
    one skipped; a plan that does not fit is NoFeasiblePlan in the load's words."""
    loads = list(loads) or [Load(_C.LoadPlacement("flat"), [])]
    out: List[tuple] = []
    for k, load in enumerate(loads):
        if k > 0 and not load.params:
            out.append((None, None, None, None))
            continue
        options = _C.FlattenOptions(layout=_C.LayoutOptions(dp=comm.size if comm else 1),
                                    threads=threads, master=False)
        options.progress = counts
        try:
            options.cold = bool(cold)
            options.copies = copies
            framework_memory(options, target)
            if load.configure is not None:
                load.configure(options)
        except Exception as e:  # noqa: BLE001 - a bad value is this rank's own error, agreed
            local_error = local_error or e
        if local_error is not None:
            options.local_error = f"{type(local_error).__name__}: {local_error}"
        options.must_match = load.must_match + (list(entries) if k == 0 else [])
        if load.into is not None:
            engine.adopt(load.into)
        try:
            report, buffer, master, lay = call_loader(
                load.placement, engine, comm, ck if load.source is None else load.source,
                load.params, options, local_error, load.what)
        finally:
            if load.into is not None:
                engine.adopt(None)
        report.update(load.notes)
        if report["outcome"] == "infeasible":
            # Not str.format: the words may hold a name from a file, braces and all.
            raise NoFeasiblePlan(load.infeasible.replace("{reason}", str(report["reason"])),
                                 report)
        if after is not None:
            after(k, report, buffer, lay)
        out.append((report, buffer, master, lay))
    return out


def check_load_options(*, cold, round_robin, strict, master_dtype, threads, margin_bytes,
                       alignment_factor, param_align_bytes, dtype, deepspeed, read_plan, copies,
                       storage_bytes_per_second) -> Optional["_C.ReleaseRules"]:
    """Every option of ``load_param_groups`` that can be checked alone, checked the same way
    whatever the placement (the library's own parsers for read_plan and copies); returns the
    release's rules. Raises TypeError / ValueError naming the option."""
    bool_option("cold", cold)
    bool_option("round_robin", round_robin)
    bool_option("strict", strict)
    check_options("auto", master_dtype, threads, margin_bytes, alignment_factor,
                  param_align_bytes)
    if dtype is not None:
        dtype_name(dtype, "dtype")
    probe = _C.FlattenOptions()
    probe.read_plan = read_plan
    if not isinstance(copies, str):
        raise ValueError(f"copies={copies!r}: expected 'sampled', 'full' or 'off'")
    probe.copies = copies
    if (isinstance(storage_bytes_per_second, bool)
            or not isinstance(storage_bytes_per_second, (int, float))
            or not storage_bytes_per_second >= 0 or storage_bytes_per_second == float("inf")):
        raise ValueError(f"storage_bytes_per_second {storage_bytes_per_second!r}: expected a "
                         "finite number of bytes per second, >= 0 (0: each host's own storage)")
    return release_rules(deepspeed)


def load_param_groups(model: torch.nn.Module, checkpoint: Union[str, os.PathLike, "_C.Checkpoint"],
                      process_group=None, *,
                      param_groups: Union[None, Iterable[Any],
                                          Callable[[torch.nn.Module], Iterable[Any]]] = None,
                      dtype: Optional[torch.dtype] = None, device: Optional[Any] = None,
                      round_robin: bool = False, alignment_factor: int = 2,
                      param_align_bytes: int = 0, deepspeed: Optional[str] = "installed",
                      master_dtype: Optional[torch.dtype] = torch.float32,
                      margin_bytes: Optional[int] = None, threads: Optional[int] = None,
                      cold: bool = False, strict: bool = True,
                      read_plan: Optional[str] = None, copies: str = "sampled",
                      storage_bytes_per_second: float = 0, zero3: Any = None,
                      progress: Optional[Callable[["Progress"], None]] = None) -> list:
    """Materializes every parameter of ``model`` from a safetensors checkpoint into the buffers
    DeepSpeed's optimizer keeps, and returns one FlatGroup per buffer that has parameters (under
    ZeRO-1/2 one per group in the groups' order, but for an empty group, which has none:
    DeepSpeed's engine drops an empty group from the optimizer, so the list follows the groups
    its ZeRO optimizer numbers; a group none of whose parameters the optimizer keeps is a
    ValueError, as DeepSpeed's optimizer fails on it).

    ZeRO-1/2 (``zero3`` None, the default): the trainable parameters of each optimizer group
    become views into that group's flat buffer in DeepSpeed's layout, each rank reading its
    partition's bytes and one all-gather completing the buffer (or, for ranks of one host, each
    reading the whole buffer from the page cache); the rest (frozen parameters, zero-element
    ones a release leaves out, persistent buffers) into their own storage, read whole.

    ZeRO-3 (``zero3``: a DeepSpeed config with ``zero_optimization.stage`` 3, as a dict, a path
    to its JSON file or an HfDeepSpeedConfig; or the ``deepspeed.zero.Init`` that
    ``zeroflat.meta_parameters(zero3=...)`` yielded): each rank reads only its own partition of
    every parameter (``[r*p, (r+1)*p)`` of the flattened parameter, p = ceil(numel / world),
    the last rank's padding zero) into two buffers: the optimizer groups' trainable parameters,
    groups in order, in the layout of the Stage 3 optimizer's ``lp_param_buffer``; and every
    other parameter. Every parameter becomes the ZeRO-3 parameter ``zero.Init`` would have made
    (its ``ds_id`` in the order the model was built under ``meta_parameters()``, ``ds_tensor``
    its view of the buffer, the data an empty placeholder); their dtype is ``zero.Init``'s, and
    they live on its device (the ``offload_param`` device when there is one); the partition
    group is ``zero.Init``'s (``process_group``: its ``data_parallel_group`` when a config is
    given). hpZ, ``offload_param`` to nvme and quantized weights are refused from the config
    (NotImplementedError) before ``zero.Init`` is made. The FlatGroup's ``flat`` and
    ``partition`` are the rank's buffer, its layout's offsets and numels the partitions'.

    ``model`` is typically built without memory (parameters on the ``meta`` device:
    ``zeroflat.meta_parameters()``, or ``zeroflat.hf.from_pretrained``). ``param_groups``: the
    groups the optimizer will get (``optimizer.param_groups``-like dicts or lists, of the model's
    parameters or their names, or a function of the model returning them); default one group of
    every parameter. ``dtype``: the parameters' dtype (default: theirs; under ZeRO-3,
    ``zero.Init``'s), converted from the checkpoint's as torch rounds. ``device``: where they live
    (default: the current CUDA device if there is one, else the CPU; under ZeRO-3,
    ``zero.Init``'s). The layout rules are ``deepspeed``'s (the installed release by default, else
    the newest tested one), as ``flatten_param_group``'s; ``round_robin``, ``alignment_factor``
    and ``param_align_bytes`` shape ZeRO-1/2's buffers (under ZeRO-3 only their defaults are
    accepted). ``master_dtype``: this rank's partition up-cast to it (fp32: the library's
    master), or None.

    Collective over ``process_group``: every error a rank finds before the ranks meet (a bad
    argument, a path or shard it cannot open, a tensor it lacks or whose shape differs, a read
    outside the buffers that fails) is raised on every rank at their first collective, this rank
    with its own exception, the others with InvalidArgument naming it; the ranks also compare
    every name, source and shape, frozen parameters and buffers included, and an error names the
    first that differs and what each side has. A parameter whose name (or, for tied weights, any
    of its names; for fused parameters such as stacked MoE experts, Transformers' own rule for
    the tensors they stack, each of the shape the rule expects) the checkpoint does not hold is
    ValueError naming it; with ``strict``, so is a buffer the model has on ``meta`` that the
    checkpoint does not hold. Tensors of the checkpoint the model does not use are logged.

    ``read_plan``: who reads what (``"load"``: each rank its slice, then one all-gather;
    ``"load-whole"``: each rank the whole buffer from its host's page cache, no all-gather;
    ``"load-partitions"``: ZeRO-3's only one; None: the fastest by the cost model, from the hosts
    (world size over ``LOCAL_WORLD_SIZE``) and ``storage_bytes_per_second``, the bandwidth of
    storage the hosts share, 0 for storage of their own). ``copies``: after reading, how the
    ranks compare their copies of the checkpoint (``"sampled"``, ``"full"``, ``"off"``; their
    headers are always compared).

    Progress: a load that runs longer than 10 s (``ZEROFLAT_PROGRESS_SECONDS``) logs each rank's
    bytes read, rate and time left at INFO on the ``zeroflat`` logger at that pace, and calls
    ``progress`` (a callable) with a ``zeroflat.Progress`` each time, from a thread of its own,
    and once more at the end (``finished``)."""
    placement = None
    local_error: Optional[BaseException] = None
    prep: Optional[_Prepared] = None
    rules = None
    try:
        rules = check_load_options(cold=cold, round_robin=round_robin, strict=strict,
                                   master_dtype=master_dtype, threads=threads,
                                   margin_bytes=margin_bytes, alignment_factor=alignment_factor,
                                   param_align_bytes=param_align_bytes, dtype=dtype,
                                   deepspeed=deepspeed, read_plan=read_plan, copies=copies,
                                   storage_bytes_per_second=storage_bytes_per_second)
        check_callback(progress)
        zero3 = _zero3.resolve(zero3)
        if zero3 is not None:
            placement = _zero3.Partitions(zero3, process_group)
            process_group = placement.process_group
            if dtype is not None and dtype != placement.dtype:
                raise ValueError(f"dtype={dtype} does not apply under ZeRO-3: the parameters "
                                 f"take zero.Init's dtype ({placement.dtype})")
            if device is not None and target_of(device) != placement.target:
                raise ValueError(f"device={device!r} does not apply under ZeRO-3: the partitions "
                                 f"live on zero.Init's device ({placement.target})")
            for name, value, default in (("round_robin", round_robin, False),
                                         ("alignment_factor", alignment_factor, 2),
                                         ("param_align_bytes", param_align_bytes, 0)):
                if value != default:
                    raise ValueError(f"{name}={value!r} does not apply under ZeRO-3: each "
                                     "parameter is partitioned on its own, padded to the world")
            dtype = placement.dtype
        else:
            if rules is not None:
                check_release_options(layout_options(1, round_robin, alignment_factor,
                                                     torch.bfloat16, param_align_bytes), rules)
            placement = _Flat(round_robin, alignment_factor, param_align_bytes, target_of(device))
        prep = _prepare(model, checkpoint, placement, param_groups, dtype, rules, strict)
    except Exception as e:  # noqa: BLE001 - whatever it is, every rank must learn of it
        local_error = e
    dp = dist.get_world_size(process_group) if process_group is not None else 1
    if local_error is not None and dp == 1:
        raise local_error

    ok = prep is not None
    target = placement.target if placement is not None else torch.device("cpu")
    engine, nthreads, comm, rank = engine_and_comm(target, threads if ok else 1, dp,
                                                   process_group)
    path = prep.ck.path if ok else path_text(checkpoint)
    where = _C.LoadPlacement(placement.kind if placement is not None else "flat")

    # One load per buffer (the one loop, run_loads).
    calls = max(1, len(prep.load_params)) if ok else 1
    loads = []
    for k in range(calls):
        members = prep.buffers_params[k] if ok and k < len(prep.buffers_params) else []
        params = prep.load_params[k] if members else []

        def configure(options, k=k, params=bool(params)):
            options.read_plan = read_plan
            options.storage_bytes_per_second = float(storage_bytes_per_second)
            if ok and k < len(prep.dtypes):
                options.layout = placement.layout_options(dp, prep.dtypes[k])
                options.margin_bytes = None if margin_bytes is None else int(margin_bytes)
                options.master = params and master_dtype == torch.float32
                if isinstance(placement, _Flat):
                    options.release = rules
        loads.append(Load(
            where, params, configure=configure,
            must_match=[f"buffer {k} of {calls}", f"device {target.type}",
                        f"master {master_dtype}",
                        f"deepspeed rules {rules.rules if ok and rules else None}",
                        f"placement {where.kind}"],
            what=f"loading buffer {k} of {path}",
            infeasible=f"buffer {k} does not fit on {target}: {{reason}}; nothing was read",
            notes={"dp": dp, "deepspeed": rules.to_dict() if ok and rules else None}))
    watch = Watch(f"load {path}", rank, dp, progress if ok else None)
    with watch:
        results = run_loads(loads, engine=engine, comm=comm if dp > 1 else None,
                            ck=prep.ck if ok else None, threads=nthreads, target=target,
                            counts=watch.counts, cold=cold, copies=copies,
                            local_error=local_error, entries=prep.entries if ok else ())
    loaded = []
    for k, (report, flat_bytes, master_bytes, lay) in enumerate(results):
        members = prep.buffers_params[k] if k < len(prep.buffers_params) else []
        loaded.append((members, report, flat_bytes, master_bytes, lay))
    assert local_error is None and prep is not None
    # Every rank has its buffers: the model's parameters become their views.
    return placement.finish(model, loaded, prep, rank, dp, master_dtype, engine)
