"""zeroflat for PyTorch: flatten a parameter group into DeepSpeed's ZeRO-1/2 layout, or load
it straight from a checkpoint into that layout.

    fg = zeroflat.flatten_param_group(params, process_group)
    fg.flat, fg.partition, fg.master, fg.tier, fg.layout, fg.report

    with zeroflat.meta_parameters():
        model = build_model()                       # no memory, no initialization
    groups = zeroflat.load_param_groups(model, "checkpoint/", process_group)

Every trainable parameter of the group becomes a view into one flat buffer (padded so that it
splits evenly over the ranks of ``process_group``), with its value unchanged; this rank's
partition and its fp32 master copy come with it. The planner picks the way of flattening that
fits (on the device, sharded across the ranks, staged through the host, or on the host) before
anything moves; a failure at any step leaves every parameter holding its original values.
See docs/python.md.

The package: ``_flatten`` (flatten_param_group), ``_load`` (load_param_groups), ``_common``
(what both share: FlatGroup, the layout, DeepSpeed's release rules as the library states them),
``_comm`` (the collectives over torch.distributed), ``_errors``; ``hf`` (Transformers) and
``deepspeed`` (the drop-in) on top.
"""

from __future__ import annotations

from . import _C
from ._common import (TESTED_DEEPSPEED_RELEASES, FlatGroup, installed_deepspeed, layout,
                      release_rules)
from ._errors import (CommError, Error, ExecutionError, InternalError, InvalidArgument,
                      NoFeasiblePlan, OutOfMemory, ResourceExhausted, Unsupported)
from ._flatten import flatten_param_group, flatten_param_groups
from ._load import load_param_groups, meta_parameters

__version__ = _C.__version__

__all__ = [
    "CommError",
    "Error",
    "ExecutionError",
    "FlatGroup",
    "InternalError",
    "InvalidArgument",
    "NoFeasiblePlan",
    "OutOfMemory",
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
