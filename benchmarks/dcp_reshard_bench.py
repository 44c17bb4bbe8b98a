#!/usr/bin/env python3
"""A DCP checkpoint (``.metadata`` + ``.distcp``: what torch.distributed.checkpoint.save writes)
of a model and its AdamW state, saved by FSDP2 at --save-ranks ranks and loaded at each of
--ranks, both ways side by side, every side in fresh processes (gloo on the CPU, one thread per
rank), cold and warm, median of --repeat rounds with the range and every round's speedup:

  dcp       torch.distributed.checkpoint.load(state, storage_reader=FileSystemReader(path)),
            then set_state_dict: DCP's own reader (one torch.load per requested item, whole)
  zeroflat  the same call with storage_reader=zeroflat.dcp.Reader(path)

Both fill the same sharded model and optimizer, built first (untimed, as is get_state_dict,
which creates the optimizer's states), and a garbage collection runs before the clock starts.
The time of a row is its slowest rank's. Per rank it
counts the bytes read through read()/pread() (/proc/self/io rchar; cold: read_bytes, the
kernel's from storage) against the rank's share (the bytes of its local shards and states),
and checks that both ways leave every rank with the same values (a digest).

The model: an fp32 embedding of --vocab rows of --hidden, --layers MLP blocks (hidden ->
4 hidden -> hidden), an untied head. Targets (issue "FSDP2"): zeroflat >= 2x dcp, reads <= 1.1x
the share.

    dcp_reshard_bench.py --save-ranks 4 --ranks 2,3 --hidden 1024 --layers 8 --vocab 32000
    dcp_reshard_bench.py --quick
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_load_bench import drop_cache, free_port, gloo_rank, run_rank_job  # noqa: E402
from zero3_bench import proc_io  # noqa: E402

METHODS = ("dcp", "zeroflat")


def build(a, mesh):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(a["vocab"], a["hidden"])
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(a["hidden"], 4 * a["hidden"]),
                                    torch.nn.GELU(),
                                    torch.nn.Linear(4 * a["hidden"], a["hidden"]))
                for _ in range(a["layers"]))
            self.head = torch.nn.Linear(a["hidden"], a["vocab"], bias=False)

        def forward(self, x):
            h = self.embed(x)
            for layer in self.layers:
                h = h + layer(h)
            return self.head(h).float().logsumexp(-1).mean()

    with torch.device("meta"):
        model = Net()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def rank_main(rank, world, port, job):
    gloo_rank(rank, world, port)
    import gc
    import hashlib

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import zeroflat.dcp

    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(job, mesh)
    msd, osd = get_state_dict(model, opt)  # creates the optimizer's states: untimed
    state = {"model": msd, "optim": osd}
    if job["method"] == "save":
        model(torch.randint(0, job["vocab"], (2, 8))).backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=job["path"])
        out = {}
    else:
        share = 0
        for v in list(msd.values()) + [t for s in osd["state"].values() for t in s.values()]:
            if torch.is_tensor(v):
                local = v.to_local() if hasattr(v, "to_local") else v
                share += local.numel() * local.element_size()
        dist.barrier()
        if job["cold"] and rank == 0:
            drop_cache(job["path"])
        dist.barrier()
        reader = (dcp.FileSystemReader(job["path"]) if job["method"] == "dcp"
                  else zeroflat.dcp.Reader(job["path"], threads=job.get("threads")))
        # A full collection first: the model just built left some 300k objects that the first
        # collection of the oldest generation walks (0.1-0.2 s here), due at a moment that
        # depends on what each side allocates; neither side's load should pay for it.
        gc.collect()
        io0 = proc_io()
        t0 = time.perf_counter()
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        seconds = time.perf_counter() - t0
        io1 = proc_io()
        h = hashlib.sha256()
        for k, v in sorted(model.state_dict().items()):
            h.update(k.encode())
            h.update(v.to_local().contiguous().view(torch.uint8).numpy().tobytes())
        for s in opt.state_dict()["state"].values():
            for k, v in sorted(s.items()):
                v = v.to_local() if hasattr(v, "to_local") else v
                h.update(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        out = {"seconds": seconds, "share": share, "digest": h.hexdigest(),
               "rchar": io1["rchar"] - io0["rchar"],
               "read_bytes": io1["read_bytes"] - io0["read_bytes"]}
    dist.barrier()
    with open(f"{job['result']}.{rank}", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__[__doc__.index("\n\n") + 2:])
    ap.add_argument("--save-ranks", type=int, default=4, help="the world that saves")
    ap.add_argument("--ranks", default="2,3", help="worlds that load, comma-separated")
    ap.add_argument("--cache", default="cold,warm", help="cold, warm or both")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=3, help="rounds per row (median and range)")
    ap.add_argument("--threads", type=int, help="zeroflat.dcp.Reader's threads per rank "
                    "(default: the library's, the host's cores split among its ranks)")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--save", help="write the rows as JSON to FILE")
    ap.add_argument("--quick", action="store_true", help="a small model, 2 ranks, warm, 1 round")
    ap.add_argument("--rank-job", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_job:
        import torch.multiprocessing as mp

        mp.spawn(rank_main, args=(a.world, free_port(), json.loads(a.rank_job)),
                 nprocs=a.world, join=True)
        return 0
    if a.quick:
        a.ranks, a.cache, a.repeat, a.hidden, a.layers, a.vocab = "2", "warm", 1, 128, 2, 4000
    shape = {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab}
    with tempfile.TemporaryDirectory(prefix="zeroflat-dcp-bench-") as root:
        path = os.path.join(root, "checkpoint")
        run_rank_job(__file__, a.save_ranks, {"method": "save", "path": path, "cold": False,
                                              **shape}, a.timeout, "the save")
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        print(f"dcp_reshard_bench: {size / 1e9:.2f} GB saved at {a.save_ranks} ranks",
              file=sys.stderr)
        rows = []
        for world in [int(x) for x in a.ranks.split(",")]:
            for cache in [c for c in a.cache.split(",") if c]:
                times = {m: [] for m in METHODS}
                reads, digests = {m: [] for m in METHODS}, set()
                for _ in range(a.repeat):
                    for m in METHODS:
                        res = run_rank_job(__file__, world, {"method": m, "path": path,
                                                             "cold": cache == "cold",
                                                             "threads": a.threads, **shape},
                                           a.timeout, m)
                        times[m].append(max(r["seconds"] for r in res))
                        key = "read_bytes" if cache == "cold" else "rchar"
                        reads[m].append(max(r[key] / r["share"] for r in res))
                        digests.add(tuple(r["digest"] for r in res))
                row = {"saved": a.save_ranks, "ranks": world, "cache": cache,
                       "same_values": len(digests) == 1,
                       "speedup": [d / z for d, z in zip(times["dcp"], times["zeroflat"])]}
                for m in METHODS:
                    row[m] = {"median": statistics.median(times[m]), "min": min(times[m]),
                              "max": max(times[m]), "read_x_share": max(reads[m])}
                rows.append(row)
                sp = row["speedup"]
                print(f"{a.save_ranks} -> {world} {cache}: dcp {row['dcp']['median']:.3f} s "
                      f"[{row['dcp']['min']:.3f}-{row['dcp']['max']:.3f}], zeroflat "
                      f"{row['zeroflat']['median']:.3f} s [{row['zeroflat']['min']:.3f}-"
                      f"{row['zeroflat']['max']:.3f}]: {statistics.median(sp):.2f}x (rounds "
                      f"{', '.join(f'{x:.2f}' for x in sp)}); reads x share: dcp "
                      f"{row['dcp']['read_x_share']:.2f}, zeroflat "
                      f"{row['zeroflat']['read_x_share']:.2f}; same values: "
                      f"{row['same_values']}", flush=True)
        if a.save:
            with open(a.save, "w") as f:
                json.dump({"size_bytes": size, "shape": shape, "rows": rows}, f, indent=1)
        met = all(min(r["speedup"]) >= 2.0 and r["zeroflat"]["read_x_share"] <= 1.1 and
                  r["same_values"] for r in rows)
        print(f"targets (>= 2x dcp every round, reads <= 1.1x share, same values): "
              f"{'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
