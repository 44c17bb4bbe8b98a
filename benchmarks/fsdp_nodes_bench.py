#!/usr/bin/env python3
"""FSDP2 with HSDP across simulated nodes: K nodes of R ranks, each node holding one replica of
the model sharded over its R ranks (Transformers' DistributedConfig(fsdp_size=R,
dp_replicate_size=K)), cold, both ways side by side:

  transformers  AutoModelForCausalLM.from_pretrained(path, distributed_config=...): each rank
                maps the files and takes its rows of each tensor; every node reads its whole
                replica from its storage
  zeroflat      zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, distributed_config=...):
                the replicas of each shard split its reading (fsdp.load's replicas="split") and
                complete one another over the network: each node reads 1/K

The nodes are rehearsed by scripts/nodes.py (root: per node a mount namespace, a copy of the
checkpoint, a block-I/O cgroup throttled to --bandwidth / K, with --link a network namespace
behind a shaped link). Every rank is a fresh process; the time of a round is the slowest
rank's, to ready (the call returned, then every local shard read once: Transformers' shards
are mappings of the files until touched). The kernel counts each node's disk reads against its
share (the checkpoint / K for zeroflat; Transformers' must read the whole replica).

    (as root) PYTHONPATH=build/python .venv/bin/python benchmarks/fsdp_nodes_bench.py
        [--nodes 2] [--ranks-per-node 2] [--bandwidth 200MB/s] [--link 1Gbit/s]
        [--layers 4] [--vocab 151936] [--repeat 3] [--save FILE]

Targets (issue "FSDP2"): ready >= 2 x Transformers', each node reading <= 1.05 x its share.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HARNESS = os.path.join(ROOT, "scripts", "nodes.py")
RESULT = "FSDP_NODES_RESULT "
WAYS = ("transformers", "zeroflat")


def rank_main(way, nodes, per_node):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    import zeroflat.hf

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    path = os.environ["NODES_CHECKPOINT"]
    config = DistributedConfig(fsdp_size=per_node, dp_replicate_size=nodes)
    # What both ways import while they load, imported first (not a load's cost).
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    t0 = time.perf_counter()
    if way == "zeroflat":
        model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path,
                                            distributed_config=config, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config,
                                                     dtype=torch.bfloat16)
    returned = time.perf_counter() - t0
    total = 0.0
    for p in model.parameters():  # every local shard read once: ready
        local = p.to_local() if hasattr(p, "to_local") else p
        total += float(local.detach().float().sum())
    ready = time.perf_counter() - t0
    report = getattr(model, "zeroflat_report", None) or {}
    dist.barrier()
    print(RESULT + json.dumps({"rank": dist.get_rank(), "seconds": ready, "returned": returned,
                               "checksum": total, "read_seconds": report.get("read_seconds"),
                               "assign_seconds": report.get("assign_seconds")}), flush=True)
    dist.destroy_process_group()
    return 0


def run(a, way, checkpoint, copies, cold=True):
    cmd = [sys.executable, HARNESS, "--nodes", str(a.nodes), "--ranks-per-node",
           str(a.ranks_per_node), "--checkpoint", checkpoint, "--copies-in", copies,
           "--timeout", str(a.timeout), "--json"]
    cmd += ["--cold"] if cold else ["--warm"]
    if a.bandwidth:
        cmd += ["--bandwidth", a.bandwidth]
    if a.link:
        cmd += ["--link", a.link]
    if a.cpus_per_node:
        cmd += ["--cpus-per-node", str(a.cpus_per_node)]
    cmd += ["--", sys.executable, os.path.abspath(__file__), "--rank", way,
            "--nodes", str(a.nodes), "--ranks-per-node", str(a.ranks_per_node)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout + 120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        sys.exit(f"{way}: the harness failed ({r.returncode}):\n{r.stdout[-3000:]}\n"
                 f"{r.stderr[-3000:]}")
    res = json.loads(r.stdout)
    ranks = [json.loads(line[len(RESULT):]) for n in res["per_node"] for e in n["ranks"]
             for line in e["stdout"].splitlines() if line.startswith(RESULT)]
    if len(ranks) != a.nodes * a.ranks_per_node:
        sys.exit(f"{way}: {len(ranks)} rank results:\n{r.stdout[-3000:]}")
    return res, ranks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__[__doc__.index("\n\n") + 2:])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--bandwidth", default="200MB/s",
                    help="the storage's total bandwidth, shared by the nodes ('' unthrottled)")
    ap.add_argument("--link", default="1Gbit/s", help="each node's network link ('' loopback)")
    ap.add_argument("--cpus-per-node", type=float, help="cores per node (default: unlimited)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--dir", help="where the checkpoint is kept between runs")
    ap.add_argument("--save", help="write the rounds as JSON to FILE")
    ap.add_argument("--rank", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        return rank_main(a.rank, a.nodes, a.ranks_per_node)
    sys.path.insert(0, HERE)
    from hf_load_bench import write_checkpoint

    root = a.dir or tempfile.mkdtemp(prefix="zeroflat-fsdp-nodes-")
    checkpoint = os.path.join(root, f"dense_{a.layers}_{a.vocab}")
    if not os.path.isdir(checkpoint):
        write_checkpoint(checkpoint, a.layers, 0, a.vocab)
    size = sum(os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint))
    copies = tempfile.mkdtemp(prefix="zeroflat-fsdp-nodes-copies-")
    print(f"fsdp_nodes_bench: {size / 1e9:.2f} GB, {a.nodes} nodes x {a.ranks_per_node} ranks "
          f"(HSDP: a replica per node), storage {a.bandwidth or 'unthrottled'}, link "
          f"{a.link or 'loopback'}", file=sys.stderr)
    # Every library both ways read, once, warm, so that the nodes' disk counts are the
    # checkpoint's.
    run(a, "zeroflat", checkpoint, copies, cold=False)
    run(a, "transformers", checkpoint, copies, cold=False)
    rounds = {w: [] for w in WAYS}
    for i in range(a.repeat):
        for way in (WAYS if i % 2 == 0 else WAYS[::-1]):
            res, ranks = run(a, way, checkpoint, copies)
            disk = [n["disk_read_bytes"] for n in res["per_node"]]
            rounds[way].append({"seconds": max(r["seconds"] for r in ranks),
                                "read_seconds": max((r["read_seconds"] or 0) for r in ranks),
                                "assign_seconds": max((r["assign_seconds"] or 0) for r in ranks),
                                "returned": max(r["returned"] for r in ranks),
                                "disk_x_share": max(d / (size / a.nodes) for d in disk),
                                "link_received": [n.get("link_received_bytes")
                                                  for n in res["per_node"]],
                                "checksum": sorted(r["checksum"] for r in ranks)})
            last = rounds[way][-1]
            parts = (f" (load to every rank read {last['read_seconds']:.2f} s, exchange and "
                     f"hand-over {last['assign_seconds']:.2f} s)" if way == "zeroflat" else "")
            print(f"  round {i + 1} {way}: {last['seconds']:.2f} s{parts}, node reads "
                  f"{last['disk_x_share']:.2f} x share", file=sys.stderr, flush=True)
    speed = [t["seconds"] / z["seconds"] for t, z in zip(rounds["transformers"],
                                                           rounds["zeroflat"])]
    med = {w: statistics.median(r["seconds"] for r in rounds[w]) for w in WAYS}
    same = rounds["zeroflat"][0]["checksum"] == rounds["transformers"][0]["checksum"]
    print(f"{a.nodes} x {a.ranks_per_node} HSDP, cold, storage {a.bandwidth or '-'}, link "
          f"{a.link or '-'}: transformers {med['transformers']:.2f} s "
          f"[{min(r['seconds'] for r in rounds['transformers']):.2f}-"
          f"{max(r['seconds'] for r in rounds['transformers']):.2f}], zeroflat "
          f"{med['zeroflat']:.2f} s [{min(r['seconds'] for r in rounds['zeroflat']):.2f}-"
          f"{max(r['seconds'] for r in rounds['zeroflat']):.2f}]: "
          f"{statistics.median(speed):.2f} x (rounds {', '.join(f'{x:.2f}' for x in speed)}); "
          f"node reads x share (the checkpoint / {a.nodes}): zeroflat "
          f"{max(r['disk_x_share'] for r in rounds['zeroflat']):.2f}, transformers "
          f"{max(r['disk_x_share'] for r in rounds['transformers']):.2f}; same values: {same}")
    if a.save:
        with open(a.save, "w") as f:
            json.dump({"size_bytes": size, "nodes": a.nodes, "ranks_per_node": a.ranks_per_node,
                       "bandwidth": a.bandwidth, "link": a.link, "rounds": rounds}, f, indent=1)
    met = min(speed) >= 2.0 and max(r["disk_x_share"] for r in rounds["zeroflat"]) <= 1.05
    print(f"targets (>= 2 x Transformers every round, node reads <= 1.05 x share): "
          f"{'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
