"""The checkpoint loader (`zeroflat load`) against the read ceiling measured in the same run,
for one Qwen3-30B-A3B layer with 16 experts (about 1.43 GB in bf16), at 1 and 2 ranks, with
the checkpoint's files in the page cache (warm) and dropped from it first (cold).

    python3 benchmarks/loader_bench.py [--cli build/zeroflat] [--model qwen3-30b-a3b]
        [--layers 1] [--experts 16]
        [--stage 2] [--read-plan load] [--ranks 1,2] [--cache warm,cold] [--repeat 3] [--dir DIR]
        [--warm-gib 4]
        [--json]

--model is a catalog model or a Hugging Face config.json (a smaller vocabulary, say), as
`zeroflat write-checkpoint --model` takes it. It writes the checkpoint once (`zeroflat
write-checkpoint`, into --dir or a temporary directory removed at the end), then runs
`zeroflat load CHECKPOINT --dp P --stage S [--cold] --json` --repeat times per row, each a fresh
process. Every figure is bytes read per second, summed
over the ranks, over the slowest rank's time (GB = 1e9 bytes):
  load      the loader: each rank reads its partition's bytes straight into its slice of the
            flat buffer (fresh memory), conversion and padding included, all-gather excluded
            (--stage 3: each rank its own partition of every parameter, no all-gather)
  ceiling   the same number of bytes of the same files read sequentially by the same threads
            into fresh scratch memory, in the same process before the load and after it (the
            faster of the two)
  ratio     the median of the runs' load / ceiling (each run compares two reads made under the
            same conditions), the lowest and highest run beside it, and best load / best
            ceiling
The target: ratio >= 0.8, warm and cold, at 1 and 2 ranks.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def warm_memory(gib):
    """Touches gib GiB once: a virtual machine's first touch of a page also costs the
    hypervisor's fault, which would land on whichever read meets such pages first."""
    if gib <= 0:
        return
    block = bytearray(1 << 30)
    for _ in range(gib):
        block = bytearray(1 << 30)
        for i in range(0, len(block), 4096):
            block[i] = 1
    del block


def load_once(cli, ckpt, ranks, cold, stage=2, read_plan=None):
    cmd = [cli, "load", ckpt, "--dp", str(ranks), "--stage", str(stage), "--json", "--quiet"]
    if read_plan:
        cmd += ["--read-plan", read_plan]
    if cold:
        cmd.append("--cold")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip()}")
    doc = json.loads(out.stdout)
    return {
        "load": doc["read_gbps"],
        "ceiling": doc["ceiling"]["read_gbps"],
        "page_cache": doc["page_cache"],
        "ceiling_page_cache": doc["ceiling"]["page_cache"],
        "bytes_read": [r["bytes_read"] for r in doc["ranks"]],
        "partition_bytes": doc["partition_bytes"],
        "checkpoint_bytes": doc["checkpoint_bytes"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", default=os.path.join(HERE, "..", "build", "zeroflat"))
    ap.add_argument("--model", default="qwen3-30b-a3b",
                    help="a catalog model or a config.json (zeroflat write-checkpoint --model)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), default=2,
                    help="the ZeRO stage's buffers: 1 or 2 a slice of the flat buffer per rank, "
                         "3 each rank's partitions")
    ap.add_argument("--read-plan", help="ZeRO-1/2: load (each rank its slice, as across "
                                        "nodes) or load-whole; default the loader's choice")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--cache", default="warm,cold", help="warm, cold or both")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--warm-gib", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    ranks = [int(r) for r in args.ranks.split(",") if r]
    base = args.dir or tempfile.mkdtemp(prefix="zeroflat-loader-bench-")
    ckpt = os.path.join(base, "checkpoint")
    rows = []
    try:
        if not os.path.exists(ckpt):
            subprocess.run([args.cli, "write-checkpoint", ckpt, "--model", args.model,
                            "--layers", str(args.layers), "--experts", str(args.experts),
                            "--quiet"], check=True, stdout=subprocess.DEVNULL)
        warm_memory(args.warm_gib)
        caches = [c.strip() for c in args.cache.split(",") if c.strip()]
        if not caches or set(caches) - {"warm", "cold"}:
            ap.error("--cache takes warm, cold or both")
        for cold in [c == "cold" for c in caches]:
            for p in ranks:
                if not cold:
                    load_once(args.cli, ckpt, p, False, args.stage,
                              args.read_plan)  # the files into the page cache
                runs = [load_once(args.cli, ckpt, p, cold, args.stage, args.read_plan)
                        for _ in range(args.repeat)]
                ratios = [r["load"] / r["ceiling"] for r in runs if r["ceiling"] > 0]
                best_load = max(r["load"] for r in runs)
                best_ceiling = max(r["ceiling"] for r in runs)
                rows.append({
                    "ranks": p,
                    "cache": "cold" if cold else "warm",
                    "page_cache_seen": sorted({r["page_cache"] for r in runs}),
                    "load_gbps": best_load,
                    "ceiling_gbps": best_ceiling,
                    "ratio_median": statistics.median(ratios) if ratios else None,
                    "ratio_low": min(ratios) if ratios else None,
                    "ratio_high": max(ratios) if ratios else None,
                    "ratio_best": best_load / best_ceiling if best_ceiling else None,
                    "bytes_read_per_rank": runs[0]["bytes_read"],
                    "partition_bytes": runs[0]["partition_bytes"],
                    "checkpoint_bytes": runs[0]["checkpoint_bytes"],
                    "runs": runs,
                })
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return 0
    size = rows[0]["checkpoint_bytes"] / 1e9 if rows else 0
    print(f"zeroflat load: {args.model}, {args.layers} layer(s), {args.experts} experts "
          f"({size:.2f} GB bf16), ZeRO-{args.stage}, {args.repeat} runs a row (GB/s: the best)")
    print(f"{'ranks':>5} {'cache':>5} {'read/rank':>10} {'load GB/s':>10} {'ceiling':>8} "
          f"{'ratio':>6} {'(runs)':>11} {'best/best':>9}  target >= 0.8")
    met = True
    for r in rows:
        ok = r["ratio_median"] is not None and r["ratio_median"] >= 0.8
        met = met and ok
        print(f"{r['ranks']:>5} {r['cache']:>5} {max(r['bytes_read_per_rank']) / 1e9:>9.2f}G "
              f"{r['load_gbps']:>10.2f} {r['ceiling_gbps']:>8.2f} {r['ratio_median']:>6.2f} "
              f"({r['ratio_low']:.2f}-{r['ratio_high']:.2f}) "
              f"{r['ratio_best']:>9.2f}  {'met' if ok else 'NOT met'}"
              f"{'' if r['page_cache_seen'] == [r['cache']] else '  (page cache seen: ' + ', '.join(r['page_cache_seen']) + ')'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
