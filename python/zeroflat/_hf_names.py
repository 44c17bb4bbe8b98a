"""Which checkpoint tensors hold a model's parameter, as Hugging Face Transformers maps them: the
same name; a name Transformers' renaming rules read from an older one (Mixtral's
``block_sparse_moe``, ``LayerNorm.gamma``); or the several tensors Transformers' conversion rule
fuses into one parameter (a MoE layer's experts, stored one by one, stacked), each with the
shape that rule expects of it. Owned by ``zeroflat.hf``; the loader asks it for every model (a
model Transformers did not build has no rules, and only the same names count). Also what
Transformers computes after a load rather than reads (``init_unheld``)."""

from __future__ import annotations

import contextlib
import threading
from typing import List, Optional, Sequence, Tuple

Shape = List[int]
_SWAP = threading.Lock()


def _transformers_5() -> bool:
    """Whether the Transformers installed is 5 or later (it has the ``initialization`` module;
    4 has not)."""
    try:
        from transformers import initialization  # noqa: F401 - Transformers 5
    except ImportError:
        return False
    return True


def init_unheld(model) -> None:
    """What Transformers 5's ``from_pretrained`` does after the load for the tensors no file
    holds (non-persistent buffers: rotary and sinusoid tables): the model's own
    ``initialize_weights``, outside the dtype the model was built in, every tensor of the state
    dict marked as loaded first so that Transformers' guarded init functions skip them. A table
    that ``__init__`` computed in the model's dtype (GPT-J's ``embed_positions``, under bf16)
    comes out as Transformers' load gives it. Transformers 4 (no ``initialization`` module)
    keeps what ``__init__`` computed, and so is this left."""
    import torch

    if not _transformers_5():
        return
    initialize = getattr(model, "initialize_weights", None)
    if initialize is None:
        return
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            t._is_hf_initialized = True
        # A model built off the meta device had its init run in __init__, which marks every
        # module as done: Transformers' load builds on meta, where none is.
        for m in model.modules():
            m.__dict__.pop("_is_hf_initialized", None)
        initialize()


def computes_unheld(model) -> bool:
    """Whether ``init_unheld`` computes the model's non-persistent buffers (a Transformers 5
    model: its ``initialize_weights``)."""
    return _transformers_5() and callable(getattr(model, "initialize_weights", None))


def build(make):
    """The model ``make()`` builds, built as ``from_pretrained`` builds it: Transformers 4 turns
    its weight init off (``no_init_weights``: an ``_init_weights`` that assigns ``.data``, as
    Bamba's ``A_log``, cannot write into meta parameters, and the checkpoint's values replace
    whatever it would compute) and then ties the weights itself, which its ``post_init`` leaves
    to the load when init is off. Transformers 5 builds as it always does (``init_unheld`` runs
    its init after the load)."""
    if _transformers_5():
        return make()
    try:
        from transformers.modeling_utils import no_init_weights
    except ImportError:
        return make()
    with no_init_weights():
        model = make()
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
    return model


