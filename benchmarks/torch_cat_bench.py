#!/usr/bin/env python3
"""torch.cat of the seed model's tensors on a GPU: the peer of zeroflat's device flatten.

DeepSpeed flattens a group with torch._utils._flatten_dense_tensors, i.e. torch.cat of flattened
views. For each model (tensor sizes from gpu_bench --numels FILE, or the qwen3-30b-a3b shape
rules of the built-in catalog) this times, with CUDA events, best of a few repetitions after a
warm-up:
  cat_out_ms        torch.cat into an existing buffer (the copy alone)
  flatten_warm_ms   _flatten_dense_tensors with its output block already cached by torch
  flatten_cold_ms   the same after torch.cuda.empty_cache(): a fresh allocation, as at init
and prints one JSON document on stdout.
"""
import argparse
import json
import sys


def qwen3_numels(layers):
    """qwen3-30b-a3b's tensors in registration order, as the catalog builds them."""
    hidden, heads, kv_heads, head_dim = 2048, 32, 4, 128
    experts, moe, vocab = 128, 768, 151936
    out = [vocab * hidden]
    for _ in range(layers):
        out += [heads * head_dim * hidden, kv_heads * head_dim * hidden,
                kv_heads * head_dim * hidden, hidden * heads * head_dim, head_dim, head_dim,
                experts * hidden]
        for _ in range(experts):
            out += [moe * hidden, moe * hidden, hidden * moe]
        out += [hidden, hidden]
    out += [hidden, vocab * hidden]
    return out


def best_of(reps, fn, torch, setup=None):
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)

    def once():
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        start.record()
        result = fn()
        stop.record()
        stop.synchronize()
        del result
        return start.elapsed_time(stop)

    once()
    return min(once() for _ in range(reps))


def bench(name, numels, reps, torch):
    dev = torch.device("cuda:0")
    tensors = [torch.empty(n, dtype=torch.bfloat16, device=dev) for n in numels]
    total = sum(numels)
    row = {"name": name, "tensors": len(numels), "bytes": 2 * total}
    flat = torch.empty(total, dtype=torch.bfloat16, device=dev)
    row["cat_out_ms"] = best_of(reps, lambda: torch.cat(tensors, out=flat), torch)
    del flat
    flatten = torch._utils._flatten_dense_tensors
    row["flatten_warm_ms"] = best_of(reps, lambda: flatten(tensors), torch)

    # The cached output block is handed back to CUDA before each timed call (not inside it), so
    # the call pays for a fresh allocation, as the first flatten of an init does.
    row["flatten_cold_ms"] = best_of(max(1, reps // 2), lambda: flatten(tensors), torch,
                                     setup=torch.cuda.empty_cache)
    del tensors
    torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numels", help="JSON {name: [numel, ...]} written by gpu_bench")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"error": f"no torch: {e}"}))
        return 1
    if not torch.cuda.is_available():
        print(json.dumps({"error": "torch sees no CUDA device"}))
        return 1
    models = None
    if args.numels:
        try:
            with open(args.numels) as f:
                models = json.load(f)
        except (OSError, ValueError) as e:
            print(f"torch_cat_bench: {args.numels}: {e}; using the built-in shapes",
                  file=sys.stderr)
    if not models:
        models = {f"qwen3-30b-a3b, {n} layers": qwen3_numels(n) for n in (4, 32)}
    free, _ = torch.cuda.mem_get_info()
    rows = []
    for name, numels in models.items():
        need = 2 * sum(numels) * 2
        if need + (2 << 30) > free:
            why = f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
            rows.append({"name": name, "error": why})
            continue
        reps = args.reps if need < (20 << 30) else max(2, args.reps // 2)
        print(f"torch_cat_bench: {name}: {len(numels)} tensors", file=sys.stderr)
        rows.append(bench(name, numels, reps, torch))
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                      "card": torch.cuda.get_device_name(0), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
