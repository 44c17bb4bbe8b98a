"""zeroflat.load_param_groups and zeroflat.hf.from_pretrained against the real Transformers and
DeepSpeed from PyPI (CPU, gloo): checkpoints written by Transformers' own save_pretrained (a
MoE model whose experts the model fuses, tied and untied embeddings, bf16 and fp32 files) load
into the same parameters, buffers and logits as Transformers' from_pretrained; with the drop-in,
deepspeed.initialize adopts the loaded buffers as they are, and its flat buffers, partitions,
fp32 master partitions and three training steps equal plain Hugging Face + DeepSpeed, at 1 and
2 ranks, ZeRO-1 and 2, round-robin on and off, one group or the Trainer's two."""

import logging
import os
import re
import shutil
import sys
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

import zeroflat  # noqa: E402
import zeroflat.hf  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reference import end_rank, free_port, init_deepspeed_rank, start_ranks  # noqa: E402

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


def tiny_gptj():
    """GPT-J computes its rotary table (a non-persistent buffer) in __init__ under the default
    dtype; Transformers 5's load computes it again after the load, in float32."""
    from transformers import GPTJConfig

    return GPTJConfig(vocab_size=300, n_embd=48, n_layer=2, n_head=4, rotary_dim=8,
                      n_positions=64, bos_token_id=0, eos_token_id=0)


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
        "gptj_rotary_table": write(tiny_gptj(), os.path.join(root, "gptj"), torch.bfloat16),
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


@pytest.mark.parametrize("name", ["moe", "moe_tied_fp32", "dense_tied", "mixtral_legacy_names",
                                  "gptj_rotary_table"])
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
        tied = ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
        assert tied == bool(ours.config.tie_word_embeddings)
        # The Trainer's two groups by default; every trainable parameter is a view at its
        # layout offset into its group's buffer.
        fgs = ours.zeroflat_groups
        assert [[n for n, p in ours.named_parameters() if any(p is q for q in fg.params)]
                for fg in fgs] == zeroflat.hf.trainer_param_groups(ours)
        for fg in fgs:
            base = fg.flat.data_ptr()
            es = fg.flat.element_size()
            for p, off in zip(fg.params, fg.layout["offsets"]):
                assert p.data_ptr() == base + off * es
            assert fg.report["bytes_read"] > 0 and fg.master is None
        assert sum(len(fg.params) for fg in fgs) == len(list(ours.parameters()))


