#!/usr/bin/env python3
"""zeroflat's loads against Transformers' own, family by family: for each model family a tiny
random model is written by save_pretrained (bf16; --bin: as pytorch_model.bin), then loaded by
Transformers and by zeroflat through each path asked for, and compared bit for bit (every
parameter and buffer, non-persistent ones too, which weights are tied, one batch's logits where
the model runs on the CPU). Prints one row per family and path; exit 1 when any differs.

    .venv/bin/python scripts/architecture_check.py [--families a,b,...] [--paths zero,zero3,fsdp2]
        [--bin]

Paths: "zero" (zeroflat.hf.from_pretrained, one process; ZeRO-1/2's buffers), "zero3" (the same
under DeepSpeed ZeRO-3, one process, against Transformers' ZeRO-3 load: each ds_tensor), "fsdp2"
(from_pretrained(distributed_config=fsdp_size 2), two processes on gloo, against Transformers'
FSDP2 load: every rank's local shards). Run with PYTHONPATH=build/python.

Known differences, by design (docs/python.md): under "zero", parameters Transformers keeps in
fp32 in a bf16 model (_keep_in_fp32_modules_strict: the routers of deepseek_v3, glm4_moe,
ernie4_5_moe) take the model's dtype, as DeepSpeed's engines cast them.
"""

import argparse
import logging
import os
import socket
import sys
import tempfile

