"""zeroflat for PyTorch: a parameter group flattened into DeepSpeed's ZeRO-1/2 layout; a model
loaded straight from a checkpoint into DeepSpeed's ZeRO-1/2 flat buffers or ZeRO-3 partitions,
or into PyTorch FSDP2's DTensor shards; a DeepSpeed checkpoint resumed at any world size; a DCP
checkpoint read without unpickling anything.

    fg = zeroflat.flatten_param_group(params, process_group)
    fg.flat, fg.partition, fg.master, fg.tier, fg.layout, fg.report

    with zeroflat.meta_parameters():
        model = build_model()                       # no memory, no initialization
    groups = zeroflat.load_param_groups(model, "checkpoint/", process_group)   # ZeRO-1/2
    groups = zeroflat.load_param_groups(model, "checkpoint/", zero3=ds_config) # ZeRO-3

Flattened, every trainable parameter of the group becomes a view into one flat buffer (padded so
that it splits evenly over the ranks of ``process_group``), with its value unchanged; this rank's
partition and its fp32 master copy come with it. The planner picks the way of flattening that
fits (on the device, sharded across the ranks, staged through the host, or on the host) before
anything moves; a failure at any step leaves every parameter holding its original values.
Loaded, each rank reads only its share of the checkpoint. See docs/python.md.

The package: ``_flatten`` (flatten_param_group), ``_load`` (load_param_groups, and ``run_loads``:
the one load loop, which ZeRO-1/2, ZeRO-3, FSDP2 and the resume's buffers each hand a placement; the
ZeRO-1/2 placement), ``_zero3`` (the ZeRO-3 placement), ``_common`` (what they share: FlatGroup,
argument checks, DeepSpeed's release rules as the library states them), ``_comm`` (the collectives
over torch.distributed), ``_patches`` (every change made to DeepSpeed, Transformers and torch, one
mechanism; docs/patches.md), ``_errors``; ``hf`` (Transformers), ``deepspeed`` (the drop-in;
``_stage3`` and ``_dropin`` are its parts, and ``_resume``, ``_resume_write``, ``_resume_family``
(one adapter per optimizer family), ``_resume_undo`` and ``_resume_inplace`` its
``engine.load_checkpoint``) and ``_trainer`` (the Trainer's groups) on top; ``fsdp`` (FSDP2's
shards: ``fsdp.load``; ``_fsdp_model`` what a load does to the model's objects, ``_fsdp_copies`` the
ranks' copies, ``_fsdp_pretrained`` Transformers' FSDP2 loads), ``dcp`` (PyTorch DCP's
``StorageReader``, and ``install()`` for the readers DCP constructs), ``_hf_names`` (Transformers'
names), ``_progress`` and ``_shm`` beside them.
"""

from __future__ import annotations

from typing import Any, List

from . import _C
from ._errors import (CommError, Error, ExecutionError, InternalError, InvalidArgument, IoError,
                      NoFeasiblePlan, OutOfMemory, ResourceExhausted, Unsupported)

__version__ = _C.__version__

# The rest of the API, imported where it is first used: ``import zeroflat.dcp`` (a DCP load)
# pays for the reader alone, not for the ZeRO loads and their collectives.
# Each name and the module of the package that defines it (fixed here, never from input).
_LAZY = {
    "TESTED_DEEPSPEED_RELEASES": "_common", "FlatGroup": "_common",
    "installed_deepspeed": "_common", "layout": "_common", "release_rules": "_common",
    "flatten_param_group": "_flatten", "flatten_param_groups": "_flatten",
    "load_param_groups": "_load", "meta_parameters": "_load", "Progress": "_progress",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'zeroflat' has no attribute {name!r}")
    from . import _common, _flatten, _load, _progress

    module = {"_common": _common, "_flatten": _flatten, "_load": _load,
              "_progress": _progress}[_LAZY[name]]
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "CommError",
    "Error",
    "ExecutionError",
    "FlatGroup",
    "InternalError",
    "InvalidArgument",
    "IoError",
    "NoFeasiblePlan",
    "OutOfMemory",
    "Progress",
    "ResourceExhausted",
    "TESTED_DEEPSPEED_RELEASES",
    "Unsupported",
    "flatten_param_group",
    "flatten_param_groups",
    "installed_deepspeed",
    "layout",
    "load_param_groups",
    "meta_parameters",
    "release_rules",
]