def keeps_tied(model) -> bool:
    """Whether tied weights stay tied when the checkpoint holds their names with different
    values: Transformers 4 ties them all the same (the input embedding's values, the other
    name's tensor unused); Transformers 5, and a model not of Transformers, leaves them untied
    (``_load.untie_differing``)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel) and not _transformers_5()


def converters(model) -> list:
    """Transformers' own rules for the model's checkpoints: tensors renamed between the
    checkpoint and the model (a module that moved), and tensors the model fuses (the experts of a
    MoE layer stored one by one, held as one stacked parameter), when it has them. The legacy
    rules are included: they only add names to look for. Transformers looks rules up by class
    name (GPT-NeoX's ``embed_out`` -> ``lm_head``); a model FSDP2 has sharded is asked as the
    classes it was built with (see ``_built_classes``)."""
    try:
        from transformers import conversion_mapping as cm
    except ImportError:
        return []
    with _built_classes(model):
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


@contextlib.contextmanager
def _built_classes(model):
    """FSDP2's ``fully_shard`` gives each module it shards a class of its own (``FSDP<Name>``,
    a subclass of ``FSDPModule`` and the module's class), under which Transformers finds none of
    the class's rules: for the block's length each such module has its own class back (the
    same object, only its ``__class__``), restored after whatever happens."""
    swapped = []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        FSDPModule = None
    _SWAP.acquire()  # one lookup at a time: another would see the classes half swapped
    try:
        if FSDPModule is not None:
            for m in model.modules():
                cls = type(m)
                if isinstance(m, FSDPModule):
                    base = next((b for b in cls.__bases__ if not issubclass(b, FSDPModule)),
                                None)
                    if base is not None:
                        swapped.append((m, cls))
                        m.__class__ = base
        yield
    finally:
        for m, cls in swapped:
            m.__class__ = cls
        _SWAP.release()


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


def checkpoint_names(name: str, rules: list, limit: int = 64) -> List[str]:
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


def _stored_shape(ck, name: str) -> Shape:
    return list(ck.find(name).shape)


def _concatenated(param: str, shape: Shape, ck, path: str, names: List[str], dim_of: str,
                  rule: str) -> List[Shape]:
    """The shapes of ``names``, tensors concatenated along their first dimension into ``shape``
    (the parameter's shape without what is stacked): each must be ``shape`` but in that first
    dimension, and their first dimensions must add up to ``shape[0]``."""
    out = []
    for n in names:
        stored = _stored_shape(ck, n)
        want = ([stored[0]] if stored else []) + list(shape[1:])
        if not shape or len(stored) != len(shape) or stored != want:
            expected = "[d" + "".join(f", {d}" for d in shape[1:]) + "]"
            raise ValueError(
                f"tensor {n!r} of {path} has shape {stored}, but parameter {param!r} "
                f"({dim_of}) takes it as {expected} ({rule}): a tensor stored transposed or "
                "reshaped would load as other values")
        out.append(want)
    if shape and sum(s[0] for s in out) != shape[0]:
        raise ValueError(
            f"tensors {names} of {path} hold {sum(s[0] for s in out)} rows between them, but "
            f"parameter {param!r} ({dim_of}) has {shape[0]} ({rule})")
    return out


def fused_sources(name: str, shape: Sequence[int], rules: list,
                  ck) -> Optional[Tuple[List[str], List[Shape]]]:
    """The checkpoint tensors a fused parameter stacks, in the order of its elements, with the
    shape the rule expects of each; or None when no rule names this parameter or the checkpoint
    lacks one of its tensors. Only rules that stack whole tensors are read this way: stacking
    along the first dimension (MergeModulelist(dim=0)), then optionally concatenating along the
    next (Concatenate(dim=1)), or concatenating along the first (Concatenate(dim=0)). A rule that
    transposes, splits or permutes is NotImplementedError, a tensor whose shape is not the one
    the rule expects (same size, other shape: stored transposed or flattened) ValueError, both
    naming the parameter."""
    shape = list(shape)
    for conv in rules:
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
        rule = f"Transformers' rule {[o for o, _ in ops]} of {sources}"
        if ops == [("MergeModulelist", 0)] or ops == [("MergeModulelist", 0), ("Concatenate", 1)]:
            count = shape[0] if shape else 0
            out = [prefix + src.replace("*", str(e)) for e in range(count) for src in sources]
        elif ops == [("Concatenate", 0)]:
            out = [prefix + src for src in sources]
        else:
            raise NotImplementedError(
                f"parameter {name!r} is built from {sources} by {ops}: zeroflat loads "
                "parameters that stack or concatenate whole checkpoint tensors only")
        if not all(ck.has(s) for s in out):
            continue
        path = ck.path
        if ops[0] == ("Concatenate", 0):
            return out, _concatenated(name, shape, ck, path, out, "concatenated", rule)
        # Stacked along a new first dimension: each expert's tensors make shape[1:].
        per = len(sources)
        shapes: List[Shape] = []
        for e in range(shape[0]):
            mine = out[e * per: (e + 1) * per]
            if per == 1:
                stored = _stored_shape(ck, mine[0])
                if stored != shape[1:]:
                    raise ValueError(
                        f"tensor {mine[0]!r} of {path} has shape {stored}, but parameter "
                        f"{name!r} {shape} stacks one {shape[1:]} per expert ({rule}): a "
                        "tensor stored transposed or reshaped would load as other values")
                shapes.append(stored)
            else:
                shapes += _concatenated(name, shape[1:], ck, path, mine, f"expert {e}", rule)
        return out, shapes
    return None
