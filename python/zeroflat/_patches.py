"""Every change zeroflat makes to DeepSpeed, Transformers and torch, in one place.

Each change is a ``Patch``: the attribute it replaces (``owner.name``), the releases that have it,
and why, with the function that runs in its place. One mechanism installs them (``apply``) and
puts the originals back (``restore``), the same for the drop-in's patches (installed until
``zeroflat.deepspeed.uninstall()``) and for those that hold only while zeroflat runs something
(``patched()``, a context manager): a hook is ``hook(original, *args, **kwargs)``, and the
wrapper in place carries ``__wrapped__`` (the original) and ``__zeroflat__``.

``TABLE`` lists every patch with its releases and reason; docs/patches.md is that table, and a
test checks that they agree. The DeepSpeed internals zeroflat reads without patching them are
listed there too (``READS``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple

# A marker for "the owner did not have the attribute of its own" (it was inherited or absent).
_ABSENT = object()
# Patch.value for an attribute that code outside zeroflat replaces (DeepSpeed's own tensor
# wrappers): apply() changes nothing, restore() puts back what was there before.
KEEP = object()


@dataclass(frozen=True)
class Patch:
    """One attribute replaced: ``owner`` (an object, or its dotted import path) and ``name``;
    ``hook(original, *args, **kwargs)`` runs in place of the original callable, or ``value``
    replaces the attribute outright (``KEEP``: nothing now, and what was there is put back on
    restore, for an attribute other code is about to replace). ``optional``: a release without
    the attribute is skipped (else it is an error before anything changes)."""

    owner: Any
    name: str
    hook: Optional[Callable[..., Any]] = None
    value: Any = _ABSENT
    optional: bool = False


@dataclass
class Applied:
    """Patches in place, to be restored in reverse order."""

    entries: List[Tuple[Any, str, Any]]  # (owner, name, its own attribute or _ABSENT)


def resolve(owner: Any) -> Any:
    """The owner object of a dotted path ("pkg.module.Class"), or the object itself."""
    if not isinstance(owner, str):
        return owner
    module, _, rest = owner.partition(":")
    if rest:
        obj = importlib.import_module(module)
        for part in rest.split("."):
            obj = getattr(obj, part)
        return obj
    parts = owner.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for part in parts[k:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"cannot import {owner}")


def wrap(original: Any, hook: Callable[..., Any]) -> Any:
    """``hook`` in place of ``original``: a function that calls ``hook(fn, *args, **kwargs)``
    with the original function, keeping a staticmethod static."""
    fn = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return hook(fn, *args, **kwargs)

    wrapper.__zeroflat__ = True
    if isinstance(original, staticmethod):
        return staticmethod(wrapper)
    if isinstance(original, classmethod):
        return classmethod(wrapper)
    return wrapper


def is_patched(owner: Any, name: str) -> bool:
    attr = vars(owner).get(name) if hasattr(owner, "__dict__") else getattr(owner, name, None)
    fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
    return bool(getattr(fn, "__zeroflat__", False))


def apply(patches: Iterable[Patch]) -> Applied:
    """Puts every patch in place, or none: an owner that cannot be found or a required attribute
    that is missing is an error (RuntimeError naming it) before anything changes."""
    plan = []
    for p in patches:
        try:
            owner = resolve(p.owner)
        except (ImportError, AttributeError) as e:
            if p.optional:
                continue
            raise RuntimeError(f"zeroflat: cannot find {p.owner} to patch its {p.name}: {e}; "
                               "nothing was changed") from e
        own = vars(owner).get(p.name, _ABSENT) if hasattr(owner, "__dict__") else _ABSENT
        current = own if own is not _ABSENT else getattr(owner, p.name, _ABSENT)
        if p.hook is not None and not callable(
                current.__func__ if isinstance(current, (staticmethod, classmethod)) else current):
            if p.optional:
                continue
            raise RuntimeError(f"zeroflat: {_name(owner)} has no {p.name} to patch; nothing was "
                               "changed")
        plan.append((owner, p, own, current))
    applied = Applied(entries=[])
    try:
        for owner, p, own, current in plan:
            if p.hook is not None:
                setattr(owner, p.name, wrap(current, p.hook))
            elif p.value is not KEEP:
                setattr(owner, p.name, p.value)
            applied.entries.append((owner, p.name, own))
    except BaseException:
        restore(applied)
        raise
    return applied


def restore(applied: Applied) -> None:
    """Puts back what ``apply`` replaced, in reverse order; an attribute the owner did not have
    of its own is removed again (so that the inherited one shows)."""
    for owner, name, own in reversed(applied.entries):
        if own is _ABSENT:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, own)
    applied.entries.clear()


@contextlib.contextmanager
def patched(patches: Iterable[Patch]) -> Iterator[Applied]:
    """The patches in place inside the block only."""
    applied = apply(patches)
    try:
        yield applied
    finally:
        restore(applied)


def _name(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or repr(owner)


def FULLY_SHARD(hook: Callable[..., Any]) -> List[Patch]:  # noqa: N802 - a table's name
    """FSDP2's ``fully_shard`` where callers look it up when they shard (accelerate's and the
    Trainer's prepare import it from ``torch.distributed.fsdp`` at each call), with ``hook`` in
    its place."""
    return [Patch("torch.distributed.fsdp", "fully_shard", hook=hook),
            Patch("torch.distributed._composable.fsdp", "fully_shard", hook=hook, optional=True)]


def ACCELERATE_PREPARE(hook: Callable[..., Any]) -> List[Patch]:  # noqa: N802 - a table's name
    """accelerate's ``Accelerator.prepare``, with ``hook`` in its place (a release without it:
    nothing)."""
    return [Patch("accelerate.accelerator.Accelerator", "prepare", hook=hook, optional=True)]


# --- the table ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One row of docs/patches.md."""

    target: str    # what is replaced (dotted), or read
    releases: str  # which releases have it
    scope: str     # when it is in place
    why: str


