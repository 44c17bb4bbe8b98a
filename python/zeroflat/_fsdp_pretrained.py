"""``zeroflat.hf.from_pretrained(..., distributed_config=...)``: the model Transformers 5's FSDP2
load builds (its mesh, its plan, tied weights, dtypes), built the same way and loaded through
``zeroflat.fsdp.load``; tied weights of which the checkpoint holds every name are tied after
the load only where their values agree on every rank, as Transformers ties them."""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from . import _C, _hf_names, _patches
from ._comm import raise_agreed
from ._common import path_text
from ._errors import InvalidArgument
from ._load import checkpoint_of, check_load_options, left_untied, meta_parameters
from ._progress import check_callback
from ._fsdp_model import dtensor_class, finder
from .fsdp import load


def from_pretrained(model_class: Any, path: Union[str, os.PathLike], distributed_config: Any, *,
                    dtype: Optional[torch.dtype] = None, threads: Optional[int] = None,
                    cold: bool = False, copies: str = "sampled", storage: str = "auto",
                    progress: Optional[Callable[[Any], None]] = None,
                    **from_config_kwargs) -> torch.nn.Module:
    """The model Transformers' ``from_pretrained(path, distributed_config=...)`` returns (its
    mesh, its FSDP2 plan, tied weights, dtypes, non-persistent buffers), built the way
    Transformers builds it and loaded through ``load``: each rank reads its local shards'
    bytes only. ``storage``: as ``load`` takes it; ``"auto"`` (the default) is ``"map"``, as
    Transformers' own load maps its files (on a GPU nothing maps: the shards are read).
    ``zeroflat.hf.from_pretrained(..., distributed_config=...)`` comes here. Collective: an
    error of one rank's before the load (its config, its model) is raised on every rank."""
    from transformers import AutoConfig
    from transformers import initialization as hf_init
    from transformers.distributed import initialize_distributed_mesh

    path = os.fspath(path)
    check_load_options(cold=cold, round_robin=False, strict=True, master_dtype=None,
                       threads=threads, margin_bytes=None, alignment_factor=2,
                       param_align_bytes=0, dtype=dtype, deepspeed=None, read_plan=None,
                       copies=copies, storage_bytes_per_second=0)
    if storage not in ("auto", "read", "map"):
        raise ValueError(f"storage={storage!r}: expected 'auto', 'read' or 'map'")
    storage = "map" if storage == "auto" else storage
    # This rank's config and model: an error in either is every rank's before the load (a
    # rank whose copy lacks config.json must not leave the others waiting in the load).
    error, config = None, None
    try:
        config = AutoConfig.from_pretrained(path)
        if dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype, None)
    except Exception as e:  # noqa: BLE001 - every rank learns of it after the mesh is made
        error = e
    device, meshes = initialize_distributed_mesh(distributed_config)  # every rank makes it
    if meshes is None:
        raise ValueError(f"{distributed_config!r} describes one process: nothing is sharded "
                         "(zeroflat.hf.from_pretrained loads the plain model then)")
    model = None
    if error is None:
        try:
            # As Transformers builds it: on meta, untied (FSDP2 groups may not share a parameter
            # across groups), the plan applied, materialized, tied again.
            with torch.device("meta"), hf_init.no_tie_weights():
                model = model_class.from_config(config, dtype=dtype, **from_config_kwargs)
            model = type(model).maybe_distribute_model(model, distributed_config, meshes)
            model.to_empty(device=device or "cpu")
        except Exception as e:  # noqa: BLE001 - as above
            error = e
    _agree(error, path)
    # Tied weights of which the checkpoint holds every name load untied and are tied after only
    # where the values agree, as Transformers ties them. The checkpoint is opened once; one that
    # cannot be is left to the load, which raises its error on every rank.
    checkpoint, both = path, {}
    try:
        checkpoint = checkpoint_of(path)
        both = _stored_twice(model, checkpoint)
    except Exception:  # noqa: BLE001 - the load's agreement reports it on every rank
        checkpoint, both = path, {}
    own = {target: model.get_parameter(target) for target in both}
    model.tie_weights()
    for target, p in own.items():
        _set_parameter(model, target, p)
    _hf_names.init_unheld(model)  # what no checkpoint holds: non-persistent buffers
    model.zeroflat_report = load(model, checkpoint, threads=threads, cold=cold, copies=copies,
                                 storage=storage, progress=progress, strict=False)
    for target, source in both.items():
        if _equal_everywhere(model.get_parameter(target), model.get_parameter(source)):
            _set_parameter(model, target, model.get_parameter(source))
            continue
        left_untied(model, target, source, path)
    model.eval()
    _watch_prepare(model)
    return model


# ---- a model sharded at load time meets FSDP2 in accelerate --------------------------------

# The models of from_pretrained(..., distributed_config=...) still alive, and the patch of
# accelerate's prepare that refuses, in words saying what to do, the one call that cannot work
# with them: their optimizer prepared alone with FSDP2 on (the Trainer's fsdp arguments), where
# accelerate raises "a model and optimizer must be passed together" and Transformers' own
# distributed_config models fail the same way.
_sharded_at_load: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_prepare_applied: Optional[_patches.Applied] = None