def _save_bin(model, path, shards=1):
    """What save_pretrained(safe_serialization=False) wrote: config.json and the state dict
    torch.save'd (tied weights both, sharing one storage), whole or in `shards` files listed by
    pytorch_model.bin.index.json."""
    import json

    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    state = model.state_dict()
    if shards == 1:
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        return path
    names = list(state)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        name = f"pytorch_model-{k + 1:05d}-of-{shards:05d}.bin"
        torch.save({n: state[n] for n in part}, os.path.join(path, name))
        weight_map.update({n: name for n in part})
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def test_a_torch_saved_checkpoint_loads_as_transformers_loads_it(tmp_path):
    """pytorch_model.bin, whole or in shards with its index (tied embeddings saved under both
    names, one storage), read by the restricted reader: the same model as Transformers' own load
    of the folder, and `zeroflat load` reads it and verifies every tensor. A file whose pickle
    names code is refused naming the global (the code never runs); a training checkpoint that
    keeps its state dict under a key, and a tensor saved as a view that is not contiguous, are
    refused naming the entry."""
    import subprocess

    from test_torch_file import cli_path

    import json

    def cli(*args):
        r = subprocess.run([str(cli_path()), *args], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_dense(tie=True), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "st")  # the tied head saved once
    counted = json.loads(cli("inspect", str(tmp_path / "st"), "--json"))
    for shards in (1, 3):
        path = _save_bin(model, str(tmp_path / f"bin{shards}"), shards)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, None, torch.bfloat16,
                                           device="cpu")
        same_model(ref, ours)
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
        cli("load", path, "--dp", "2", "--verify", "--quiet")
        # In one file the tied head's second name is an alias of the same bytes, not a tensor of
        # its own: the same tensors and parameters as the safetensors copy. (Shards saved
        # apart each hold their own copy: two tensors.)
        got = json.loads(cli("inspect", path, "--json"))
        extra = 0 if shards == 1 else 1
        assert (got["tensors"], got["numel"]) == (counted["tensors"] + extra,
                                                  counted["numel"] + extra * 300 * 40), got
    # A file given by name, and a folder where another .safetensors (an adapter) lies beside
    # pytorch_model.bin: the model is the .bin, as Transformers takes it.
    single = json.loads(cli("layout", "--model", str(tmp_path / "bin1" / "pytorch_model.bin"),
                            "--dp", "2", "--json"))
    assert single["numel"] == counted["numel"]
    from safetensors.torch import save_file
    save_file({"lora": torch.zeros(2)}, str(tmp_path / "bin1" / "adapter_model.safetensors"))
    assert json.loads(cli("inspect", str(tmp_path / "bin1"), "--json"))["numel"] == \
        counted["numel"]
    # Transformers' order: pytorch_model.bin before older shards with their index, and before
    # model-*.safetensors that no index lists (each holding other values here).
    other = AutoModelForCausalLM.from_config(tiny_dense(tie=True), dtype=torch.bfloat16)
    _save_bin(other, str(tmp_path / "other"), 3)
    for f in (tmp_path / "other").glob("pytorch_model*"):  # its shards and their index
        shutil.copy(f, tmp_path / "bin1" / f.name)
    save_file({k: v.contiguous() for k, v in other.state_dict().items()
               if k != "lm_head.weight"},
              str(tmp_path / "bin1" / "model-00001-of-00001.safetensors"))
    path = str(tmp_path / "bin1")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, None, torch.bfloat16,
                                       device="cpu")
    same_model(ref, ours)
    assert torch.equal(ours.get_input_embeddings().weight, model.get_input_embeddings().weight)
    bad = tmp_path / "bad"
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    state = dict(model.state_dict())
    cases = [({**state, "x": Payload()}, "posix system"),
             ({**state, "": torch.zeros(1)}, "a tensor is named ''"),
             ({**state, "__metadata__": torch.zeros(1)}, "a tensor is named '__metadata__'"),
             ({"model": state}, "'model' is a dict, not a tensor"),
             ({**state, "lm_head.weight": state["lm_head.weight"].t()},
              "'lm_head.weight' [40, 300] is stored as a view that is not contiguous")]
    for saved, words in cases:
        shutil.rmtree(bad, ignore_errors=True)
        bad.mkdir()
        model.config.save_pretrained(bad)
        torch.save(saved, bad / "pytorch_model.bin")
        with pytest.raises(zeroflat.Error, match=re.escape(words)):
            zeroflat.hf.from_pretrained(AutoModelForCausalLM, str(bad), None, torch.bfloat16,
                                        device="cpu")
        assert not marker.exists()


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


def _edit_checkpoint(src, dst, edit, config=None):
    """A copy of checkpoint ``src`` in ``dst`` with ``edit(tensors)`` applied to every shard's
    tensors (in place) and ``config`` merged into its config.json."""
    import json

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(dst, name))
            edit(tensors)
            save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})
    if config:
        with open(os.path.join(dst, "config.json")) as f:
            doc = json.load(f)
        doc.update(config)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(doc, f)
    return dst


def test_an_expert_stored_transposed_is_refused_as_transformers_refuses_it(checkpoints, tmp_path):
    """One expert of a stacked MoE parameter stored transposed, or flattened to another shape,
    holds the right number of elements: Transformers refuses the checkpoint, and so does
    zeroflat, naming the tensor, before anything is read."""
    bad = "model.layers.1.mlp.experts.2.gate_proj.weight"
    for how, change in (("transposed", lambda t: t.t()), ("reshaped", lambda t: t.reshape(48, 24))):
        def edit(tensors):
            if bad in tensors:
                tensors[bad] = change(tensors[bad]).contiguous()
        path = _edit_checkpoint(checkpoints["moe"], tmp_path / how, edit)
        with pytest.raises(Exception):
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=bad.replace(".", r"\.") + ".*transposed"):
            zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, None, torch.bfloat16,
                                        device="cpu")


