"""What an FSDP2 load does to the model's own objects, beside the reads (``fsdp.load``): every
parameter object kept (a local tensor re-pointed to its loaded shard, a meta one swapped for
it), a model on the meta device given its shards' device and its non-persistent buffers, FSDP2's
own record of its parameters read where torch lets it be, and the optimizers that already hold
state for the parameters found; and how a model's names are found in a checkpoint (``finder``).
The FSDP2 modules' one internal module: what ``fsdp`` and ``_fsdp_pretrained`` share."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import _C, _hf_names
from ._load import stored_name


def dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch before 2.4
        return None
    return DTensor


def is_dtensor(t) -> bool:
    DTensor = dtensor_class()
    return DTensor is not None and isinstance(t, DTensor)


def hand_over(m: Any, local: torch.Tensor) -> None:
    """The shard (read or mapped) as the parameter's data, the parameter object kept: a
    materialized tensor's storage re-pointed to the shard (its local tensor the same object), a
    meta one swapped for the shard (``swap_tensors``: the object keeps its identity, now holding
    the shard). No second pass over the memory."""
    p = m.param_obj
    if not is_dtensor(p):  # a plain parameter on meta (a materialized one is copied into)
        torch.utils.swap_tensors(p, torch.nn.Parameter(local, requires_grad=p.requires_grad))
        return
    if p._local_tensor.is_meta:
        DTensor = dtensor_class()
        new = torch.nn.Parameter(
            DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                               stride=p.stride()),
            requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, new)
    else:
        p._local_tensor.set_(local)


def set_buffer(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    (model.get_submodule(owner) if owner else model)._buffers[attr] = value


def meta_unheld(model: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """(name, buffer) of the non-persistent buffers on the meta device: what no checkpoint holds
    and the model's own initialisation computes."""
    out = []
    for module_name, module in model.named_modules():
        for attr, b in module._buffers.items():
            if b is not None and b.is_meta and attr in module._non_persistent_buffers_set:
                out.append(((f"{module_name}.{attr}" if module_name else attr), b))
    return out


def compute_unheld(model: torch.nn.Module, prep: Any) -> None:
    """A model loaded from the meta device: its non-persistent buffers made on the shards' device
    and computed by the model's own initialisation (Transformers 5's initialize_weights, every
    loaded tensor marked as loaded first), as Transformers' own load from meta computes them."""
    if not prep.unheld:
        return
    for name, b in prep.unheld:
        set_buffer(model, name, torch.empty(b.shape, dtype=b.dtype, device=prep.device))
    _hf_names.init_unheld(model)


def fsdp_params(model: torch.nn.Module) -> Dict[int, Any]:
    """FSDP2's record of each parameter it manages (by the parameter's id), where the installed
    torch lets it be read: its device (the host under CPU offload) and sharded state."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return {}
    out: Dict[int, Any] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(state, "_fsdp_param_group", None)
            groups = [one] if one is not None else []
        for group in groups:
            for fp in group.fsdp_params:
                out[id(fp.sharded_param)] = fp
    return out


def reshard(model: torch.nn.Module) -> None:
    """FSDP2 modules left unsharded by a forward (``reshard_after_forward=False``) resharded, as
    the Trainer does before it builds its optimizer: the parameters are the sharded ones."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def target_device(p, mesh: Optional[Any], fsdp_param) -> torch.device:
    """Where a parameter on the meta device gets its shard: FSDP2's device for it (the host under
    CPU offload), else the mesh's (a CUDA mesh: the current device)."""
    if fsdp_param is not None:
        if getattr(fsdp_param, "offload_to_cpu", False):
            return torch.device("cpu")
        device = getattr(fsdp_param, "device", None)
        if isinstance(device, torch.device) and device.type != "meta":
            return device
    kind = mesh.mesh.device_type if mesh is not None else "cpu"
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def optimizers_with_state(by_id: Dict[int, torch.nn.Parameter]) -> List[str]:
    """Each optimizer alive that holds some of these parameters and has state for any of them,
    in words."""
    import gc

    out = []
    for o in gc.get_objects():
        if not isinstance(o, torch.optim.Optimizer):
            continue
        held = [p for g in o.param_groups for p in g["params"] if id(p) in by_id]
        stated = sum(1 for p in held if o.state.get(p))
        if stated:
            out.append(f"{type(o).__name__} (holding {len(held)} of them, with state for "
                       f"{stated})")
    return out


def finder(model: torch.nn.Module, ck: "_C.Checkpoint",
            rules: Callable[[], list]) -> Callable[[str], Optional[str]]:
    """A name's tensor in the checkpoint, or None: under the name itself, else (only where the
    checkpoint has names the model does not) under Transformers' renaming rules (``rules()``,
    asked for only then)."""
    renamed: List[bool] = []

    def find(name: str) -> Optional[str]:
        hit = stored_name(name, [], ck)
        if hit is None and not renamed:
            own = {n for n, _ in model.named_parameters(remove_duplicate=False)}
            own.update(n for n, _ in model.named_buffers())
            renamed.append(any(t.name not in own for t in ck.tensors()))
        return hit if hit is not None or not renamed[0] else stored_name(name, rules(), ck)
    return find
