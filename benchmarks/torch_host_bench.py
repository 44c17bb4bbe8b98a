"""zeroflat.flatten_param_group on the CPU (torch tensors, through the binding) against
`zeroflat run` (the CLI's own buffers) for the same model, side by side, and against
torch.cat (DeepSpeed's flatten) of the same tensors.

    PYTHONPATH=build/python .venv/bin/python benchmarks/torch_host_bench.py [--layers 1]
        [--experts 16] [--repeat 3] [--warm-gib 8] [--json]

Every figure is bytes of the flat buffer per second, end to end (allocation and first touch
included), best of --repeat, the same threads (all of this machine's cores, one rank):
  run             `zeroflat run --model qwen3-30b-a3b ...`'s end_to_end_gbps (its tier run again
                  into fresh memory, best of its own --repeat rounds)
  python          flatten_param_group of the same shapes (bf16), master_dtype None: the whole
                  call, releasing the original tensors included
  python steps    the same call's tier steps without the release of the originals (run's
                  rounds run the tier with its views standing in for the originals: they
                  release nothing), the comparison the target is about
  torch.cat       torch._utils._flatten_dense_tensors of the same tensors
and, for the fp32 master partition, GB/s of fp32 written: the call's own (master_dtype
float32, built by the engine's threads into fresh huge pages) against torch's .float() of the
same partition.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import zeroflat

HERE = os.path.dirname(os.path.abspath(__file__))


def qwen3_shapes(layers, experts):
    """qwen3-30b-a3b's tensors in registration order, as the catalog builds them."""
    hidden, heads, kv, hd, inter, vocab = 2048, 32, 4, 128, 768, 151936
    out = [(vocab, hidden)]
    for _ in range(layers):
        out += [(heads * hd, hidden), (kv * hd, hidden), (kv * hd, hidden), (hidden, heads * hd),
                (hd,), (hd,), (experts, hidden)]
        for _ in range(experts):
            out += [(inter, hidden), (inter, hidden), (hidden, inter)]
        out += [(hidden,), (hidden,)]
    out += [(hidden,), (vocab, hidden)]
    return out


def warm(gib):
    """Touches gib GiB once (a virtual machine's first touch of a page also costs the
    hypervisor's fault, which would land on whichever side meets such pages first)."""
    chunks = [torch.ones(1 << 30, dtype=torch.uint8) for _ in range(gib)]
    del chunks


def cli_gbps(args, cli):
    out = subprocess.run([cli, "run", "--model", "qwen3-30b-a3b", "--layers", str(args.layers),
                          "--experts", str(args.experts), "--repeat", str(args.repeat),
                          "--json", "--quiet"], check=True, capture_output=True, text=True)
    doc = json.loads(out.stdout)
    return doc["ranks"][0]["end_to_end_gbps"], doc["flat_bytes"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warm-gib", type=int, default=8)
    ap.add_argument("--cli", default=os.path.join(HERE, "..", "build", "zeroflat"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    warm(args.warm_gib)
    shapes = qwen3_shapes(args.layers, args.experts)
    torch.manual_seed(0)
    source = [torch.randn(*s).to(torch.bfloat16) for s in shapes]
    best = {"python": 0.0, "python steps": 0.0, "torch.cat": 0.0}
    master = {"zeroflat": 0.0, "torch .float()": 0.0}
    run_gbps, flat_bytes = 0.0, 0
    for _ in range(args.repeat):
        g, flat_bytes = cli_gbps(args, args.cli)
        run_gbps = max(run_gbps, g)
        for way in ("python", "torch.cat"):
            params = [t.clone() for t in source]
            t0 = time.perf_counter()
            if way == "torch.cat":
                flat = torch._utils._flatten_dense_tensors(params)
            else:
                fg = zeroflat.flatten_param_group(params, None, trainable_only=False,
                                                  deepspeed=None, master_dtype=torch.float32)
                flat = fg.flat
            seconds = time.perf_counter() - t0
            if way == "python":
                rep = fg.report
                seconds -= rep["master_seconds"]
                release = sum(s for s, line in zip(rep["step_seconds"], rep["plan"]["steps"])
                              if "release the original" in line)
                best["python steps"] = max(best["python steps"],
                                           flat_bytes / (rep["seconds"] - release) / 1e9)
                master["zeroflat"] = max(master["zeroflat"],
                                         fg.master.numel() * 4 / rep["master_seconds"] / 1e9)
                t0 = time.perf_counter()
                up = fg.partition.float()
                master["torch .float()"] = max(master["torch .float()"],
                                               up.numel() * 4 / (time.perf_counter() - t0) / 1e9)
                del fg, up
            best[way] = max(best[way], flat_bytes / seconds / 1e9)
            del flat, params
    rows = {"run": run_gbps, **best}
    doc = {"tensors": len(shapes), "flat_bytes": flat_bytes, "threads": os.cpu_count(),
           "gbps": rows, "master_gbps": master,
           "python_over_run": best["python"] / run_gbps,
           "python_steps_over_run": best["python steps"] / run_gbps,
           "python_over_torch_cat": best["python"] / best["torch.cat"],
           "master_over_torch": master["zeroflat"] / master["torch .float()"]}
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"one rank, {len(shapes)} tensors, {flat_bytes / 1e9:.2f} GB bf16, best of "
          f"{args.repeat}, GB/s of the flat buffer end to end:")
    for k, v in rows.items():
        print(f"  {k:<14} {v:6.2f} GB/s  {v / run_gbps:5.2f} x zeroflat run")
    print(f"flatten_param_group / zeroflat run: {doc['python_steps_over_run']:.2f} (its tier "
          f"steps; target >= 0.85), {doc['python_over_run']:.2f} (the whole call); / torch.cat: "
          f"{doc['python_over_torch_cat']:.2f}")
    print(f"fp32 master partition, GB/s written: zeroflat {master['zeroflat']:.2f}, torch "
          f".float() {master['torch .float()']:.2f}: {doc['master_over_torch']:.2f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
