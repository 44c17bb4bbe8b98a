#!/usr/bin/env python3
"""Host memory of zeroflat.fsdp.load into a model built on the meta device (FSDP2 applied per
decoder layer and the root, an AdamW built before the load, no rank ever holding the whole
model): each rank's peak resident growth during the call (VmHWM reset just before it) against
its shards' bytes, printed as a ratio with the bound ``1.1 x shards + 256 MB``.

    benchmarks/fsdp_meta_memory_bench.py --world 2 --vocab 32000 --hidden 1024 --layers 6 \\
        --storage read

The checkpoint (a Qwen3 of the given shape, fp32, saved by Transformers) is written to a
temporary folder first. Run from a build: PYTHONPATH=build/python."""

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "tests"))


def _status():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def worker(rank, world, port, path, storage, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    import zeroflat.fsdp

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                 dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.optim.AdamW(model.parameters())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) from here
    before, _ = _status()
    report = zeroflat.fsdp.load(model, path, storage=storage)
    _, peak = _status()
    shards = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    row = {"rank": rank, "shards_MB": shards / 1e6, "peak_growth_MB": (peak - before) / 1e6,
           "x_shards": (peak - before) / shards, "bound_MB": (1.1 * shards + 256e6) / 1e6,
           "within": peak - before <= 1.1 * shards + 256e6,
           "read_is_share": report["bytes_read"] == report["share"]}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=0, help="default: 2.75 x hidden")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--storage", choices=("read", "map"), default="read")
    args = ap.parse_args()
    from reference import start_ranks
    from test_hf import write
    from transformers import Qwen3Config

    heads = max(1, args.hidden // 128)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate or int(args.hidden * 2.75),
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), head_dim=128,
                         tie_word_embeddings=False)
    root = tempfile.mkdtemp(prefix="zeroflat-meta-memory-")
    try:
        path = write(config, os.path.join(root, "model"), torch.float32)
        out = os.path.join(root, "result")
        start_ranks(worker, args.world, path, args.storage, out, preload=("transformers",))
        rows = []
        for r in range(args.world):
            with open(f"{out}.{r}") as f:
                rows.append(json.load(f))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'rank':>4} {'shards MB':>10} {'peak growth MB':>15} {'x shards':>9} "
          f"{'bound MB':>9} within")
    for row in rows:
        print(f"{row['rank']:>4} {row['shards_MB']:>10.1f} {row['peak_growth_MB']:>15.1f} "
              f"{row['x_shards']:>9.3f} {row['bound_MB']:>9.1f} {row['within']}")
    print(json.dumps(rows))
    return 0 if all(r["within"] and r["read_is_share"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
