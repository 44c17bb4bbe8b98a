"""Hugging Face Transformers models loaded straight into DeepSpeed's ZeRO-1/2 flat buffers.

    import zeroflat.hf, zeroflat.deepspeed
    model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, "path/to/checkpoint")
    with zeroflat.deepspeed.installed():      # ZeRO adopts the buffers as they are
        trainer.train()                        # or deepspeed.initialize(model=model, ...)

The model is built from its config without memory (parameters on the meta device), then every
rank reads its partition of each flat buffer from the safetensors files and one all-gather
completes it, or (ranks of one host) each reads the whole buffer from the page cache
(``zeroflat.load_param_groups``): no rank ever holds the checkpoint in separate tensors. The
buffers are laid out for the groups the Transformers Trainer gives its optimizer
(``param_groups="trainer"``, the default here). Which checkpoint tensors hold which parameter
is Transformers' own mapping (``_hf_names``).

Under DeepSpeed ZeRO-3 (a live ``HfDeepSpeedConfig`` that says stage 3, as Transformers itself
detects it, or ``zero3=<DeepSpeed config>``) each rank reads only its own partition of every
parameter into one buffer laid out as the Stage 3 optimizer's flat partitions, and the
parameters come out as the ZeRO-3 parameters ``zero.Init`` would have made. Either way the load
is ``zeroflat.load_param_groups``, called as any other caller calls it. See docs/python.md.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import _hf_names, _zero3
from ._common import bool_option
from ._load import target_of, check_load_options, load_param_groups, meta_parameters
from ._progress import check_callback
from ._trainer import trainer_param_groups

__all__ = ["from_pretrained", "trainer_param_groups"]

log = logging.getLogger("zeroflat")


def _processes(distributed_config) -> int:
    """The processes a Transformers DistributedConfig's mesh spans (1: nothing is sharded, and
    Transformers returns the plain model)."""
    n = 1
    for attr in ("pp_size", "dp_replicate_size", "fsdp_size", "tp_size"):
        n *= int(getattr(distributed_config, attr, 1) or 1)
    return n


def _default_group():
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD if dist.get_world_size() > 1 else None
    return None


def _wants_master(dtype: Optional[torch.dtype], device: Any, install_drop_in: bool) -> bool:
    """master_dtype="auto": whether a DeepSpeed ZeRO-1/2 optimizer built through the drop-in
    may take the host buffers' master partitions (see from_pretrained)."""
    if dtype not in (torch.bfloat16, torch.float16) or target_of(device).type != "cpu":
        return False
    from . import deepspeed as drop_in

    return install_drop_in or drop_in.is_installed()