def test_tied_embeddings_the_checkpoint_holds_apart_are_untied_as_transformers_does(tmp_path):
    """A config that ties the embeddings with a checkpoint holding a different lm_head:
    Transformers (5.x) keeps them untied, each with its own values, and so does zeroflat (the
    same parameters and logits); holding the same values, both tie them."""
    untied = write(tiny_dense(tie=False), str(tmp_path / "untied"), torch.bfloat16, seed=3)
    path = _edit_checkpoint(untied, tmp_path / "tie_config", lambda t: None,
                            {"tie_word_embeddings": True})
    x = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(1))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert ref.config.tie_word_embeddings
    assert ref.lm_head.weight is not ref.model.embed_tokens.weight  # what Transformers does
    ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, None, torch.bfloat16,
                                       device="cpu")
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    same_model(ref, ours)
    assert torch.equal(ref(x).logits, ours(x).logits)
    # lm_head is a parameter of its own in the Trainer's groups, hence in a buffer.
    assert any(p is ours.lm_head.weight for fg in ours.zeroflat_groups for p in fg.params)
    assert "lm_head.weight" not in getattr(ours, "all_tied_weights_keys", {})

    from safetensors.torch import load_file

    embed = next(t["model.embed_tokens.weight"] for t in (
        load_file(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        if "model.embed_tokens.weight" in t)

    def same_values(tensors):
        if "lm_head.weight" in tensors:
            tensors["lm_head.weight"] = embed.clone()

    path = _edit_checkpoint(path, tmp_path / "same", same_values)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, None, torch.bfloat16,
                                       device="cpu")
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    same_model(ref, ours)


# --- with DeepSpeed -----------------------------------------------------------------------------

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

    # The test's partitions are small: the drop-in's host copies take them all.
    zd._FastHostCopies.kMinBytes = 1
    cases = [(2, False, False), (1, True, True), (2, True, True)] if world == 2 else \
        [(1, False, False), (2, True, True)]
    for k, (stage, rr, trainer_groups) in enumerate(cases):
        where = f"world {world} rank {rank} stage {stage} rr {rr} trainer {trainer_groups}"
        plain_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        plain, po = engine_of(plain_model, stage, rr, trainer_groups)
        before = dict(zd.stats)
        # The first case loads with the drop-in in place, which builds the fp32 master partitions
        # during the load ("auto"); the others ask for them, or (the last) not.
        if k == 0:
            zd.install()
        master = {0: "auto", len(cases) - 1: None}.get(k, torch.float32)
        try:
            model = zeroflat.hf.from_pretrained(
                AutoModelForCausalLM, path, dtype=torch.bfloat16, device="cpu", round_robin=rr,
                param_groups="trainer" if trainer_groups else None, master_dtype=master)
        finally:
            zd.uninstall()
        loaded = [fg.flat for fg in model.zeroflat_groups]
        assert all(fg.master is None for fg in model.zeroflat_groups)
        zd.install()
        try:
            ours, oo = engine_of(model, stage, rr, trainer_groups)
        finally:
            zd.uninstall()
        groups = len(po.bit16_groups_flat)
        assert zd.stats["adopted"] == before["adopted"] + groups, (where, zd.stats)
        # The optimizer took the masters the load built, or made them where none was built.
        taken = zd.stats["masters_taken"] - before["masters_taken"]
        assert taken == (groups if master is not None else 0), (where, taken)
        # Every rank loaded the same bytes: DeepSpeed's broadcast of the model was left out.
        assert zd.stats["broadcasts_skipped"] == before["broadcasts_skipped"] + (world > 1), where
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
    if world == 1:
        # A partition changed after the load (through .data, which torch's version counters do
        # not see): its master is made again from it, not taken.
        model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, dtype=torch.bfloat16,
                                            device="cpu", master_dtype=torch.float32,
                                            param_groups=None)
        last = list(model.parameters())[-1]
        last.data.view(-1)[-1] += 1
        taken, adopted = zd.stats["masters_taken"], zd.stats["adopted"]
        with zd.installed():
            _, opt = engine_of(model, 2, False, False)
        assert zd.stats["adopted"] == adopted + 1
        assert zd.stats["masters_taken"] == taken
        (fp32,) = opt.single_partition_of_fp32_groups
        (bit16,) = opt.parallel_partitioned_bit16_groups
        assert torch.equal(fp32, bit16[0].float())
    if world == 2:
        # One rank's parameters differ: the checksums disagree, DeepSpeed's broadcast runs, and
        # every rank starts from rank 0's values, as without the drop-in.
        model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, dtype=torch.bfloat16,
                                            device="cpu")
        first = next(model.parameters())
        want = first.detach().clone()
        if rank == 1:
            with torch.no_grad():
                first.add_(1)
        skipped = zd.stats["broadcasts_skipped"]
        with zd.installed():
            engine_of(model, 2, False, False)
        assert zd.stats["broadcasts_skipped"] == skipped
        assert torch.equal(first.detach(), want), rank
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    end_rank()


