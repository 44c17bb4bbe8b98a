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
is Transformers' own mapping (``_hf_names``). See docs/python.md.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ._load import load_param_groups, meta_parameters

__all__ = ["from_pretrained", "trainer_param_groups"]

log = logging.getLogger("zeroflat")


def _deepspeed_config_optimizer() -> bool:
    """Whether a DeepSpeed config that Transformers holds now (TrainingArguments(deepspeed=...)
    made one) has its own optimizer: the Trainer then hands DeepSpeed one group."""
    try:
        from transformers.integrations.deepspeed import deepspeed_config
    except ImportError:
        return False
    config = deepspeed_config()
    return isinstance(config, dict) and "optimizer" in config


def trainer_param_groups(model: torch.nn.Module) -> List[List[str]]:
    """The groups the Transformers Trainer gives DeepSpeed's optimizer, as parameter names,
    trainable ones only, in the model's order: its own optimizer's two groups, the parameters
    with weight decay then those without (biases and normalization weights, as
    ``Trainer.get_decay_parameter_names`` says); or, when a DeepSpeed config with its own
    ``"optimizer"`` is already made (``TrainingArguments(deepspeed=...)`` before the load), the
    one group of every trainable parameter the Trainer hands DeepSpeed then."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if _deepspeed_config_optimizer():
        return [names]
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    return [[n for n in names if n in decay], [n for n in names if n not in decay]]


def _default_group():
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD if dist.get_world_size() > 1 else None
    return None


def from_pretrained(model_class: Any, path: Union[str, os.PathLike], process_group: Any = "default",
                    dtype: Optional[torch.dtype] = None, *,
                    param_groups: Union[None, str, Sequence[Any],
                                        Callable[[torch.nn.Module], Sequence[Any]]] = "trainer",
                    device: Optional[Any] = None, round_robin: bool = False,
                    deepspeed: Optional[str] = "installed", cold: bool = False,
                    threads: Optional[int] = None, install_drop_in: bool = False,
                    read_plan: Optional[str] = None, copies: str = "sampled",
                    storage_bytes_per_second: float = 0,
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
    compare their copies, as ``zeroflat.load_param_groups`` takes them. Other keyword arguments
    go to ``from_config`` (``attn_implementation``, ...).

    DeepSpeed adopts the loaded buffers as they are only with the drop-in in place while it
    initializes: ``with zeroflat.deepspeed.installed(): ...`` around ``deepspeed.initialize`` or
    ``trainer.train()`` (or ``zeroflat.deepspeed.install()``). ``install_drop_in=True`` calls
    ``zeroflat.deepspeed.install()`` after the load, for the whole process.

    The model is returned in eval mode, as Transformers returns it; ``model.zeroflat_groups``
    holds the FlatGroups (buffers, partitions, reports; no fp32 master partition: DeepSpeed
    builds its own)."""
    from transformers import AutoConfig

    path = os.fspath(path)
    if process_group == "default":
        process_group = _default_group()
    config = AutoConfig.from_pretrained(path)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
    with meta_parameters():
        if hasattr(model_class, "from_config"):
            try:
                model = model_class.from_config(config, dtype=dtype, **from_config_kwargs)
            except TypeError:
                model = model_class.from_config(config, torch_dtype=dtype, **from_config_kwargs)
        else:
            model = model_class._from_config(config, torch_dtype=dtype, **from_config_kwargs)
    if isinstance(param_groups, str):
        if param_groups != "trainer":
            raise ValueError(f"param_groups {param_groups!r}: expected \"trainer\", None, a "
                             "list of groups or a function of the model")
        param_groups = trainer_param_groups
    # The groups are taken from the model as the loader finalizes it (tied weights that the
    # checkpoint holds apart are untied first); no master partition here: DeepSpeed builds its
    # own from the buffer.
    fgs = load_param_groups(model, path, process_group, param_groups=param_groups, dtype=dtype,
                            device=device, round_robin=round_robin, deepspeed=deepspeed,
                            master_dtype=None, cold=cold, threads=threads, read_plan=read_plan,
                            copies=copies, storage_bytes_per_second=storage_bytes_per_second)
    model.eval()
    model.zeroflat_groups = fgs
    if install_drop_in:
        import zeroflat.deepspeed as zd

        zd.install()
    return model