# Small sizes every family accepts, and what a family needs besides (its own names for the
# sizes, an expert count, a pad id inside the vocabulary).
_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=1000, max_position_embeddings=128)
FAMILIES = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16}, "gemma3_text": {"head_dim": 16}, "phi": {},
    "phi3": {"pad_token_id": 0}, "gpt2": {"n_positions": 128}, "opt": {},
    "gptj": {"rotary_dim": 8, "bos_token_id": 0, "eos_token_id": 0}, "gpt_neox": {},
    "bloom": {}, "falcon": {}, "olmo2": {}, "stablelm": {}, "starcoder2": {}, "cohere": {},
    "granite": {}, "mpt": {}, "xglm": {}, "biogpt": {}, "codegen": {}, "gpt_bigcode": {},
    "smollm3": {"pad_token_id": 0}, "llama4_text": {}, "exaone4": {}, "seed_oss": {},
    "mixtral": {"num_local_experts": 4},
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
                  "shared_expert_intermediate_size": 32},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2}, "granitemoe": {}, "gpt_oss": {},
    "deepseek_v3": {"n_routed_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                    "num_key_value_heads": 4, "n_group": 1, "topk_group": 1},
    "glm4_moe": {"n_routed_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "head_dim": 16},
    "ernie4_5_moe": {"moe_num_experts": 4, "moe_intermediate_size": 32, "moe_k": 2},
    "qwen3_next": {"num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
                   "shared_expert_intermediate_size": 32, "head_dim": 16,
                   "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    "mamba": {}, "falcon_mamba": {}, "jamba": {}, "bamba": {}, "recurrent_gemma": {},
}

# Under "zero" every parameter is the model's dtype, where Transformers keeps some in fp32: the
# modules its class names (DeepSeek-V3's router) and those __init__ makes in fp32 whatever the
# dtype (Transformers 4's Mamba A_log); docs/python.md says why (DeepSpeed's engines cast them).


def tiny_config(auto_config, family):
    return auto_config.for_model(family, **dict(_BASE, **FAMILIES[family]))


def compare(ref, ours, vocab, fp32_cast=False):
    """What differs between two loaded models: parameters (local shards of DTensors), buffers,
    tied weights, logits; an empty list when nothing does. ``fp32_cast``: a parameter
    Transformers holds in fp32 may be ours in the model's dtype, the same values (above)."""
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    out = []
    want = dict(ref.named_parameters(remove_duplicate=False))
    got = dict(ours.named_parameters(remove_duplicate=False))
    if want.keys() != got.keys():
        out.append(f"parameter names: {sorted(want.keys() ^ got.keys())[:4]}")
    for name in want.keys() & got.keys():
        a, b = local(want[name]), local(got[name])
        if fp32_cast and a.dtype == torch.float32 and b.dtype != a.dtype:
            a = a.to(b.dtype)
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            out.append(f"parameter {name}")
    wb, gb = dict(ref.named_buffers()), dict(ours.named_buffers())
    if wb.keys() != gb.keys():
        out.append(f"buffer names: {sorted(wb.keys() ^ gb.keys())[:4]}")
    for name in wb.keys() & gb.keys():
        if wb[name].dtype != gb[name].dtype or not torch.equal(wb[name], gb[name]):
            out.append(f"buffer {name}")
    for m in (ref, ours):
        head = m.get_output_embeddings()
        m._zf_tied = head is not None and head.weight is m.get_input_embeddings().weight
    if ref._zf_tied != ours._zf_tied:
        out.append(f"tied: Transformers {ref._zf_tied}, zeroflat {ours._zf_tied}")
    if not any(hasattr(p, "to_local") for p in want.values()):
        x = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(1))
        try:
            with torch.no_grad():
                same = torch.equal(ref(x, use_cache=False).logits,
                                   ours(x, use_cache=False).logits)
        except Exception as e:  # noqa: BLE001 - a family that does not run here: not compared
            same = f"not run ({type(e).__name__})"
        if same is False:
            out.append("logits")
    return out


def _quiet():
    """Transformers' warnings and progress bars off: the rows are the report."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - another release: its bars stay
        pass


def _write(family, root, as_bin):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = tiny_config(AutoConfig, family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    path = os.path.join(root, family)
    if as_bin:
        os.makedirs(path)
        config.save_pretrained(path)
        torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
    else:
        model.save_pretrained(path)
    return path, config.vocab_size


def _zero(family, path, vocab):
    import torch
    from transformers import AutoModelForCausalLM

    import zeroflat.hf

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, None, torch.bfloat16,
                                       device="cpu")
    return compare(ref, ours, vocab, fp32_cast=True)


def _zero3(family, path, vocab):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import zeroflat.hf

    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3}}
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - Transformers holds it weakly
    ref = AutoModelForCausalLM.from_pretrained(path)
    ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path)
    out = []
    rank = torch.distributed.get_rank()
    for (name, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
        t = a.ds_tensor  # this rank's partition; the last rank's padding is not compared
        n = max(0, min(t.numel(), a.ds_numel - rank * t.numel()))
        if t.dtype != b.ds_tensor.dtype or not torch.equal(t[:n], b.ds_tensor[:n]):
            out.append(f"ds_tensor {name}")
    for (name, a), (_, b) in zip(ref.named_buffers(), ours.named_buffers()):
        if not torch.equal(a, b):
            out.append(f"buffer {name}")
    return out


def _fsdp2_rank(rank, world, port, jobs, results):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    import zeroflat.hf

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    _quiet()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = DistributedConfig(fsdp_size=world)
    for family, path, vocab in jobs:
        try:
            ref = AutoModelForCausalLM.from_pretrained(path, distributed_config=config,
                                                       dtype=torch.bfloat16)
            ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path,
                                               distributed_config=config, dtype=torch.bfloat16)
            diff = compare(ref, ours, vocab)
        except Exception as e:  # noqa: BLE001 - reported in the row
            diff = [f"error {type(e).__name__}: {str(e)[:200]}"]
        if rank == 0:
            results.put((family, diff))
        dist.barrier()
    dist.destroy_process_group()


def _fsdp2(jobs):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_fsdp2_rank, args=(2, port, jobs, results), nprocs=2,
                       start_method="spawn")
    out = {}
    while not results.empty():
        family, diff = results.get()
        out[family] = diff
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--paths", default="zero,zero3,fsdp2")
    ap.add_argument("--bin", action="store_true", help="write pytorch_model.bin, not safetensors")
    a = ap.parse_args()
    families = [f for f in a.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    paths = a.paths.split(",")
    if unknown or not set(paths) <= {"zero", "zero3", "fsdp2"}:
        ap.error(f"unknown families {unknown} or paths {paths}")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _quiet()
    root = tempfile.mkdtemp(prefix="zeroflat-architectures-")
    written = {}
    rows = []
    for family in families:
        try:
            written[family] = _write(family, root, a.bin)
        except Exception as e:  # noqa: BLE001 - Transformers cannot build it here
            rows.append((family, "-", f"not built: {type(e).__name__}: {str(e)[:120]}"))
    if {"zero", "zero3"} & set(paths):
        if "zero3" in paths:
            import torch.distributed as dist

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                              WORLD_SIZE="1", LOCAL_RANK="0")
            dist.init_process_group("gloo", rank=0, world_size=1)
        for path_name, check in (("zero", _zero), ("zero3", _zero3)):
            if path_name not in paths:
                continue
            for family, (path, vocab) in written.items():
                try:
                    diff = check(family, path, vocab)
                except Exception as e:  # noqa: BLE001 - reported in the row
                    diff = [f"error {type(e).__name__}: {str(e)[:200]}"]
                rows.append((family, path_name, "; ".join(diff[:3]) or "same"))
                print(f"{family:16} {path_name:6} {rows[-1][2]}", flush=True)
    if "fsdp2" in paths:
        for family, diff in _fsdp2([(f, p, v) for f, (p, v) in written.items()]).items():
            rows.append((family, "fsdp2", "; ".join(diff[:3]) or "same"))
            print(f"{family:16} fsdp2  {rows[-1][2]}", flush=True)
    bad = [r for r in rows if r[2] != "same"]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} the same as Transformers' load")
    for r in bad:
        print(f"  {r[0]} ({r[1]}): {r[2]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
