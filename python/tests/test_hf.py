"""zeroflat.load_param_groups and zeroflat.hf.from_pretrained against the real Transformers and
DeepSpeed from PyPI (CPU, gloo): checkpoints written by Transformers' own save_pretrained (a
MoE model whose experts the model fuses, tied and untied embeddings, bf16 and fp32 files) load
into the same parameters, buffers and logits as Transformers' from_pretrained; with the drop-in,
deepspeed.initialize adopts the loaded buffers as they are, and its flat buffers, partitions,
fp32 master partitions and three training steps equal plain Hugging Face + DeepSpeed, at 1 and
2 ranks, ZeRO-1 and 2, round-robin on and off, one group or the Trainer's two."""

import logging
import os
import shutil
import socket
import sys
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

import zeroflat  # noqa: E402
import zeroflat.hf  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reference import init_deepspeed_rank  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)


def tiny_moe(tie=False):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=300, hidden_size=48, intermediate_size=96,
                          moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=12, num_experts=4,
                          num_experts_per_tok=2, tie_word_embeddings=tie)


def tiny_dense(tie=True):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=300, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=tie, attention_bias=True)


def tiny_mixtral():
    """Mixtral's checkpoints keep their old names (block_sparse_moe, experts.N.w1/w2/w3):
    Transformers renames the module and stacks the experts when it loads them."""
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=300, hidden_size=48, intermediate_size=40,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=12, num_local_experts=3, num_experts_per_tok=2)


def write(config, path, dtype, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # values far from zero, so that rounding differences would show
        for p in model.parameters():
            p.normal_(0, 1.3)
    model.save_pretrained(path, max_shard_size="60KB")
    return path


@pytest.fixture(scope="module")
def checkpoints():
    root = tempfile.mkdtemp(prefix="zeroflat-hf-")
    out = {
        "moe": write(tiny_moe(), os.path.join(root, "moe"), torch.bfloat16),
        "moe_tied_fp32": write(tiny_moe(tie=True), os.path.join(root, "moe32"), torch.float32),
        "dense_tied": write(tiny_dense(), os.path.join(root, "dense"), torch.bfloat16),
        "mixtral_legacy_names": write(tiny_mixtral(), os.path.join(root, "mixtral"),
                                      torch.bfloat16),
    }
    yield out
    shutil.rmtree(root, ignore_errors=True)


def same_model(a, b):
    pa = dict(a.named_parameters(remove_duplicate=False))
    pb = dict(b.named_parameters(remove_duplicate=False))
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and torch.equal(pa[k], pb[k]), k
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    assert ba.keys() == bb.keys()
    for k in ba:
        assert torch.equal(ba[k], bb[k]), k


@pytest.mark.parametrize("name", ["moe", "moe_tied_fp32", "dense_tied", "mixtral_legacy_names"])
def test_from_pretrained_equals_transformers(checkpoints, name):
    path = checkpoints[name]
    if name == "mixtral_legacy_names":  # the case this checkpoint is here for
        import json

        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            stored = json.load(f)["weight_map"]
        assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in stored
        assert not any(".mlp." in n for n in stored)
    for dtype in (torch.bfloat16, torch.float16):
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, None, dtype, device="cpu")
        same_model(ref, ours)  # fp32 files: the same rounding as torch's
        assert ours.training is False
        x = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(1))
        assert torch.equal(ref(x).logits, ours(x).logits)
        (fg,) = ours.zeroflat_groups
        tied = ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
        assert tied == bool(ours.config.tie_word_embeddings)
        # Every trainable parameter is a view at its layout offset into the one buffer.
        base = fg.flat.data_ptr()
        es = fg.flat.element_size()
        for p, off in zip(fg.params, fg.layout["offsets"]):
            assert p.data_ptr() == base + off * es
        assert len(fg.params) == len(list(ours.parameters()))
        assert fg.report["bytes_read"] > 0 and fg.master is None


def test_groups_frozen_parameters_and_fp32_masters(checkpoints):
    path = checkpoints["moe"]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with zeroflat.meta_parameters():
        model = AutoModelForCausalLM.from_config(ref.config, dtype=torch.bfloat16)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.model.norm.weight.requires_grad_(False)  # frozen: loaded into its own storage
    groups = zeroflat.hf.trainer_param_groups(model)
    assert groups[0] and groups[1]
    fgs = zeroflat.load_param_groups(model, path, param_groups=groups, device="cpu",
                                     round_robin=True)
    same_model(ref, model)
    assert len(fgs) == 2
    in_flat = {id(p) for fg in fgs for p in fg.params}
    assert id(model.model.norm.weight) not in in_flat
    for fg in fgs:
        assert fg.master.dtype == torch.float32
        assert torch.equal(fg.master, fg.partition.float())


def test_bad_names_and_shapes_are_refused_before_anything_is_read(checkpoints):
    path = checkpoints["moe"]
    config = tiny_moe()
    config.num_hidden_layers = 3  # layer 2 is not in the checkpoint
    with zeroflat.meta_parameters():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="layers.2"):
        zeroflat.load_param_groups(model, path, device="cpu")
    config = tiny_moe()
    config.hidden_size = 60
    with zeroflat.meta_parameters():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shape|elements"):
        zeroflat.load_param_groups(model, path, device="cpu")
    with pytest.raises(ValueError, match="no such file"):
        zeroflat.load_param_groups(model, os.path.join(path, "nowhere"), device="cpu")
    with pytest.raises(TypeError):
        zeroflat.load_param_groups("model", path)


