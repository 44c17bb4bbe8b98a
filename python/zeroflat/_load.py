"""zeroflat.load_param_groups: a model's parameters built straight from a safetensors checkpoint
into flat buffers in DeepSpeed's ZeRO-1/2 layout, each rank reading only its partition."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _C

log = logging.getLogger("zeroflat")

# Flat buffers the loader built, by their storage's address: the DeepSpeed drop-in adopts one
# when a group's parameters are exactly its views (see deepspeed.py). Weak: a buffer nothing uses
# any more is forgotten.
_LOADED: Dict[int, Tuple["weakref.ref[torch.Tensor]", int]] = {}


def loaded_buffer(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The flat buffer the loader built that every tensor of ``tensors`` is a view into, or None."""
    if not tensors:
        return None
    try:
        ptr = tensors[0].untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    entry = _LOADED.get(ptr)
    if entry is None:
        return None
    flat = entry[0]()
    if flat is None or flat.untyped_storage().data_ptr() != ptr:
        _LOADED.pop(ptr, None)
        return None
    return flat


def _register(flat: torch.Tensor) -> None:
    for ptr in [p for p, (ref, _) in _LOADED.items() if ref() is None]:
        del _LOADED[ptr]
    _LOADED[flat.untyped_storage().data_ptr()] = (weakref.ref(flat), flat.numel())


