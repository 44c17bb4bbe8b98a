"""zeroflat.hf.from_pretrained under DeepSpeed ZeRO-3 against the real Transformers and DeepSpeed
(CPU, gloo): the parameters equal those of Transformers' own ZeRO-3 from_pretrained (zero.Init,
then rank 0's values gathered in) in every ds_tensor, ds_* attribute, ds_id and buffer, at 1, 2
and 3 ranks, bf16 and fp16, a MoE model with stacked experts and tied embeddings, offload_param
(and offload_optimizer) to the CPU, and a checkpoint DeepSpeed's ZeRO-3 saved; the Trainer trains the same with one
changed line, the drop-in adopting the loaded buffer; a parameter the checkpoint lacks is an
error naming it on every rank."""

import json
import logging
import os
import shutil
import sys
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
from transformers import AutoModelForCausalLM  # noqa: E402

import zeroflat  # noqa: E402
import zeroflat.hf  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reference import end_rank, init_deepspeed_rank, start_ranks  # noqa: E402
from test_hf import (equal, optimizer_for, tiny_dense, tiny_moe, train,  # noqa: E402
                     write)

logging.getLogger("transformers").setLevel(logging.ERROR)


def tiny_gemma():
    """Gemma 2 keeps a buffer (embed_scale) made by torch.tensor, which zero.Init makes in
    DeepSpeed's dtype."""
    from transformers import Gemma2Config

    return Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def checkpoints():
    root = tempfile.mkdtemp(prefix="zeroflat-hf3-")
    out = {
        "moe": write(tiny_moe(), os.path.join(root, "moe"), torch.bfloat16),
        "dense_tied": write(tiny_dense(), os.path.join(root, "dense"), torch.bfloat16),
        "gemma_buffer": write(tiny_gemma(), os.path.join(root, "gemma"), torch.bfloat16),
        "root": root,
    }
    yield out
    shutil.rmtree(root, ignore_errors=True)


def ds3(dtype="bf16", **zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, **zero}, dtype: {"enabled": True},
            "zero_allow_untested_optimizer": True}


def zero3_params(model):
    """Everything of the model's ZeRO-3 parameters that DeepSpeed reads later, by name: the
    ds_* attributes (ds_id counted from the model's first), which functions zero.Init attached,
    the placeholder's shape, dtype and device, the partition with its attributes; and the
    buffers."""
    base = min(p.ds_id for p in model.parameters())
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        attrs = {k: v for k, v in vars(p).items()
                 if not callable(v) and k not in ("ds_process_group", "ds_tensor")}
        attrs["ds_id"] -= base
        t = p.ds_tensor
        # The last rank's padding: zero.Init leaves it as torch.empty made it, zeroflat zeroes it.
        valid = max(0, min(t.numel(), p.ds_numel - p.ds_zero_partition_rank * t.numel()))
        out[name] = (attrs, sorted(k for k, v in vars(p).items() if callable(v)),
                     p.shape, p.dtype, p.device, p.requires_grad,
                     t.shape, t.dtype, t.device, t.requires_grad, vars(t),
                     t.detach()[:valid].clone())
    buffers = {n: (b.dtype, b.device, b.clone()) for n, b in model.named_buffers()}
    return out, buffers


def assert_same_zero3(ref, ours, where):
    a, b = zero3_params(ref), zero3_params(ours)
    assert a[0].keys() == b[0].keys(), where
    for name in a[0]:
        for x, y in zip(a[0][name], b[0][name]):
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            assert same, (where, name, x, y)
    assert a[1].keys() == b[1].keys(), where
    for name in a[1]:
        (da, va, ta), (db, vb, tb) = a[1][name], b[1][name]
        assert da == db and va == vb and torch.equal(ta, tb), (where, name)
    tied = [m.get_output_embeddings().weight is m.get_input_embeddings().weight for m in (ref, ours)]
    assert tied[0] == tied[1], where
    assert ours.training is False


def assert_one_buffer(model, where):
    """Every trainable parameter's ds_tensor a view of one storage, back to back in the groups'
    order; the other parameters' in another."""
    groups = model.zeroflat_groups
    assert 1 <= len(groups) <= 2, where
    for fg in groups:
        params, flat = fg.params, fg.flat
        assert fg.partition is flat and fg.tier == "load-partitions", where
        at = 0
        for p in params:
            t = p.ds_tensor
            valid = max(0, min(t.numel(), p.ds_numel - p.ds_zero_partition_rank * t.numel()))
            assert not t[valid:].any(), where  # padding zeroed
            if flat is not None:
                assert p.ds_tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                assert p.ds_tensor.data_ptr() == flat.data_ptr() + at * flat.element_size(), where
            at += p.ds_tensor.numel()
        assert at == (flat.numel() if flat is not None else 0), where
    assert sum(len(fg.params) for fg in groups) == len(list(model.parameters())), where