def _watch_prepare(model: torch.nn.Module) -> None:
    global _prepare_applied
    with _lock:
        _sharded_at_load.add(model)
        if _prepare_applied is None:
            try:
                _prepare_applied = _patches.apply(_patches.ACCELERATE_PREPARE(_on_prepare))
            except RuntimeError:  # no accelerate: nothing to guard
                return
    weakref.finalize(model, _unwatch_prepare)


def _unwatch_prepare() -> None:
    global _prepare_applied
    with _lock:
        if _prepare_applied is not None and not len(_sharded_at_load):
            _patches.restore(_prepare_applied)
            _prepare_applied = None


def _on_prepare(original, accelerator, *args, **kwargs):
    if getattr(accelerator, "is_fsdp2", False) and not any(
            isinstance(a, torch.nn.Module) for a in args):
        held = {id(p) for a in args if isinstance(a, torch.optim.Optimizer)
                for g in a.param_groups for p in g["params"]}
        with _lock:
            models = list(_sharded_at_load)
        if held and any(id(p) in held for m in models for p in m.parameters()):
            raise InvalidArgument(
                "this model was sharded when it was loaded (zeroflat.hf.from_pretrained(..., "
                "distributed_config=...)), and FSDP2 is on in accelerate as well (the Trainer's "
                "fsdp arguments, or accelerate's FSDP plugin), which would shard it a second "
                "time: accelerate cannot prepare its optimizer. Either keep the fsdp arguments "
                "and load with zeroflat.hf.from_pretrained(model_class, path, fsdp2=True): FSDP2 "
                "shards the model as those arguments say and zeroflat fills the shards "
                "(checkpoints and resume_from_checkpoint work); or keep distributed_config and "
                "drop the fsdp arguments (the model trains as it was sharded; Transformers then "
                "saves no optimizer state: save_only_model=True)")
    return original(accelerator, *args, **kwargs)


def _stored_twice(model: torch.nn.Module, ck: "_C.Checkpoint") -> Dict[str, str]:
    """The model's tied weights (target -> source, as Transformers lists them) of which the
    checkpoint holds both names (_fsdp_model.finder's way)."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    pairs = expand(all_submodels=True) if callable(expand) else {}
    if not pairs:
        return {}
    built: List[list] = []

    def rules() -> list:
        if not built:
            built.append(_hf_names.converters(model))
        return built[0]
    find = finder(model, ck, rules)
    return {t: s for t, s in pairs.items() if find(t) is not None and find(s) is not None}


def _set_parameter(model: torch.nn.Module, name: str, p: torch.nn.Parameter) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, p)


def _equal_everywhere(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal of two parameters; of two DTensors sharded alike, of their local shards on
    every rank of their mesh (one all-reduce per mesh dimension, as Transformers compares)."""
    DTensor = dtensor_class()
    if a.shape != b.shape:
        return False
    if (DTensor is None or not isinstance(a, DTensor) or not isinstance(b, DTensor)
            or a.device_mesh != b.device_mesh or a.placements != b.placements):
        return bool(torch.equal(a.detach(), b.detach()))
    differ = torch.tensor(int(not torch.equal(a.to_local(), b.to_local())),
                          device=a.to_local().device)
    for d in range(a.device_mesh.ndim):
        dist.all_reduce(differ, group=a.device_mesh.get_group(d))
    return int(differ.item()) == 0