@contextlib.contextmanager
def meta_parameters():
    """While a model is constructed inside, every parameter it registers goes to the ``meta``
    device (no memory, no initialization cost); buffers stay real, so that values computed at
    construction (rotary frequencies) are kept."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            extra = {k: v for k, v in vars(p).items()}
            moved = type(p)(p.to("meta"), requires_grad=p.requires_grad)
            for k, v in extra.items():
                setattr(moved, k, v)
            module._parameters[name] = moved

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _checkpoint(checkpoint) -> "_C.Checkpoint":
    if isinstance(checkpoint, _C.Checkpoint):
        return checkpoint
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint is {checkpoint!r}: expected a path to a .safetensors file "
                        "or a directory of them")
    return _C.Checkpoint(os.fspath(checkpoint))


# --- names: model parameters to checkpoint tensors ------------------------------------------------

def _converters(model) -> list:
    """Transformers' own rules for the model's checkpoints: tensors renamed between the
    checkpoint and the model (a module that moved), and tensors the model fuses (the experts of a
    MoE layer stored one by one, held as one stacked parameter), when it has them. The legacy
    rules are included: they only add names to look for."""
    try:
        from transformers import conversion_mapping as cm
    except ImportError:
        return []
    try:
        return list(cm.get_model_conversion_mapping(model, add_legacy=True) or [])
    except TypeError:
        try:
            return list(cm.get_model_conversion_mapping(model) or [])
        except Exception:  # noqa: BLE001 - another API: no rules known
            return []
    except Exception:  # noqa: BLE001 - an older or newer API: no rules known
        try:
            return list(cm.get_checkpoint_conversion_mapping(model.config.model_type) or [])
        except Exception:  # noqa: BLE001
            return []


def _op(op) -> Tuple[str, Optional[int]]:
    return type(op).__name__, getattr(op, "dim", None)


def _is_renaming(rule) -> bool:
    return not list(getattr(rule, "operations", []) or [])


_REGEX = set("[]()*+?{}|$\\")


def _literal(pattern: str) -> Optional[Tuple[str, bool]]:
    """A renaming pattern as (its text, anchored at the start of the name), or None when it is a
    regular expression beyond escaped dots and a leading ``^`` (such a rule is not undone)."""
    anchored = pattern.startswith("^")
    text = (pattern[1:] if anchored else pattern).replace("\\.", ".")
    if not text or any(c in _REGEX for c in text):
        return None
    return text, anchored


def _checkpoint_names(name: str, rules: list, limit: int = 64) -> List[str]:
    """``name``, then the names Transformers' renaming rules would have read it from: each rule
    (checkpoint patterns -> model pattern) undone on every name found so far, in order, so that
    a name renamed by several rules is found too."""
    out = [name]
    for rule in rules:
        if not _is_renaming(rule):
            continue
        targets = [_literal(t) for t in getattr(rule, "target_patterns", []) or []]
        sources = [_literal(t) for t in getattr(rule, "source_patterns", []) or []]
        if len(targets) != 1 or targets[0] is None or not sources or None in sources:
            continue
        (target, target_anchored), found = targets[0], []
        for cand in out:
            at = cand.find(target)
            if at < 0 or (target_anchored and at != 0):
                continue
            for source, source_anchored in sources:
                if source_anchored and at != 0:
                    continue
                found.append(cand[:at] + source + cand[at + len(target):])
        for cand in found:
            if cand not in out and len(out) < limit:
                out.append(cand)
    return out


def _suffix(name: str, pattern: str) -> Optional[str]:
    """The part of ``name`` before ``pattern`` when the name ends with it (at a dot), else None."""
    bare = pattern.lstrip(".")
    if name == bare:
        return ""
    if bare and name.endswith("." + bare):
        return name[: len(name) - len(bare)]
    return None


def _fused_sources(name: str, shape: torch.Size, converters: list,
                   ck: "_C.Checkpoint") -> Optional[List[str]]:
    """The checkpoint tensors a fused parameter stacks, in the order of its elements, or None
    when no rule names this parameter. Only rules that stack whole tensors are read this way:
    stacking along the first dimension (MergeModulelist(dim=0)), then optionally concatenating
    along the next (Concatenate(dim=1)), or concatenating along the first (Concatenate(dim=0)).
    A rule that transposes, splits or permutes is NotImplementedError, naming the parameter."""
    for conv in converters:
        if _is_renaming(conv):
            continue
        targets = list(getattr(conv, "target_patterns", []) or [])
        sources = list(getattr(conv, "source_patterns", []) or [])
        ops = [_op(o) for o in getattr(conv, "operations", []) or []]
        if len(targets) != 1 or not sources or "*" in targets[0]:
            continue
        prefix = _suffix(name, targets[0])
        if prefix is None:
            continue
        sources = [src.lstrip(".") for src in sources]
        if ops == [("MergeModulelist", 0)] or ops == [("MergeModulelist", 0), ("Concatenate", 1)]:
            count = shape[0] if len(shape) else 0
            out = [prefix + src.replace("*", str(e)) for e in range(count) for src in sources]
        elif ops == [("Concatenate", 0)]:
            out = [prefix + src for src in sources]
        else:
            raise NotImplementedError(
                f"parameter {name!r} is built from {sources} by {ops}: zeroflat loads "
                "parameters that stack or concatenate whole checkpoint tensors only")
        if all(ck.has(s) for s in out):
            return out
    return None


def _sources_of(names: List[str], shape: torch.Size, converters: list,
                ck: "_C.Checkpoint") -> Optional[List[str]]:
    """The checkpoint tensors holding a parameter known by these names (tied weights have
    several; HF saves one of them), each also under the names Transformers' renaming rules give
    it, or None."""
    candidates = [c for n in names for c in _checkpoint_names(n, converters)]
    for n in candidates:
        if ck.has(n):
            return [n]
    for n in candidates:
        fused = _fused_sources(n, shape, converters, ck)
        if fused is not None:
            return fused
    return None


# --- the load ------------------------------------------------------------------------------

def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _groups_of(model: torch.nn.Module, param_groups) -> List[List[torch.nn.Parameter]]:
    """The optimizer's groups as lists of the model's parameters."""
    by_name = dict(model.named_parameters())
    if param_groups is None:
        return [list(model.parameters())]
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


def _replace_everywhere(model: torch.nn.Module, old: torch.nn.Parameter,
                        new: torch.Tensor) -> torch.nn.Parameter:
    """Every module slot holding ``old`` now holds one new Parameter over ``new`` (so tied
    weights stay tied). A parameter off the meta device keeps its object and takes the data."""
    if old.device.type != "meta" and old.dtype == new.dtype:
        old.data = new
        return old
    param = torch.nn.Parameter(new, requires_grad=old.requires_grad)
    for k, v in vars(old).items():
        setattr(param, k, v)
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is old:
                module._parameters[key] = param
    return param


def load_param_groups(model: torch.nn.Module, checkpoint: Union[str, os.PathLike, "_C.Checkpoint"],
                      process_group=None, *, param_groups: Optional[Iterable[Any]] = None,
                      dtype: Optional[torch.dtype] = None, device: Optional[Any] = None,
                      round_robin: bool = False, alignment_factor: int = 2,
                      param_align_bytes: int = 0, deepspeed: Optional[str] = "installed",
                      master_dtype: Optional[torch.dtype] = torch.float32,
                      margin_bytes: Optional[int] = None, threads: Optional[int] = None,
                      cold: bool = False, strict: bool = True) -> list:
    """Materializes every parameter of ``model`` from a safetensors checkpoint: the trainable
    ones of each optimizer group as views into that group's flat buffer in DeepSpeed's
    ZeRO-1/2 layout, each rank reading only its partition's bytes and one all-gather
    completing the buffer; the rest (frozen parameters, zero-element ones a release leaves out,
    persistent buffers) into their own storage, read whole. Returns one FlatGroup per group.

    ``model`` is typically built without memory (parameters on the ``meta`` device:
    ``zeroflat.meta_parameters()``, or ``zeroflat.hf.from_pretrained``). ``param_groups``: the
    groups the optimizer will get (``optimizer.param_groups``-like dicts or lists, of the model's
    parameters or their names); default one group of every parameter. ``dtype``: the parameters'
    dtype (default: theirs), converted from the checkpoint's as torch rounds. ``device``: where
    they live (default: the current CUDA device if there is one, else the CPU). The layout rules
    are ``deepspeed``'s (the installed release by default), as ``flatten_param_group``'s.

    A parameter whose name (or, for tied weights, any of its names; for fused parameters such as
    stacked MoE experts, Transformers' own rule for the tensors they stack) the checkpoint does
    not hold is ValueError naming it, on every rank, before anything is read; with ``strict``,
    so is a buffer the model has on ``meta`` that the checkpoint does not hold. Tensors of the
    checkpoint the model does not use are logged."""
    from . import FlatGroup, NoFeasiblePlan, _bool_option, _check_options, \
        _check_release_options, _dtype_name, _int_option, _release, _TorchComm, _comm_device, \
        layout, _DTYPES, _partition_and_master

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model is a {type(model).__name__}: expected a torch.nn.Module")
    ck = _checkpoint(checkpoint)
    round_robin = _bool_option("round_robin", round_robin)
    cold = _bool_option("cold", cold)
    strict = _bool_option("strict", strict)
    _check_options("auto", master_dtype, threads, margin_bytes, alignment_factor,
                   param_align_bytes)
    if dtype is not None:
        _dtype_name(dtype, "dtype")
    target = torch.device(device) if device is not None else _default_device()
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if target.type not in ("cpu", "cuda"):
        raise ValueError(f"device {target}: zeroflat loads onto cpu and cuda devices")
    release = _release(deepspeed)
    rules = _C.deepspeed_rules(release) if release is not None else None
    if rules is not None:
        _check_release_options(rules, alignment_factor, param_align_bytes)
    dp = dist.get_world_size(process_group) if process_group is not None else 1

    aliases: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    converters = _converters(model)
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
    used = set()
    missing = []
    sources: Dict[int, List[str]] = {}
    for name, p in model.named_parameters():
        src = _sources_of(aliases[id(p)], p.shape, converters, ck)
        if src is None:
            missing.append(name)
            continue
        sources[id(p)] = src
        used.update(src)
    local_error = ""
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8]) + (", ..." if len(missing) > 8 else "")
        local_error = (f"ValueError: {ck.path} holds no tensor for {len(missing)} parameter(s) "
                       f"of the model: {shown}")
    buffers = []
    for name, b in model.named_buffers():
        stored = next((c for c in _checkpoint_names(name, converters) if ck.has(c)), None)
        if stored is not None:
            buffers.append((name, b, stored))
            used.add(stored)
        elif strict and b.device.type == "meta" and not local_error:
            local_error = (f"ValueError: buffer {name!r} is on the meta device and {ck.path} "
                           "does not hold it")
    unused = [t[0] for t in ck.tensors() if t[0] not in used]
    if unused:
        log.warning("zeroflat: %d tensor(s) of %s are not the model's: %s%s", len(unused),
                    ck.path, ", ".join(unused[:5]), ", ..." if len(unused) > 5 else "")

    local = _C.local_ranks() or dp
    nthreads = int(threads or 0) or _C.default_threads(local)
    engine = _C.TorchDevice(str(target), nthreads)
    comm, rank = None, 0
    if process_group is not None:
        comm = _TorchComm(process_group, engine, _comm_device(process_group, target))
        rank = comm.rank

    out = []
    for gi, group in enumerate(groups):
        # DeepSpeed's group: trainable parameters; from 0.19.8 not the zero-element ones.
        members = [p for p in group if p.requires_grad]
        if rules is not None and rules["skips_zero_element"]:
            members = [p for p in members if p.numel() > 0]
        err = local_error
        gdtype = dtype
        if not err and members:
            kinds = {dtype or p.dtype for p in members}
            if len(kinds) > 1:
                err = (f"ValueError: group {gi} mixes dtypes {sorted(map(str, kinds))}; pass "
                       "dtype= or split the group")
            else:
                gdtype = kinds.pop()
                if gdtype not in _DTYPES:
                    err = (f"TypeError: group {gi} is {gdtype}: zeroflat loads bfloat16, float16 "
                           "and float32 parameters")
        if not members and not err:
            continue
        names = [aliases[id(p)][0] for p in members] if not err else []
        try:
            doc_text, flat_bytes, master_bytes = _C.load(
                engine, comm if (comm is not None and dp > 1) else None, ck, names,
                [list(p.shape) for p in members] if not err else [],
                [sources[id(p)] for p in members] if not err else [], dp, round_robin,
                int(alignment_factor), _DTYPES.get(gdtype, "bf16") if not err else "bf16",
                int(param_align_bytes), None if margin_bytes is None else int(margin_bytes),
                master_dtype == torch.float32 and not err, cold, nthreads,
                f"group {gi}, device {target.type}, master {master_dtype}, deepspeed rules "
                f"{rules['rules'] if rules else None}", err)
        except ValueError as e:
            if err:
                kind, _, text = err.partition(": ")
                raise (TypeError if kind == "TypeError" else ValueError)(text) from None
            raise
        report = json.loads(doc_text)
        report["dp"], report["rank"], report["deepspeed"] = dp, rank, rules
        if report["outcome"] == "infeasible":
            raise NoFeasiblePlan(f"group {gi} does not fit on {target}: {report['reason']}; "
                                 "nothing was read", report)
        lay = layout([p.numel() for p in members], dp, round_robin=round_robin,
                     alignment_factor=alignment_factor, dtype=gdtype,
                     param_align_bytes=param_align_bytes)
        flat = flat_bytes[: lay["flat_bytes"]].view(gdtype)
        _register(flat)
        params = []
        for p, off in zip(members, lay["offsets"]):
            params.append(_replace_everywhere(model, p, flat[off: off + p.numel()].view(p.shape)))
        partition, master = _partition_and_master(flat, lay, rank, master_bytes, master_dtype)
        out.append(FlatGroup(flat=flat, partition=partition, master=master, tier="load",
                             layout=lay, report=report, params=params, rank=rank, dp=dp))
    if local_error:  # no group reached the collective (all empty): still this rank's error
        kind, _, text = local_error.partition(": ")
        raise (TypeError if kind == "TypeError" else ValueError)(text)

    # Everything else: read whole into its own storage.
    info = {t[0]: t for t in ck.tensors()}
    in_buffers = {id(p) for fg in out for p in fg.params}
    for name, p in list(model.named_parameters()):
        if id(p) in in_buffers:
            continue
        want = dtype or p.dtype
        if want not in _DTYPES:
            raise TypeError(f"parameter {name!r} is {want}: zeroflat loads bfloat16, float16 "
                            "and float32 parameters")
        host = _read_whole(info, ck, name, sources[id(p)], p.shape, want)
        _replace_everywhere(model, p, host.to(target))
    for name, b, stored in buffers:
        host = _read_whole(info, ck, name, [stored], b.shape,
                           b.dtype if b.dtype in _DTYPES else None, raw_dtype=b.dtype)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        module._buffers[attr] = host.to(target)
    return out


def _read_whole(info: dict, ck: "_C.Checkpoint", what: str, names: List[str], shape,
                dtype: Optional[torch.dtype],
                raw_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The tensors named, read whole and concatenated, as a CPU tensor of ``shape`` (converted to
    ``dtype``, or, when it is None, the bytes as stored for a ``raw_dtype`` buffer)."""
    stored = [info[n] for n in names]
    count = 1
    for d in shape:
        count *= d
    if len(names) == 1 and list(stored[0][2]) != list(shape):
        raise ValueError(f"{what!r} is {list(shape)}, but tensor {names[0]!r} of {ck.path} is "
                         f"{list(stored[0][2])}")
    if dtype is None:
        out = torch.empty(shape, dtype=raw_dtype)
        if out.numel() * out.element_size() != stored[0][3]:
            raise ValueError(f"buffer {what!r} ({raw_dtype}) has {out.numel() * out.element_size()}"
                             f" bytes, but tensor {names[0]!r} of {ck.path} is {stored[0][1]} "
                             f"with {stored[0][3]}")
        ck.read(names[0], out.view(-1).view(torch.uint8))
        return out
    if any(t[4] is None for t in stored):
        raise ValueError(f"{what!r}: tensor {names[0]!r} of {ck.path} is {stored[0][1]}, which "
                         "zeroflat does not convert")
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    at = 0
    for t in stored:
        n = 1
        for d in t[2]:
            n *= d
        if at + n > count:
            raise ValueError(f"{what!r}: the tensors {names[:2]}... hold more than its {count} "
                             "elements")
        ck.read(t[0], flat[at: at + n])
        at += n
    if at != count:
        raise ValueError(f"{what!r}: the tensors {names[:2]}... hold {at} of its {count} elements")
    return out