def load_both(path, config, **kwargs):
    """Transformers' ZeRO-3 from_pretrained and zeroflat's, under a live HfDeepSpeedConfig."""
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(config)  # noqa: F841 - Transformers holds it weakly
    ref = AutoModelForCausalLM.from_pretrained(path)
    ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, **kwargs)
    return ref, ours


def equality_worker(rank, world, port, checkpoints):
    """Parameters equal to Transformers' ZeRO-3 loading, and the missing-parameter error, at
    ``world`` ranks."""
    init_deepspeed_rank(rank, world, port)
    def no_norms(model):  # the norms in no group: in the buffer of the other parameters
        return [[n for n, _ in model.named_parameters() if "norm" not in n]]

    cases = [("moe", "bf16", "trainer"), ("dense_tied", "fp16", no_norms),
             ("gemma_buffer", "fp16", "trainer")]
    for name, dtype, groups in cases:
        where = f"world {world} rank {rank} {name} {dtype}"
        ref, ours = load_both(checkpoints[name], ds3(dtype), param_groups=groups)
        assert_same_zero3(ref, ours, where)
        assert_one_buffer(ours, where)
        # Only this rank's partitions read (the checkpoints are bf16): no rank reads it whole.
        report = ours.zeroflat_groups[0].report
        assert report["tier"] == "load-partitions", where
        assert 0 < report["bytes_read"] <= ours.zeroflat_groups[0].flat.numel() * 2, where
        frozen = ours.zeroflat_groups[1].params if len(ours.zeroflat_groups) > 1 else []
        others = [n for n, p in ours.named_parameters() if any(p is q for q in frozen)]
        assert others == ([] if groups == "trainer" else
                          [n for n, _ in ours.named_parameters() if "norm" in n]), where
        assert ours.model.embed_tokens.weight.dtype == getattr(torch, {"bf16": "bfloat16",
                                                                      "fp16": "float16"}[dtype])
    # A layer the checkpoint lacks: an error naming it, on every rank, before any read.
    from transformers import AutoConfig
    from transformers.integrations import HfDeepSpeedConfig

    bad = os.path.join(checkpoints["root"], f"missing{world}")
    if rank == 0:
        shutil.copytree(checkpoints["moe"], bad, dirs_exist_ok=True)
        config = AutoConfig.from_pretrained(bad)
        config.num_hidden_layers = 3
        config.save_pretrained(bad)
    torch.distributed.barrier()
    keep = HfDeepSpeedConfig(ds3())  # noqa: F841
    with pytest.raises(ValueError, match=r"model\.layers\.2\."):
        zeroflat.hf.from_pretrained(AutoModelForCausalLM, bad)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    end_rank()


@pytest.mark.parametrize("world", [1, 3])
def test_zero3_parameters_equal_transformers_zero3(checkpoints, world):
    start_ranks(equality_worker, world, checkpoints, preload=("transformers",))


# --- the Trainer, at 2 ranks ------------------------------------------------------------------

def data():
    """The script's eight samples of six tokens (a list serves as the Trainer's dataset)."""
    samples = [torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(i))
               for i in range(8)]
    return [{"input_ids": x, "labels": x} for x in samples]


def trainer_script(path, mode, out):
    """The Trainer script of docs/python.md with a ZeRO-3 config: the DeepSpeed config made
    first (TrainingArguments), then the model; ``mode`` "zeroflat" is the one changed line."""
    from transformers import Trainer, TrainingArguments

    import zeroflat.deepspeed

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
          "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True}
    args = TrainingArguments(output_dir=os.path.join(out, mode), per_device_train_batch_size=2,
                             max_steps=3, logging_steps=1, deepspeed=ds, bf16=True,
                             report_to=[], use_cpu=True, save_strategy="no",
                             learning_rate=1e-3, weight_decay=0.1)
    if mode == "zeroflat":  # the changed line
        model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    trainer = Trainer(model=model, args=args, train_dataset=data())
    with zeroflat.deepspeed.installed():
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.save_model(os.path.join(out, mode, "saved"))
    return losses, model


def engine_of(model, config, trainer_groups):
    import deepspeed

    engine, opt, _, _ = deepspeed.initialize(model=model, config=config,
                                             optimizer=optimizer_for(model, trainer_groups))
    return engine, opt