_DS = "deepspeed.runtime"
_ALL = "0.14.5 to 0.19.8"

TABLE: Tuple[Entry, ...] = (
    # The drop-in (zeroflat.deepspeed.install()).
    Entry(f"{_DS}.zero.stage_1_and_2.DeepSpeedZeroOptimizer.__init__", _ALL, "install()",
          "marks the optimizer being built, so that its flatten calls are told apart from "
          "later ones; keeps the parameters on the device and the host copies fast meanwhile"),
    Entry(f"{_DS}.zero.stage_1_and_2.DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned",
          _ALL, "install()",
          "builds each ZeRO-1/2 group's flat buffer through zeroflat (or adopts a loaded one)"),
    Entry(f"{_DS}.bf16_optimizer.BF16_Optimizer.__init__", "releases that have it", "install()",
          "as DeepSpeedZeroOptimizer.__init__, for bf16 ZeRO-1 with fp32 gradient "
          "accumulation"),
    Entry(f"{_DS}.bf16_optimizer.BF16_Optimizer._flatten_dense_tensors_aligned",
          "releases that have it", "install()", "builds its flat buffers through zeroflat"),
    Entry(f"{_DS}.fp16.unfused_optimizer.FP16_UnfusedOptimizer.__init__", _ALL, "install()",
          "says so when a release routes bf16 ZeRO-1 here (0.17 to 0.18.5: no ZeRO buffers)"),
    Entry(f"{_DS}.zero.stage3.DeepSpeedZeroOptimizer_Stage3.__init__", _ALL, "install()",
          "marks the Stage 3 optimizer being built"),
    Entry(f"{_DS}.zero.stage3.defragment (0.19) / DeepSpeedZeroOptimizer_Stage3.defragment "
          "(static, up to 0.18)", _ALL, "install()",
          "builds lp_param_buffer through zeroflat, or adopts the loaded partitions"),
    Entry(f"{_DS}.zero.stage3.DeepSpeedZeroOptimizer_Stage3."
          "_create_param_groups_fp16_flat_cpu_memory", _ALL, "install()",
          "offload_param: each param group's host buffer through zeroflat, or adopted"),
    Entry(f"{_DS}.zero.stage3.DeepSpeedZeroOptimizer_Stage3._move_to_flat_buffer", _ALL,
          "install()", "a partition already in its place is not copied onto itself"),
    Entry("deepspeed.accelerator.get_accelerator().available_memory", "0.18.9 on",
          "a ZeRO-1/2 optimizer's __init__",
          "the release's own device-or-host decision is zeroflat's planner's (it answers "
          "'enough' meanwhile)"),
    Entry("torch.Tensor.cpu", "torch", "a ZeRO-1/2 optimizer's __init__",
          "a trainable parameter's data stays on the device where a release would stage it to "
          "the host (zeroflat plans that move)"),
    Entry("torch.Tensor.clone, torch.Tensor.to, torch.Tensor.float", "torch",
          "a ZeRO optimizer's __init__",
          "the optimizer's large host copies of the buffer (its clone, its fp32 master) run on "
          "zeroflat's engine, bit for bit torch's; a clone up-cast in the same expression is "
          "not made (the up-cast reads the partition); an up-cast of a partition whose master "
          "zeroflat's load built, its bytes unchanged since, is that master"),
    Entry("torch.zeros", "torch", "a ZeRO optimizer's __init__",
          "large host zeros (the gradient partitions it makes to initialize its state) are a "
          "fresh mapping, left untouched until written"),
    Entry(f"{_DS}.engine.DeepSpeedEngine.load_checkpoint", _ALL, "install()",
          "resumes a ZeRO-1/2 or ZeRO-3 checkpoint (bf16 ZeRO-1 with fp32 gradient "
          "accumulation's BF16_Optimizer too) with each rank reading only its own bytes, at "
          "any world size, no pickle executed (what it does not serve is DeepSpeed's own call, "
          "with a warning saying why)"),
    Entry(f"{_DS}.engine.DeepSpeedEngine.save_checkpoint", _ALL, "install()",
          "DeepSpeed's own files, written under a temporary folder beside the tag, made durable "
          "on every rank, then published by one rename and 'latest' replaced last: a crash or "
          "a failed write never costs the last complete checkpoint (another checkpoint engine, "
          "or node-local storage, is DeepSpeed's own save, with a warning saying why)"),
    Entry(f"{_DS}.engine.DeepSpeedEngine: checkpoint_engine (its save, while a save runs), "
          "global_steps, use_node_local_storage", _ALL, "save_checkpoint()",
          "the files each rank writes, recorded to be made durable; the default tag"),
    Entry("DeepSpeedZeroOptimizer_Stage3.checkpoint_event_epilogue (the instance's, while a "
          "save runs)", _ALL, "save_checkpoint()",
          "the persistent parameters gathered whole again after the save in one all-gather, as "
          "a resume does (else the release's own, one per parameter)"),
    Entry(f"{_DS}.engine.DeepSpeedEngine._broadcast_model", _ALL, "install()",
          "the ranks first compare a checksum of their parameters; where every rank's agrees "
          "(one checkpoint, one seed) the broadcast of the whole model from the first rank is "
          "left out, else it runs as DeepSpeed's; DeepSpeed's MoE and ZeRO-3 parameters are "
          "always DeepSpeed's"),
    # FSDP2.
    Entry("torch.distributed.fsdp.fully_shard (and torch.distributed._composable.fsdp's)",
          "torch", "while a model of zeroflat.hf.from_pretrained(..., fsdp2=True) waits",
          "when FSDP2 shards such a model (the Trainer's and accelerate's prepare), its shards "
          "are filled by zeroflat.fsdp.load right after, every parameter object kept"),
    Entry("accelerate.accelerator.Accelerator.prepare", "accelerate",
          "while a model of zeroflat.hf.from_pretrained(..., distributed_config=...) lives",
          "an optimizer of such a model prepared alone with FSDP2 on (the Trainer's fsdp "
          "arguments, which would shard the model a second time) is refused in words that say "
          "what to do (fsdp2=True, or no fsdp arguments) before accelerate's own error; "
          "everything else is accelerate's call unchanged"),
    Entry("torch.distributed.checkpoint.FileSystemReader (the package's, filesystem's and "
          "_storage_utils')", "torch", "zeroflat.dcp.install()",
          "the readers DCP's load, the Trainer's and accelerate's FSDP checkpoints construct are "
          "zeroflat.dcp's, handing back to DCP's own what they do not serve"),
    Entry("torch.distributed.checkpoint.FileSystemWriter (the package's, filesystem's, "
          "_storage_utils' and format_utils')", "torch", "zeroflat.dcp.install(writer=True)",
          "the writers DCP's save and async_save construct write through zeroflat.dcp.Writer "
          "(published by one rename once every rank's files are durable, the folder's other "
          "files kept), handing back to DCP's own what it does not serve"),
    # Building a model for loading.
    Entry("torch.nn.Module.register_parameter", "torch", "zeroflat.meta_parameters()",
          "parameters are made on the meta device (no memory, no initialization)"),
    Entry("torch.nn.Module.__init_subclass__, and __init__ of every torch.nn.Module subclass",
          "torch", "zeroflat.meta_parameters()",
          "records when each module's construction completes: the order zero.Init numbers "
          "parameters in (ds_id)"),
    Entry("torch.tensor, empty, zeros, ones, full, arange, eye, randn; torch.Tensor.__new__",
          _ALL, "zeroflat.meta_parameters(zero3=...)",
          "DeepSpeed's own wrappers (zero.Init._add_tensor_creation_wrappers): buffers get "
          "zero.Init's dtype, as under Transformers' ZeRO-3 loading"),
    Entry("transformers.modeling_utils.is_deepspeed_zero3_enabled", "Transformers without "
          "set_zero3_state", "zeroflat.meta_parameters(zero3=...)",
          "Transformers' own zero.Init around from_config stays off (zeroflat partitions "
          "instead); where Transformers has set_zero3_state, that is used and nothing is "
          "patched"),
)