# --- with DeepSpeed -----------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_config(stage, rr):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage, "round_robin_gradients": rr},
            "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}}


def optimizer_for(model, trainer_groups):
    if not trainer_groups:
        return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    decay, no_decay = zeroflat.hf.trainer_param_groups(model)
    named = dict(model.named_parameters())
    return torch.optim.AdamW([{"params": [named[n] for n in decay], "weight_decay": 0.1},
                              {"params": [named[n] for n in no_decay], "weight_decay": 0.0}],
                             lr=1e-3, foreach=False)


def engine_of(model, stage, rr, trainer_groups):
    import deepspeed

    engine, opt, _, _ = deepspeed.initialize(model=model,
                                             optimizer=optimizer_for(model, trainer_groups),
                                             config=ds_config(stage, rr))
    return engine, opt


def train(engine, rank):
    losses = []
    gen = torch.Generator().manual_seed(50 + rank)
    for _ in range(3):
        x = torch.randint(0, 300, (2, 6), generator=gen)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def worker(rank, world, port, path):
    init_deepspeed_rank(rank, world, port)
    import deepspeed
    import zeroflat.deepspeed as zd

    cases = [(2, False, False), (1, True, True), (2, True, True)] if world == 2 else \
        [(1, False, False), (2, True, True)]
    for stage, rr, trainer_groups in cases:
        where = f"world {world} rank {rank} stage {stage} rr {rr} trainer {trainer_groups}"
        plain_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        plain, po = engine_of(plain_model, stage, rr, trainer_groups)
        before = dict(zd.stats)
        model = zeroflat.hf.from_pretrained(
            AutoModelForCausalLM, path, dtype=torch.bfloat16, device="cpu", round_robin=rr,
            param_groups="trainer" if trainer_groups else None)
        loaded = [fg.flat for fg in model.zeroflat_groups]
        zd.install()
        try:
            ours, oo = engine_of(model, stage, rr, trainer_groups)
        finally:
            zd.uninstall()
        groups = len(po.bit16_groups_flat)
        assert zd.stats["adopted"] == before["adopted"] + groups, (where, zd.stats)
        assert zd.stats["fallbacks"] == before["fallbacks"], (where, zd.stats["fallback_reasons"])
        # Adopted as they are: the engine's buffers are the loaded ones.
        assert [f.data_ptr() for f in oo.bit16_groups_flat] == [f.data_ptr() for f in loaded]
        assert equal(po.bit16_groups_flat, oo.bit16_groups_flat), where
        for a, b in zip(po.parallel_partitioned_bit16_groups, oo.parallel_partitioned_bit16_groups):
            assert equal(a, b), where
        assert po.groups_padding == oo.groups_padding, where
        assert equal(po.single_partition_of_fp32_groups, oo.single_partition_of_fp32_groups), where
        assert train(plain, rank) == train(ours, rank), where
        assert equal(po.single_partition_of_fp32_groups, oo.single_partition_of_fp32_groups), where
        assert equal([p.detach() for p in plain.module.parameters()],
                     [p.detach() for p in ours.module.parameters()]), where
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_deepspeed_adopts_the_loaded_buffers_and_trains_the_same(checkpoints, world):
    pytest.importorskip("deepspeed")
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, free_port(), checkpoints["moe"]), nprocs=world, join=True)


TRAINER_SCRIPT = """
import os, sys, json, torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
import zeroflat.hf
path, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "zeroflat":  # the one changed line
    model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, param_groups="trainer")
else:
    model = AutoModelForCausalLM.from_pretrained(path)
class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        x = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}
ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
      "zero_allow_untested_optimizer": True}
args = TrainingArguments(output_dir=os.path.join(out, mode), per_device_train_batch_size=2,
                         max_steps=3, logging_steps=1, deepspeed=ds, bf16=True, report_to=[],
                         use_cpu=True, save_strategy="no", learning_rate=1e-3, weight_decay=0.1)
trainer = Trainer(model=model, args=args, train_dataset=Data())
trainer.train()
import zeroflat.deepspeed as zd
print(json.dumps({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                  "adopted": zd.stats["adopted"], "fallbacks": zd.stats["fallbacks"]}))
"""


def test_a_trainer_script_changes_one_line(checkpoints, tmp_path):
    """The Transformers Trainer with DeepSpeed ZeRO-2 (one process, CPU): the model from
    zeroflat.hf.from_pretrained trains exactly as the one from Transformers, and DeepSpeed
    adopts both of the Trainer's groups' buffers."""
    pytest.importorskip("deepspeed")
    import json
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(TRAINER_SCRIPT)
    results = {}
    for mode in ("transformers", "zeroflat"):
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
        run = subprocess.run([sys.executable, str(script), checkpoints["moe"], mode,
                              str(tmp_path)], capture_output=True, text=True, env=env,
                             timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        results[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results["zeroflat"]["losses"]) == 3
    assert results["zeroflat"]["losses"] == results["transformers"]["losses"]
    assert results["zeroflat"]["adopted"] == 2 and results["zeroflat"]["fallbacks"] == 0