def engine_case(path, config, rank, where, trainer_groups):
    """deepspeed.initialize on Transformers' ZeRO-3 model and on zeroflat's (the drop-in in
    place), one group or the Trainer's two: the same flat partitions and fp32 partitions, the
    loaded buffer adopted (with offload_param, each group's part of it), the same losses and
    partitions after three steps."""
    import zeroflat.deepspeed as zd

    ref, ours = load_both(path, config, param_groups="trainer" if trainer_groups else None)
    plain, po = engine_of(ref, config, trainer_groups)
    before = dict(zd.stats)
    with zd.installed():
        mine, oo = engine_of(ours, config, trainer_groups)
    offload = "offload_param" in config["zero_optimization"]
    adopted = len(oo.optimizer.param_groups) if offload else 1
    assert zd.stats["adopted"] == before["adopted"] + adopted, (where, zd.stats)
    assert zd.stats["fallbacks"] == before["fallbacks"], (where, zd.stats["fallback_reasons"])
    # Without offload_param the engine's buffer is the loaded one, as it is.
    if not offload:
        assert (oo.fp16_partitioned_groups_flat[0].data_ptr()
                == ours.zeroflat_groups[0].flat.data_ptr())
    assert len(po.fp16_partitioned_groups_flat) > 1, where  # several sub-groups
    assert equal(po.fp16_partitioned_groups_flat, oo.fp16_partitioned_groups_flat), where
    assert equal(po.fp32_partitioned_groups_flat, oo.fp32_partitioned_groups_flat), where
    assert po.groups_padding == oo.groups_padding, where
    assert train(plain, rank) == train(mine, rank), where
    assert equal(po.fp32_partitioned_groups_flat, oo.fp32_partitioned_groups_flat), where
    assert equal([p.ds_tensor for p in plain.module.parameters()],
                 [p.ds_tensor for p in mine.module.parameters()]), where
    if not offload:  # without the drop-in, DeepSpeed copies the partitions: the same training
        again = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, zero3=config,
                                            param_groups="trainer" if trainer_groups else None)
        before = dict(zd.stats)
        alone, _ = engine_of(again, config, trainer_groups)
        assert zd.stats["adopted"] == before["adopted"], where
        ref, _ = load_both(path, config)
        plain, _ = engine_of(ref, config, trainer_groups)
        assert train(plain, rank) == train(alone, rank), where


def trainer_worker(rank, world, port, checkpoints, out):
    init_deepspeed_rank(rank, world, port)
    import zeroflat.deepspeed as zd

    path = checkpoints["moe"]
    ref_losses, _ = trainer_script(path, "transformers", out)
    before = dict(zd.stats)
    losses, model = trainer_script(path, "zeroflat", out)
    assert len(losses) == 3 and losses == ref_losses, (rank, losses, ref_losses)
    assert zd.stats["adopted"] > before["adopted"], zd.stats
    assert zd.stats["fallbacks"] == before["fallbacks"], zd.stats["fallback_reasons"]
    assert zd.stats["not_adopted"] == before["not_adopted"], zd.stats["not_adopted"]

    # What DeepSpeed's ZeRO-3 saved (16-bit weights gathered), loaded again.
    saved = os.path.join(out, "zeroflat", "saved")
    torch.distributed.barrier()
    ref, ours = load_both(saved, ds3())
    assert_same_zero3(ref, ours, f"rank {rank} saved by ZeRO-3")
    # offload_param to the CPU, and the explicit argument without a live HfDeepSpeedConfig.
    config = ds3(offload_param={"device": "cpu"})
    ref, _ = load_both(path, config)
    ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, zero3=config)
    assert_same_zero3(ref, ours, f"rank {rank} offload_param")
    assert_one_buffer(ours, f"rank {rank} offload_param")
    del ref, ours

    engine_case(checkpoints["dense_tied"], ds3(sub_group_size=3000), rank,
                f"rank {rank} tied initialize", False)
    config = ds3(sub_group_size=20000, offload_param={"device": "cpu"},
                 offload_optimizer={"device": "cpu"})
    config["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on the host partitions
    engine_case(path, config, rank, f"rank {rank} moe offload_param+optimizer initialize", True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    end_rank()


def test_a_trainer_script_changes_one_line_under_zero3(checkpoints, tmp_path):
    start_ranks(trainer_worker, 2, checkpoints, str(tmp_path), preload=("transformers",))


def test_zero3_argument():
    from zeroflat import _zero3

    assert _zero3.resolve(False) is None
    assert _zero3.resolve("auto") is None  # no live HfDeepSpeedConfig
    with pytest.raises(ValueError, match="no live HfDeepSpeedConfig"):
        _zero3.resolve(True)
    with pytest.raises(ValueError, match="stage is 2"):
        _zero3.resolve({"zero_optimization": {"stage": 2}})
    with pytest.raises(TypeError):
        _zero3.resolve(3)
    config = ds3()
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(config, f)
        f.flush()
        assert _zero3.resolve(f.name) == config
    from transformers.integrations import HfDeepSpeedConfig

    assert _zero3.resolve(HfDeepSpeedConfig(config)) == config