@pytest.mark.parametrize("world", [1, 2])
def test_deepspeed_adopts_the_loaded_buffers_and_trains_the_same(checkpoints, world):
    pytest.importorskip("deepspeed")

    start_ranks(worker, world, checkpoints["moe"], preload=("transformers",))


TRAINER_SCRIPT = """
import contextlib, os, sys, json, torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
import zeroflat.deepspeed, zeroflat.hf
path, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "zeroflat":  # the changed line
    model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path)
elif mode == "one_group":  # laid out for one group, which the Trainer's optimizer does not have
    model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, param_groups=None)
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
drop_in = zeroflat.deepspeed.installed() if mode != "transformers" else contextlib.nullcontext()
with drop_in:  # DeepSpeed initializes inside train()
    trainer.train()
zd = zeroflat.deepspeed
print(json.dumps({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                  "adopted": zd.stats["adopted"], "fallbacks": zd.stats["fallbacks"],
                  "not_adopted": zd.stats["not_adopted"]}))
"""


def test_a_trainer_script_changes_one_line(checkpoints, tmp_path):
    """The Transformers Trainer with DeepSpeed ZeRO-2 (one process, CPU): the model from
    zeroflat.hf.from_pretrained trains exactly as the one from Transformers, and DeepSpeed
    adopts both of the Trainer's groups' buffers. Loaded for one group instead, the buffers
    meet the Trainer's two groups: they are copied, and one warning says how the groups differ,
    how many bytes were copied and which param_groups would have matched."""
    pytest.importorskip("deepspeed")
    import json
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(TRAINER_SCRIPT)
    results, logs = {}, {}
    for mode in ("transformers", "zeroflat", "one_group"):
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
        run = subprocess.run([sys.executable, str(script), checkpoints["moe"], mode,
                              str(tmp_path)], capture_output=True, text=True, env=env,
                             timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        results[mode] = json.loads(run.stdout.strip().splitlines()[-1])
        logs[mode] = run.stderr
    assert len(results["zeroflat"]["losses"]) == 3
    assert results["zeroflat"]["losses"] == results["transformers"]["losses"]
    assert results["zeroflat"]["adopted"] == 2 and results["zeroflat"]["fallbacks"] == 0
    assert results["zeroflat"]["not_adopted"] == []
    assert "did not adopt" not in logs["zeroflat"]

    one = results["one_group"]
    assert one["losses"] == results["transformers"]["losses"]
    assert one["adopted"] == 0 and one["fallbacks"] == 0
    (warning,) = one["not_adopted"]
    assert "2 of 2 param groups did not adopt" in warning
    assert "the optimizer has 2 groups" in warning and "laid out for 1 group" in warning
    assert 'param_groups="trainer"' in warning
    copied = int(warning.split("their ")[1].split(" bytes")[0])
    assert copied >= sum(p.numel() * 2 for p in AutoModelForCausalLM.from_pretrained(
        checkpoints["moe"]).parameters())
    assert logs["one_group"].count("did not adopt the buffers zeroflat loaded") == 1
