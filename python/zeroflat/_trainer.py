"""The optimizer groups the Transformers Trainer builds, as parameter names: what buffers are laid
out for by default (``zeroflat.hf``), and what the drop-in suggests when a loaded buffer was laid
out for other groups. Transformers is imported only when asked."""

from __future__ import annotations

from typing import List, Optional

import torch


def deepspeed_config_has_optimizer(config: Optional[dict] = None) -> bool:
    """Whether ``config``, else the DeepSpeed config that Transformers holds now
    (TrainingArguments(deepspeed=...) made one), has its own optimizer: the Trainer then hands
    DeepSpeed one group."""
    if config is None:
        try:
            from transformers.integrations.deepspeed import deepspeed_config
        except ImportError:
            return False
        config = deepspeed_config()
    return isinstance(config, dict) and "optimizer" in config


def trainer_param_groups(model: torch.nn.Module,
                         deepspeed_config: Optional[dict] = None) -> List[List[str]]:
    """The groups the Transformers Trainer gives DeepSpeed's optimizer, as parameter names,
    trainable ones only, in the model's order: its own optimizer's two groups, the parameters
    with weight decay then those without (biases and normalization weights, as
    ``Trainer.get_decay_parameter_names`` says); or, when a DeepSpeed config with its own
    ``"optimizer"`` is already made (``TrainingArguments(deepspeed=...)`` before the load), the
    one group of every trainable parameter the Trainer hands DeepSpeed then
    (``deepspeed_config``: the DeepSpeed config to ask instead of the one Transformers holds)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if deepspeed_config_has_optimizer(deepspeed_config):
        return [names]
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    return [[n for n in names if n in decay], [n for n in names if n not in decay]]
