"""deepspeed.initialize (ZeRO-2, bf16, CPU accelerator) with and without the zeroflat drop-in,
for a scaled-down Qwen3-30B-A3B-shaped model (random weights), at 1 and 2 ranks on this machine.

    PYTHONPATH=build/python .venv/bin/python benchmarks/deepspeed_init_bench.py [--layers 2]
        [--experts 8] [--vocab 32768] [--ranks 1,2] [--repeat 5] [--warm-gib 8] [--json]

Each rank times deepspeed.initialize between barriers, and the flatten step inside it (entered
by the ranks together, after an untimed barrier, so that neither way counts the ranks' skew):
the flat buffer built and the parameters re-pointed into it, which frees their own memory
(DeepSpeed does the second part apart, the drop-in in its flatten),
plain DeepSpeed and the drop-in each in a fresh set of processes of its own, in alternating order,
--repeat rounds; the script prints per rank count the slowest rank's times, their median (or
--stat best) and ratio (plain / drop-in: above 1 means the drop-in is faster), and the range of
the rounds' ratios. DeepSpeed's one-time import of its Muon module is done before the timing.
On the CPU, DeepSpeed's flatten is
torch.cat run by every rank with torch's threads; zeroflat splits the cores among the ranks.
--vocab 151936 gives a shape whose bytes sit mostly in two large tensors (the embedding and the
head).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_load_bench import free_port, import_once  # noqa: E402

WAYS = ("deepspeed", "zeroflat")


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


def worker(rank, world, port, args, way, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch.distributed as dist

    import zeroflat.deepspeed as zd

    # torch's default: every rank takes all the cores, as DeepSpeed's ranks do.
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    import_once()  # kept out of the timing, as in the other benchmarks
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Opt

    spent = [0.0]

    def timed(fn, enter_together):  # a part of the flatten step, whichever implementation
        def wrapper(*a, **k):
            # The ranks enter together (untimed, both ways): the drop-in's flatten starts with a
            # collective, which would otherwise count the ranks' skew before it (DeepSpeed's own
            # ranks wait for each other later, in its broadcast).
            if enter_together and world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    torch.manual_seed(0)
    model = Qwen3MoeShaped(args.layers, args.experts, args.vocab, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if way == "zeroflat":
        zd.install()
    # The step: the flat buffer built, then the parameters re-pointed into it, which frees
    # their own memory (DeepSpeed's _update_model_bit16_weights; the drop-in has done both by
    # the time it returns the buffer, so the second part is nearly free there).
    Opt.flatten_dense_tensors_aligned = timed(Opt.flatten_dense_tensors_aligned, True)
    if hasattr(Opt, "_update_model_bit16_weights"):
        Opt._update_model_bit16_weights = timed(Opt._update_model_bit16_weights, False)
    dist.barrier()
    t0 = time.perf_counter()
    deepspeed.initialize(model=model, optimizer=opt, config=config)
    dist.barrier()
    seconds = time.perf_counter() - t0
    # The slowest rank is what a user waits for.
    t = torch.tensor([seconds, spent[0]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put({"init": t[0].item(), "flatten": t[1].item(),
                 "tiers": sorted(zd.stats["tiers"]) if way == "zeroflat" else []})
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
        runs = {"deepspeed": [], "zeroflat": []}
        for i in range(args.repeat):
            # Each way in a fresh set of processes of its own (DeepSpeed's engines keep global
            # references, and a process's second engine meets memory its first one left), the
            # order alternating from round to round.
            for way in (WAYS if i % 2 == 0 else WAYS[::-1]):
                out = ctx.SimpleQueue()
                mp.spawn(worker, args=(world, free_port(), args, way, out), nprocs=world,
                         join=True)
                runs[way].append(out.get())
        pick = statistics.median if args.stat == "median" else min
        row = {"ranks": world, "stat": args.stat, "rounds": args.repeat}
        for key, prefix in (("init", ""), ("flatten", "flatten_")):
            for way in WAYS:
                vals = [r[key] for r in runs[way]]
                row[f"{prefix}{way}_s"] = pick(vals)
                row[f"{prefix}{way}_range"] = [min(vals), max(vals)]
            row[f"{prefix}ratio"] = row[f"{prefix}deepspeed_s"] / row[f"{prefix}zeroflat_s"]
            # Each round's pair of runs, for the spread.
            pairs = [d[key] / z[key] for d, z in zip(runs["deepspeed"], runs["zeroflat"])]
            row[f"{prefix}ratio_range"] = [min(pairs), max(pairs)]
        row["zeroflat_tiers"] = sorted({t for r in runs["zeroflat"] for t in r["tiers"]})
        rows.append(row)
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
        lo, hi = r["ratio_range"]
        flo, fhi = r["flatten_ratio_range"]
        print(f"{r['ranks']:>5}  {r['deepspeed_s']:>9.2f}s {r['zeroflat_s']:>8.2f}s "
              f"{r['ratio']:>7.2f} ({lo:.2f}-{hi:.2f})  {r['flatten_deepspeed_s']:>9.3f}s "
              f"{r['flatten_zeroflat_s']:>8.3f}s {r['flatten_ratio']:>7.2f} ({flo:.2f}-{fhi:.2f})"
              f"  {','.join(r['zeroflat_tiers'])}")
    print("ratio: DeepSpeed / drop-in (above 1: the drop-in is faster); slowest rank, "
          f"{args.stat} of {args.repeat} rounds, each way in processes of its own; in brackets "
          "the range of the rounds' ratios")


if __name__ == "__main__":
    sys.exit(main())