# DeepSpeed internals zeroflat reads (never patches), each checked where it is read, with the
# releases that have them.
READS: Tuple[Entry, ...] = (
    Entry("DeepSpeedZeroOptimizer: round_robin_bit16_groups, bit16_groups_flat, "
          "round_robin_bit16_offsets (0.19.8), real_dp_process_group, parameter_alignment, "
          "flatten", _ALL, "install()", "which group a flatten call builds, and its layout"),
    Entry("BF16_Optimizer: bf16_groups, bf16_groups_flat, real_dp_process_group", _ALL,
          "install()", "the same for BF16_Optimizer"),
    Entry("DeepSpeedZeroOptimizer_Stage3: fp16_groups, offload_param, dp_process_group, "
          "trainable_param_groups, param_groups_fp16_flat_cpu_memory, params_in_nvme_and_cpu, "
          "dtype", _ALL, "install()", "the partitions a Stage 3 buffer holds"),
    Entry("DeepSpeedEngine: param_names, optimizer, lr_scheduler, zero_load_from_fp32_weights, "
          "load_universal_checkpoint, _get_ckpt_name, global_steps, global_samples, "
          "skipped_steps, loaded_checkpoint_dp_world_size, loaded_checkpoint_mp_world_size, "
          "sparse_tensor_module_names (up to 0.18)", _ALL, "load_checkpoint()",
          "what a resume restores, as DeepSpeed's _load_checkpoint does"),
    Entry("DeepSpeedZeroOptimizer: bit16_groups, single_partition_of_fp32_groups, "
          "round_robin_bit16_indices, groups_padding, partition_count, update_lp_params, "
          "load_state_dict; Stage 3: fp16_groups, fp16_partitioned_groups_flat, "
          "sub_group_to_group_id, persistent_parameters, checkpoint_event_prologue/epilogue, "
          "_restore_from_bit16_weights, load_state_dict; ZeRO-3 parameters: ds_tensor, ds_numel, "
          "ds_shape, ds_status, ds_process_group, ds_secondary_tensor, ZeroParamStatus", _ALL,
          "load_checkpoint()",
          "the partitions a resume fills, and the release's own restore of its state dict; the "
          "epilogue's gather of the persistent parameters is one all-gather where their "
          "partitions are plain (no hpZ, quantized or NVMe partitions) and take at most 64 MiB, "
          "else the release's"),
    Entry("BF16_Optimizer: bf16_groups, bf16_groups_flat, fp32_groups_flat_partition, "
          "bf16_partitioned_groups, group_paddings, optimizer, clip_grad, partition_count, "
          "_param_slice_mappings, update_lp_params, load_state_dict (0.14's requires "
          "checkpoint_folder)", _ALL, "load_checkpoint()",
          "read under DeepSpeedZeroOptimizer's names (ZeroNames): the same layout, no "
          "round-robin, no loss scaler"),
    Entry("zero.Init: _convert_to_deepspeed_param, dtype, local_device, remote_device, "
          "pin_memory, ds_process_group, _keep_in_fp32, param_id (class), "
          "_add_tensor_creation_wrappers, tensor_overrides", _ALL, "ZeRO-3 loading",
          "zeroflat's ZeRO-3 parameters are made by DeepSpeed's own conversion"),
    Entry("ZeRO-3 parameters: ds_tensor, ds_numel, ds_process_group, ds_numel_aligned, "
          "partition(), PartitionedParamStatus", _ALL, "ZeRO-3 loading",
          "a partition loaded by zeroflat becomes the parameter's ds_tensor"),
)


def table_markdown() -> str:
    """docs/patches.md's two tables, from TABLE and READS."""
    def rows(entries):
        out = ["| what | releases | in place | why |", "|---|---|---|---|"]
        out += [f"| `{e.target}` | {e.releases} | {e.scope} | {e.why} |" for e in entries]
        return "\n".join(out)

    return ("## Replaced\n\n" + rows(TABLE) + "\n\n## Read, never replaced\n\n" + rows(READS)
            + "\n")


def row_of(owner: Any, name: str) -> Optional[Entry]:
    """The TABLE row that lists ``owner.name`` (a patch in place), or None."""
    qualified = f"{getattr(owner, '__module__', '')}.{_name(owner)}.{name}"
    short = f"{_name(owner)}.{name}"
    for e in TABLE:
        if qualified in e.target or short in e.target or (
                name in e.target and _name(owner) in e.target):
            return e
    return None
