"""deepspeed.initialize (ZeRO-2, bf16, CPU accelerator) with and without the zeroflat drop-in,
for a scaled-down Qwen3-30B-A3B-shaped model (random weights), at 1 and 2 ranks on this machine.

    PYTHONPATH=build/python .venv/bin/python benchmarks/deepspeed_init_bench.py [--layers 2]
        [--experts 8] [--vocab 32768] [--ranks 1,2] [--repeat 5] [--warm-gib 8] [--json]

Each rank times deepspeed.initialize between barriers, and the flatten step inside it (entered
by the ranks together, after an untimed barrier, so that neither way counts the ranks' skew),
plain DeepSpeed then the drop-in, in a fresh set of processes per round, the median (or --stat
best) of --repeat; the script prints per rank count the slowest rank's times and their ratio
(plain / drop-in: above 1 means the drop-in is faster). On the CPU, DeepSpeed's flatten is
torch.cat run by every rank with torch's threads; zeroflat splits the cores among the ranks.
--vocab 151936 gives a shape whose bytes sit mostly in two large tensors (the embedding and the
head).
"""

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


class Qwen3MoeShaped(torch.nn.Module):
    """The tensors of Qwen3-30B-A3B's decoder (hidden 2048, 32 query and 4 key/value heads of
    128, experts of 768), fewer layers and experts, and a smaller vocabulary if asked."""

    def __init__(self, layers, experts, vocab, dtype):
        super().__init__()
        h, heads, kv, hd, inter = 2048, 32, 4, 128, 768

        def p(*shape):
            return torch.nn.Parameter(torch.randn(*shape, dtype=dtype) * 0.02)

        self.params = torch.nn.ParameterList([p(vocab, h)])
        for _ in range(layers):
            self.params.extend([p(h), p(heads * hd, h), p(kv * hd, h), p(kv * hd, h),
                                p(h, heads * hd), p(hd), p(hd), p(h), p(experts, h)])
            for _ in range(experts):
                self.params.extend([p(inter, h), p(inter, h), p(h, inter)])
        self.params.extend([p(h), p(vocab, h)])

    def forward(self, x):  # not used: only initialization is timed
        return x


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, port, args, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch.distributed as dist

    import zeroflat.deepspeed as zd

    # torch's default: every rank takes all the cores, as DeepSpeed's ranks do.
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Opt

    best = {"deepspeed": float("inf"), "zeroflat": float("inf")}
    flatten_best = {"deepspeed": float("inf"), "zeroflat": float("inf")}
    tiers = set()
    # One round per process: DeepSpeed's engines keep global references (about 1.4 GB each
    # here, with or without the drop-in), so the rounds run in fresh processes (main()).
    spent = [0.0]

    def timed(fn):  # the flatten step inside initialize, whichever implementation is in place
        def wrapper(*a, **k):
            # The ranks enter together (untimed, both ways): the drop-in's flatten starts with a
            # collective, which would otherwise count the ranks' skew before it (DeepSpeed's own
            # ranks wait for each other later, in its broadcast).
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper
    for _ in range(1):
        for way in ("deepspeed", "zeroflat"):
            torch.manual_seed(0)
            model = Qwen3MoeShaped(args.layers, args.experts, args.vocab, torch.bfloat16)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if way == "zeroflat":
                zd.install()
            current = Opt.flatten_dense_tensors_aligned
            Opt.flatten_dense_tensors_aligned = timed(current)
            spent[0] = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            try:
                engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
            finally:
                Opt.flatten_dense_tensors_aligned = current
                zd.uninstall()
            dist.barrier()
            seconds = time.perf_counter() - t0
            # The slowest rank is what a user waits for.
            t = torch.tensor([seconds, spent[0]], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            best[way] = min(best[way], t[0].item())
            flatten_best[way] = min(flatten_best[way], t[1].item())
            del engine, model, opt
            gc.collect()  # DeepSpeed's engines hold reference cycles: free them before the next
    tiers.update(zd.stats["tiers"])
    if rank == 0:
        out.put({"ranks": world, "deepspeed_s": best["deepspeed"], "zeroflat_s": best["zeroflat"],
                 "ratio": best["deepspeed"] / best["zeroflat"],
                 "flatten_deepspeed_s": flatten_best["deepspeed"],
                 "flatten_zeroflat_s": flatten_best["zeroflat"],
                 "flatten_ratio": flatten_best["deepspeed"] / flatten_best["zeroflat"],
                 "zeroflat_tiers": sorted(tiers)})
    dist.destroy_process_group()


def warm(gib):
    """Touches gib GiB of memory once and frees it. On a virtual machine whose memory has not
    been touched since it booted, the first touch of a page also costs the hypervisor's fault,
    which would land on whichever side of a comparison happens to get such pages first."""
    if gib <= 0:
        return
    chunks = []
    for _ in range(int(gib)):
        chunks.append(torch.ones(1 << 30, dtype=torch.uint8))
    del chunks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warm-gib", type=int, default=8,
                    help="GiB of memory to touch once before measuring (0: none)")
    ap.add_argument("--stat", choices=("median", "best"), default="median",
                    help="how the rounds combine: the median (default) or the best of each time")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    probe = Qwen3MoeShaped(args.layers, args.experts, args.vocab, torch.bfloat16)
    n = sum(p.numel() for p in probe.parameters())
    tensors = len(list(probe.parameters()))
    del probe
    warm(args.warm_gib)
    ctx = mp.get_context("spawn")
    rows = []
    for world in [int(r) for r in args.ranks.split(",")]:
        rounds = []
        for _ in range(args.repeat):  # a fresh set of processes per round
            out = ctx.SimpleQueue()
            mp.spawn(worker, args=(world, free_port(), args, out), nprocs=world, join=True)
            rounds.append(out.get())
        pick = statistics.median if args.stat == "median" else min
        best = dict(rounds[0])
        for k in ("deepspeed_s", "zeroflat_s", "flatten_deepspeed_s", "flatten_zeroflat_s"):
            best[k] = pick([r[k] for r in rounds])
        best["zeroflat_tiers"] = sorted({t for r in rounds for t in r["zeroflat_tiers"]})
        best["stat"] = args.stat
        best["ratio"] = best["deepspeed_s"] / best["zeroflat_s"]
        best["flatten_ratio"] = best["flatten_deepspeed_s"] / best["flatten_zeroflat_s"]
        rows.append(best)
    if args.json:
        print(json.dumps({"tensors": tensors, "parameters": n, "bytes": 2 * n, "rows": rows}))
        return
    print(f"deepspeed.initialize, ZeRO-2 bf16 on the CPU: {tensors} tensors, {n:,} parameters "
          f"({2 * n / 1e9:.2f} GB), {args.layers} layers x {args.experts} experts, "
          f"{os.cpu_count()} cores")
    print(f"{'ranks':>5}  {'':>9}{'initialize':>22}  {'':>11}{'its flatten step':>22}  tiers")
    print(f"{'':>5}  {'DeepSpeed':>10} {'drop-in':>9} {'ratio':>7}  "
          f"{'DeepSpeed':>10} {'drop-in':>9} {'ratio':>7}")
    for r in rows:
        print(f"{r['ranks']:>5}  {r['deepspeed_s']:>9.2f}s {r['zeroflat_s']:>8.2f}s "
              f"{r['ratio']:>7.2f}  {r['flatten_deepspeed_s']:>9.3f}s "
              f"{r['flatten_zeroflat_s']:>8.3f}s {r['flatten_ratio']:>7.2f}  "
              f"{','.join(r['zeroflat_tiers'])}")
    print("ratio: DeepSpeed / drop-in (above 1: the drop-in is faster); slowest rank, "
          f"{args.stat} of {args.repeat} rounds")


if __name__ == "__main__":
    sys.exit(main())