def _agree(error: Optional[BaseException], path: str) -> None:
    """Raises this rank's error; where several ranks build the model, first tells each whether
    any failed (one all-reduce over the default group), and raises on each then."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    raise_agreed(error, None, "the ranks' agreement on building the model (an all-reduce)",
                 "from-pretrained", lambda rank: InvalidArgument(
                     f"from_pretrained({path_text(path)}): rank {rank} could not build the model "
                     "(its error says why); nothing was loaded on this rank"))


# ---- fsdp2=True: built on meta, filled when FSDP2 shards it ----------------------------------

# The models waiting for their weights (model -> the load's options), and the patch of
# fully_shard that fills them, in place while any waits.
_waiting: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[str, Any]]" = (
    weakref.WeakKeyDictionary())
_applied: Optional[_patches.Applied] = None
_lock = threading.RLock()


def sharded_later(model_class: Any, path: Union[str, os.PathLike], *,
                  dtype: Optional[torch.dtype] = None, threads: Optional[int] = None,
                  cold: bool = False, copies: str = "sampled", storage: str = "auto",
                  progress: Optional[Callable[[Any], None]] = None,
                  **from_config_kwargs) -> torch.nn.Module:
    """``zeroflat.hf.from_pretrained(..., fsdp2=True)``: the model built from its config with its
    parameters on the meta device (its buffers computed, as ``meta_parameters()`` builds), for
    FSDP2 to shard where the caller's framework shards it (the Trainer's and accelerate's
    ``prepare``, or the caller's own ``fully_shard``); when ``fully_shard`` is applied to the
    model (or to a module that holds it: a PEFT wrapper), its shards are filled from ``path``
    by ``zeroflat.fsdp.load`` at once, collectively, every parameter object kept (an optimizer
    given to ``prepare`` stays attached). Before then the model has no weights: a forward
    raises, saying so."""
    path = os.fspath(path)
    check_load_options(cold=cold, round_robin=False, strict=True, master_dtype=None,
                       threads=threads, margin_bytes=None, alignment_factor=2,
                       param_align_bytes=0, dtype=dtype, deepspeed=None, read_plan=None,
                       copies=copies, storage_bytes_per_second=0)
    check_callback(progress)
    if storage not in ("auto", "read", "map"):
        raise ValueError(f"storage={storage!r}: expected 'auto', 'read' or 'map'")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
    checkpoint_of(path)  # a folder without a model, or a malformed header: refused now

    def build():
        if hasattr(model_class, "from_config"):
            return model_class.from_config(config, dtype=dtype, **from_config_kwargs)
        return model_class._from_config(config, dtype=dtype, **from_config_kwargs)

    with meta_parameters():
        model = _hf_names.build(build)
    model.eval()
    # accelerate's FSDP2 prepare re-points the optimizer from the parameters it had to the
    # sharded ones by each parameter's data_ptr(), which is 0 for every tensor on meta: all would
    # map to one. Each parameter answers a key of its own until its shard replaces it
    # (swap_tensors takes this attribute away with the meta tensor).
    for p in {id(p): p for p in model.parameters()}.values():
        p.data_ptr = functools.partial(int, id(p))
    options = {"path": path, "threads": threads, "cold": cold, "copies": copies,
               "storage": "map" if storage == "auto" else storage, "progress": progress}
    options["hook"] = model.register_forward_pre_hook(_not_filled)
    with _lock:
        _waiting[model] = options
        _install()
    return model


def waiting(model: torch.nn.Module) -> bool:
    """Whether ``model`` (from ``from_pretrained(..., fsdp2=True)``) still waits for FSDP2 to
    shard it."""
    with _lock:
        return model in _waiting


def _not_filled(module, args):
    raise RuntimeError(
        f"{type(module).__name__} has no weights yet: zeroflat.hf.from_pretrained(..., "
        "fsdp2=True) loads them when FSDP2 shards the model (fully_shard on the model or on a "
        "module holding it, as the Trainer's and accelerate's prepare do)" + (
            "; its load failed (the error was raised where it was sharded)"
            if not waiting(module) else ""))


def _install() -> None:
    global _applied
    if _applied is None:
        _applied = _patches.apply(_patches.FULLY_SHARD(_on_fully_shard))


def _uninstall() -> None:
    global _applied
    if _applied is not None and not _waiting:
        _patches.restore(_applied)
        _applied = None


def _on_fully_shard(original, module, *args, **kwargs):
    out = original(module, *args, **kwargs)
    roots = list(module) if isinstance(module, (list, tuple)) else [module]
    with _lock:
        due = [m for m in list(_waiting.keys())
               if any(r is m or any(x is m for x in r.modules()) for r in roots)]
    for model in due:
        _fill(model)
    return out


def _fill(model: torch.nn.Module) -> None:
    with _lock:
        options = _waiting.pop(model)
        _uninstall()
    _refuse_broadcast_loading()
    model.zeroflat_report = load(model, options["path"], threads=options["threads"],
                                 cold=options["cold"], copies=options["copies"],
                                 storage=options["storage"], progress=options["progress"],
                                 strict=False)
    _hf_names.init_unheld(model)  # non-persistent buffers, as Transformers' load computes them
    options["hook"].remove()


def _refuse_broadcast_loading() -> None:
    """accelerate's cpu_ram_efficient_loading has its first rank broadcast the weights it loaded
    after FSDP2 shards the model; a model of fsdp2=True has none to broadcast."""
    if _broadcast_loading():
        raise InvalidArgument(
            "zeroflat.hf.from_pretrained(..., fsdp2=True) fills every rank's shards itself, and "
            "FSDP's cpu_ram_efficient_loading would then broadcast the first rank's weights over "
            "them from a model that never held any: leave cpu_ram_efficient_loading off "
            "(fsdp_config / FSDP plugin): zeroflat's load is already that, each rank reading "
            "only its shards")


def _broadcast_loading() -> bool:
    """Whether the FSDP plugin in use (accelerate's, live while it prepares the model; else the
    environment the Trainer's arguments and the plugin set) has cpu_ram_efficient_loading on."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        AcceleratorState = None
    plugin = None
    if AcceleratorState is not None and AcceleratorState._shared_state:
        try:
            plugin = getattr(AcceleratorState(), "fsdp_plugin", None)
        except Exception:  # noqa: BLE001 - a state being set up: the environment says
            plugin = None
    if plugin is not None:
        return bool(getattr(plugin, "cpu_ram_efficient_loading", False))
    flag = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "")
    return flag.strip().lower() in ("1", "true", "yes")