def from_pretrained(model_class: Any, path: Union[str, os.PathLike], process_group: Any = "default",
                    dtype: Optional[torch.dtype] = None, *,
                    param_groups: Union[None, str, Sequence[Any],
                                        Callable[[torch.nn.Module], Sequence[Any]]] = "trainer",
                    device: Optional[Any] = None, round_robin: bool = False,
                    deepspeed: Optional[str] = "installed", cold: bool = False,
                    threads: Optional[int] = None, install_drop_in: bool = False,
                    read_plan: Optional[str] = None, copies: str = "sampled",
                    storage_bytes_per_second: float = 0, zero3: Any = "auto",
                    progress: Optional[Callable[[Any], None]] = None,
                    master_dtype: Any = "auto", distributed_config: Any = None,
                    fsdp2: bool = False, storage: str = "auto",
                    **from_config_kwargs) -> torch.nn.Module:
    """The model of checkpoint directory ``path`` (its ``config.json`` and safetensors files),
    every trainable parameter a view into the flat buffer DeepSpeed's ZeRO-1/2 will build for
    its optimizer group, filled from the files by the library's loader.

    ``model_class``: ``AutoModelForCausalLM`` or any class with ``from_config`` (or a concrete
    model class). ``process_group``: the data-parallel group (``"default"``: the default group
    when torch.distributed is initialized with more than one rank, else one process; ``None``:
    one process). ``dtype``: the parameters' dtype (default: the config's ``torch_dtype``/
    ``dtype``, else the checkpoint's). ``param_groups``: the optimizer's groups the buffers are
    laid out for: ``"trainer"`` (the default: the groups the Transformers Trainer gives
    DeepSpeed, ``trainer_param_groups``), None (one group of every trainable parameter, what
    ``deepspeed.initialize(model_parameters=model.parameters())`` or a DeepSpeed config with its
    own optimizer builds), a list of groups of names or parameters, or a function of the model
    returning one. ``round_robin`` and ``deepspeed``: as DeepSpeed's config will have them.
    ``read_plan``, ``copies`` and ``storage_bytes_per_second``: who reads what and how the ranks
    compare their copies, as ``zeroflat.load_param_groups`` takes them; ``progress``: a callable
    given a ``zeroflat.Progress`` every 10 s of a long load, as there. Other keyword arguments
    go to ``from_config`` (``attn_implementation``, ...).

    DeepSpeed adopts the loaded buffers as they are only with the drop-in in place while it
    initializes: ``with zeroflat.deepspeed.installed(): ...`` around ``deepspeed.initialize`` or
    ``trainer.train()`` (or ``zeroflat.deepspeed.install()``). ``install_drop_in=True`` calls
    ``zeroflat.deepspeed.install()`` after the load, for the whole process.

    The model is returned in eval mode, as Transformers returns it; ``model.zeroflat_groups``
    holds the FlatGroups (buffers, partitions, reports; their ``master`` is None).

    ``master_dtype``: ``torch.float32`` builds this rank's fp32 master partition of each ZeRO-1/2
    buffer on the host during the load, each part up-cast as it is read (while the storage is
    the limit, the up-cast costs no time), for DeepSpeed's optimizer to take through the drop-in
    in place of the up-cast it makes at ``initialize`` (the same values: taken only where the
    partition's bytes are still the ones it was built from; forgotten once the optimizer is
    built). ``"auto"`` (the default) does so when the buffers are on the host and 16-bit and
    the drop-in is installed when the load begins (or ``install_drop_in``): DeepSpeed's ZeRO-1/2
    and bf16 optimizers then make such a master. None never does. The master takes twice the
    partition's bytes from the load on.

    ``distributed_config``: a Transformers ``DistributedConfig`` (``fsdp_size``,
    ``dp_replicate_size``): the model FSDP2-sharded as Transformers' own
    ``from_pretrained(..., distributed_config=...)`` shards it, each rank reading only its local
    shards (``zeroflat._fsdp_pretrained``; ``dtype``, ``threads``, ``cold``, ``copies`` and
    ``progress`` apply, the ZeRO options do not; ``storage``: ``"auto"`` (the default) and
    ``"map"`` use the host shards that lie in the files as they are in place, mapped
    copy-on-write as Transformers' own load maps its files, ``"read"`` reads every shard into
    memory of its own: ``zeroflat.fsdp.load``). ``model.zeroflat_report`` holds the load's report. A config of one
    process shards nothing (as Transformers): the plain load below.

    ``fsdp2=True``: for a framework that shards the model with FSDP2 itself (the Trainer's
    ``fsdp`` arguments with ``fsdp_version`` 2, accelerate's FSDP plugin, a ``fully_shard`` of
    your own): the model is built with its parameters on the meta device (no rank builds the
    whole model; buffers computed) and returned at once; when ``fully_shard`` is applied to it
    (or to a module holding it), its shards are filled right there by ``zeroflat.fsdp.load``,
    each rank reading only its own, every parameter object kept, so the optimizer handed to
    ``prepare`` stays attached and a Trainer's ``resume_from_checkpoint``, loaded after
    ``prepare``, is never overwritten (``zeroflat._fsdp_pretrained.sharded_later``).
    ``dtype``, ``threads``, ``cold``, ``copies``, ``storage`` and ``progress`` apply;
    ``model.zeroflat_report`` holds the load's report once it ran. Not with
    ``distributed_config`` (which shards at load time) nor with FSDP's
    ``cpu_ram_efficient_loading`` (refused when the model is sharded: zeroflat's load is that).

    ``zero3``: DeepSpeed ZeRO-3. ``"auto"`` (the default) loads for ZeRO-3 when Transformers
    would build the model inside ``zero.Init``: a live ``HfDeepSpeedConfig`` whose config says
    stage 3 (``TrainingArguments(deepspeed=...)`` made before the load;
    ``transformers.integrations.is_deepspeed_zero3_enabled()``), with that config; a DeepSpeed
    config (a dict, a path to its JSON file, or an ``HfDeepSpeedConfig``) loads for it without
    one; ``True`` requires the live one; ``False`` loads for ZeRO-1/2 whatever Transformers
    holds. Under ZeRO-3 the model is built on the meta device, each rank reads only its
    partition of every parameter (``[r*p, (r+1)*p)`` of the flattened parameter, p =
    ceil(numel / world), the last rank's padding zero) straight into one buffer in the layout
    of the Stage 3 optimizer's ``lp_param_buffer`` (the groups of ``param_groups`` in order,
    each group's trainable parameters in order; every other parameter in a second buffer), on
    DeepSpeed's device (the ``offload_param`` device when there is one), and every parameter
    becomes a ZeRO-3 parameter made by DeepSpeed's own ``zero.Init`` conversion: ``ds_id`` in
    the order ``zero.Init`` numbers them, ``ds_tensor`` its view of the buffer, the data an
    empty placeholder, NOT_AVAILABLE. The parameters take ``zero.Init``'s dtype (the DeepSpeed
    config's bf16 or fp16, else fp32), as under Transformers' ZeRO-3 loading; ``dtype`` only
    builds the model. ``device``, ``round_robin`` and the other options mean what they mean
    for ``zeroflat.load_param_groups(zero3=...)``, which does the load (``device`` and
    ``round_robin`` do not apply: ValueError). ``process_group``: the group the parameters are
    partitioned over (``zero.Init``'s ``data_parallel_group``; "default" or None: DeepSpeed's,
    every rank); nothing is gathered over it, the ranks only agree. ``model.zeroflat_groups``
    holds a FlatGroup per buffer (the optimizer groups', then the others'), their parameters and
    the load reports. With the drop-in in place, the Stage 3 optimizer adopts the buffer as
    its own. hpZ, ``offload_param`` to nvme and quantized weights are refused from the config,
    before DeepSpeed makes anything (NotImplementedError)."""
    from transformers import AutoConfig

    bool_option("fsdp2", fsdp2)
    if fsdp2:
        if distributed_config is not None:
            raise ValueError("fsdp2=True leaves the sharding to FSDP2 where your framework applies "
                             "it; distributed_config shards at load time: pass one of them")
        from . import _fsdp_pretrained

        return _fsdp_pretrained.sharded_later(
            model_class, path, dtype=dtype, threads=threads, cold=cold, copies=copies,
            storage=storage, progress=progress, **from_config_kwargs)
    if distributed_config is not None and _processes(distributed_config) > 1:
        from . import _fsdp_pretrained

        return _fsdp_pretrained.from_pretrained(
            model_class, path, distributed_config, dtype=dtype, threads=threads, cold=cold,
            copies=copies, storage=storage, progress=progress, **from_config_kwargs)
    if storage not in ("auto", "read"):
        raise ValueError(f"storage={storage!r}: shards are used in place only when FSDP2 shards "
                         "them (distributed_config); ZeRO's buffers are read")
    path = os.fspath(path)
    # The options the load takes, checked before anything is built (and before DeepSpeed's
    # zero.Init is made).
    check_load_options(cold=cold, round_robin=round_robin, strict=True, master_dtype=None,
                       threads=threads, margin_bytes=None, alignment_factor=2,
                       param_align_bytes=0, dtype=dtype, deepspeed=deepspeed,
                       read_plan=read_plan, copies=copies,
                       storage_bytes_per_second=storage_bytes_per_second)
    check_callback(progress)
    if not (master_dtype is None or master_dtype is torch.float32
            or (isinstance(master_dtype, str) and master_dtype == "auto")):
        raise TypeError(f"master_dtype is {master_dtype!r}: expected \"auto\", torch.float32 or "
                        "None")
    ds_config = _zero3.resolve(zero3)
    if ds_config is not None and master_dtype is torch.float32:
        raise ValueError("master_dtype=torch.float32 builds ZeRO-1/2's master partition; under "
                         "ZeRO-3 the optimizer builds its own from the partitions")
    if process_group == "default":
        # Under ZeRO-3 the partitions are zero.Init's group's (DeepSpeed's, every rank).
        process_group = _default_group() if ds_config is None else None
    config = AutoConfig.from_pretrained(path)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)

    def build():
        if hasattr(model_class, "from_config"):
            try:
                return model_class.from_config(config, dtype=dtype, **from_config_kwargs)
            except TypeError:
                return model_class.from_config(config, torch_dtype=dtype, **from_config_kwargs)
        return model_class._from_config(config, torch_dtype=dtype, **from_config_kwargs)

    if isinstance(param_groups, str):
        if param_groups != "trainer":
            raise ValueError(f"param_groups {param_groups!r}: expected \"trainer\", None, a "
                             "list of groups or a function of the model")
        param_groups = functools.partial(
            trainer_param_groups,
            deepspeed_config=ds_config if isinstance(ds_config, dict) else None)
    # Under ZeRO-3, DeepSpeed's zero.Init (made once, after the config's refusals; not entered)
    # makes the model's tensors and then its ZeRO-3 parameters: its group, dtype, devices.
    init = _zero3.init_object(ds_config, process_group) if ds_config is not None else None
    with meta_parameters(zero3=init):
        model = _hf_names.build(build)
    if init is not None or master_dtype is None:
        master = None
    elif master_dtype is torch.float32:
        master = torch.float32
    else:
        master = torch.float32 if _wants_master(dtype, device, install_drop_in) else None
    # The groups are taken from the model as the loader finalizes it (tied weights that the
    # checkpoint holds apart are untied first); the master partition, if any, is offered to
    # DeepSpeed's optimizer alone.
    model.zeroflat_groups = load_param_groups(
        model, path, process_group, param_groups=param_groups,
        dtype=dtype if init is None else None, device=device, round_robin=round_robin,
        deepspeed=deepspeed, master_dtype=master, cold=cold, threads=threads,
        read_plan=read_plan, copies=copies, storage_bytes_per_second=storage_bytes_per_second,
        zero3=init, progress=progress)
    for group in model.zeroflat_groups:
        group.master = None
    _hf_names.init_unheld(model)  # non-persistent buffers, as Transformers computes them
    model.eval()
    if install_drop_in:
        from . import deepspeed as drop_in

        drop_in.install()
    return model
