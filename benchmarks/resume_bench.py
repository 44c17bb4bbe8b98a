"""Resuming training from a DeepSpeed ZeRO checkpoint, two ways side by side: DeepSpeed's own
engine.load_checkpoint against the same call under zeroflat.deepspeed.install().

    PYTHONPATH=python .venv/bin/python benchmarks/resume_bench.py [--stages 2,3]
        [--worlds 2>2,4>4,2>4,4>2] [--cache cold,warm] [--hidden 1024] [--layers 15]
        [--vocab 32000] [--repeat 3] [--dir DIR] [--timeout 1800] [--json] [--save FILE]
        [--plot FILE.svg] [--quick]

What one run is: a checkpoint saved by DeepSpeed itself at S ranks (a model of --layers blocks
of two hidden x 4 hidden linear layers and an embedding of --vocab x --hidden, bf16, torch's
AdamW in two param groups, one training step so that Adam's states exist), then resumed at N
ranks (the "S>N" of --worlds), every rank a fresh process (gloo, DeepSpeed's CPU accelerator,
one thread per rank). The engine is built first, untimed; then, after a barrier (and, cold,
every file of the checkpoint written back and dropped from the page cache), each rank times
  deepspeed  N == S: engine.load_checkpoint(dir, tag) as DeepSpeed does it (each rank
             torch.loads the module file and its own optimizer file)
             N != S: DeepSpeed refuses; its way is the offline ds_to_universal conversion
             (--inject_missing_state, timed on its own, cold from the same start) and then
             load_checkpoint with checkpoint.load_universal: the sum is the time to resume
  zeroflat   engine.load_checkpoint(dir, tag) under zeroflat.deepspeed.install(), from the
             saved per-rank files at any N
and counts, over the load:
  read       bytes the rank read through read()/pread() (/proc/self/io rchar; the kernel's
             count, page-cache hits included) and from storage (read_bytes, cold only)
  rss        the rank's peak resident memory during the load (VmHWM reset just before it)
             minus its resident memory before it
  share      the bytes of state the rank keeps: its fp32 master partition and each optimizer
             state partition (its share of what the checkpoint holds)
A round's time is the slowest rank's; bytes and rss are the largest over ranks and rounds. A
row is --repeat rounds, both ways in each (which goes first alternates); it shows each way's
median round with the range, and every round's speedup. Both ways must
give every rank the same weights: each rank's loss of a fixed batch after the load must be
bit-identical between the ways (the run fails otherwise).

Targets, in every round: every zeroflat rank reads <= 1.1 x its share + 8 MB and grows
<= 1.2 x its share + 256 MB; at the same world size never slower than DeepSpeed, and ZeRO-1/2
at 4 ranks cold >= 1.3 x faster; at another world size >= 5 x faster than ds_to_universal + the universal
load. Exit status 1 when a target is not met, 2 when the losses differ. --quick: a 20 MB
model, ZeRO-2 and 3, 2>2 and 2>3, warm only, one round (about a minute on 2 idle cores).
Two sizes worth showing: the default (2.2 GB) and --hidden 512 --layers 8 (33 M parameters,
0.46 GB), where fixed costs weigh most; and --hidden 1024 --layers 1 --vocab 24000 (0.44 GB,
one wide block and a large embedding). After each row, where zeroflat's call spent its time
on its slowest rank (stats["resumes"]' phases: open the folder, read the small values, plan,
read the buffers, the ranks' agreement, write the engine).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_load_bench import drop_cache, free_port, rank_done, run_rank_job  # noqa: E402
from zero3_bench import PeakResident, proc_io  # noqa: E402

TAG = "saved"
MB = 1_000_000


# --- the model and the engine ------------------------------------------------------------------

def make_model(args):
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            h = args["hidden"]
            self.embed = torch.nn.Embedding(args["vocab"], h)
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(),
                                    torch.nn.Linear(4 * h, h)) for _ in range(args["layers"]))

        def forward(self, x):
            h = self.embed(x)
            for b in self.blocks:
                h = h + b(h)
            return h.float().pow(2).mean()

    return Model()


def build(args, stage, universal=False):
    import deepspeed
    import torch

    model = make_model(args)
    groups = [{"params": list(model.embed.parameters())},
              {"params": list(model.blocks.parameters()), "lr": 2e-4}]
    optimizer = torch.optim.AdamW(groups, lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    accel = deepspeed.accelerator.get_accelerator()
    if deepspeed.__version__ == "0.18.9":  # its accelerator path breaks step() on gloo
        accel.available_memory = lambda *a, **k: 0
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    finally:
        vars(accel).pop("available_memory", None)
    return engine


def batch(args, rank):
    import torch

    return torch.randint(0, args["vocab"], (1, 64), generator=torch.Generator().manual_seed(rank))


def share_bytes(engine):
    """The state this rank keeps: its fp32 partitions and each optimizer state partition."""
    opt = engine.optimizer
    parts = getattr(opt, "fp32_partitioned_groups_flat", None)
    if parts is None:
        parts = opt.single_partition_of_fp32_groups
    total = 0
    for t in parts:
        total += t.numel() * 4
        for v in opt.optimizer.state[t].values():
            if hasattr(v, "numel") and v.numel() == t.numel():
                total += v.numel() * v.element_size()
    return total


# --- one rank ----------------------------------------------------------------------------------

def rank_main(rank, world, port, job):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    import deepspeed

    comm_torch = sys.modules.get("deepspeed.comm.torch")
    if comm_torch is not None and hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    import torch.distributed as dist

    args, stage, mode = job["args"], job["stage"], job["mode"]
    out = {"rank": rank}
    if mode == "save":
        engine = build(args, stage)
        loss = engine(batch(args, rank))
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(job["dir"], tag=TAG)
        dist.barrier()
    else:
        import zeroflat.deepspeed as zd

        if mode == "zeroflat":
            zd.install()
        engine = build(args, stage, universal=mode == "universal")
        tag = TAG + ("_universal" if mode == "universal" else "")
        dist.barrier()
        if job["cold"] and rank == 0:
            drop_cache(os.path.join(job["dir"], tag))
        dist.barrier()
        io0 = proc_io()
        profile = None
        if job.get("profile"):
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        with PeakResident() as peak:
            t0 = time.perf_counter()
            engine.load_checkpoint(job["dir"], tag=tag)
            seconds = time.perf_counter() - t0
        io1 = proc_io()
        if profile is not None:
            profile.disable()
            os.makedirs(job["profile"], exist_ok=True)
            profile.dump_stats(os.path.join(job["profile"], (
                f"{mode}_z{stage}_{job['saved']}to{world}_{'cold' if job['cold'] else 'warm'}"
                f".rank{rank}.prof")))
        out.update(seconds=seconds, rchar=io1["rchar"] - io0["rchar"],
                   read_bytes=io1["read_bytes"] - io0["read_bytes"], rss=peak.growth,
                   share=share_bytes(engine))
        with torch.no_grad():
            out["loss"] = float(engine(batch(args, rank)))
        if mode == "zeroflat":
            out["served"] = len(zd.stats["resumes"]) == 1 and not zd.stats["resume_fallbacks"]
            out["library_bytes"] = zd.stats["resumes"][0]["bytes_read"] if out["served"] else 0
            # Where zeroflat's call spent its time on this rank (seconds per phase).
            out["phases"] = zd.stats["resumes"][0].get("phases", {}) if out["served"] else {}
    rank_done(job, rank, out)


def run_ranks(world, job, timeout):
    """The ranks of one job in fresh processes; their reports."""
    return run_rank_job(__file__, world, job, timeout, f"resume_bench: {job['mode']}",
                        env={"DS_ACCELERATOR": "cpu"})


def spawn_main(world, job):
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(world, free_port(), job), nprocs=world, join=True)


# --- the comparison ----------------------------------------------------------------------------

def universal(src, timeout, cold):
    """ds_to_universal of DIR/TAG into DIR/TAG_universal, timed (cold: from a dropped cache)."""
    out = os.path.join(src, TAG + "_universal")
    shutil.rmtree(out, ignore_errors=True)
    if cold:
        drop_cache(os.path.join(src, TAG))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                        "--input_folder", os.path.join(src, TAG), "--output_folder", out,
                        "--inject_missing_state", "--num_extract_workers", "2",
                        "--num_merge_workers", "2"], capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    if r.returncode != 0:
        sys.exit(f"resume_bench: ds_to_universal failed:\n{r.stderr[-4000:]}")
    return time.perf_counter() - t0


def summarize(rows):
    slowest = max(rows, key=lambda r: r["seconds"])
    return {"seconds": slowest["seconds"], "rchar": max(r["rchar"] for r in rows),
            "read_bytes": max(r["read_bytes"] for r in rows), "rss": max(r["rss"] for r in rows),
            "share": max(r["share"] for r in rows), "losses": [r["loss"] for r in rows],
            "phases": slowest.get("phases", {})}


def median(values):
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def scenario(args, stage, saved, world, cold, root, timeout, repeat, profile=None):
    """One row: ``repeat`` rounds, each both ways in fresh processes (which goes first
    alternates between rounds); the row keeps the median round of each way, every round's
    speedup, and the largest bytes and resident growth of any round."""
    src = os.path.join(root, f"z{stage}_w{saved}")
    if not os.path.isdir(os.path.join(src, TAG)):
        run_ranks(saved, {"mode": "save", "stage": stage, "dir": src, "args": args}, timeout)
    row = {"stage": stage, "saved": saved, "world": world, "cache": "cold" if cold else "warm"}
    job = {"stage": stage, "dir": src, "args": args, "cold": cold, "saved": saved,
           "profile": os.path.abspath(profile) if profile else None}
    rounds = []
    for i in range(repeat):
        def deepspeed_way():
            if saved == world:
                return 0.0, summarize(run_ranks(world, dict(job, mode="deepspeed"), timeout))
            convert = universal(src, timeout, cold)
            return convert, summarize(run_ranks(world, dict(job, mode="universal"), timeout))

        def zeroflat_way():
            zf_rows = run_ranks(world, dict(job, mode="zeroflat"), timeout)
            return all(r.get("served") for r in zf_rows), summarize(zf_rows)

        if i % 2 == 0:
            (convert, ds), (served, zf) = deepspeed_way(), zeroflat_way()
        else:
            (served, zf), (convert, ds) = zeroflat_way(), deepspeed_way()
        rounds.append({"convert": convert, "deepspeed": ds, "zeroflat": zf, "served": served,
                       "speedup": (convert + ds["seconds"]) / zf["seconds"]})
    by_ds = sorted(rounds, key=lambda r: r["convert"] + r["deepspeed"]["seconds"])
    by_zf = sorted(rounds, key=lambda r: r["zeroflat"]["seconds"])
    mid_ds, mid_zf = by_ds[(repeat - 1) // 2], by_zf[(repeat - 1) // 2]
    ds, zf = dict(mid_ds["deepspeed"]), dict(mid_zf["zeroflat"])
    for key in ("rchar", "read_bytes", "rss"):
        zf[key] = max(r["zeroflat"][key] for r in rounds)
    row["convert"] = mid_ds["convert"]
    row["served"] = all(r["served"] for r in rounds)
    row["deepspeed"], row["zeroflat"] = ds, zf
    row["deepspeed_total"] = mid_ds["convert"] + ds["seconds"]
    row["deepspeed_range"] = [by_ds[0]["convert"] + by_ds[0]["deepspeed"]["seconds"],
                              by_ds[-1]["convert"] + by_ds[-1]["deepspeed"]["seconds"]]
    row["zeroflat_range"] = [by_zf[0]["zeroflat"]["seconds"], by_zf[-1]["zeroflat"]["seconds"]]
    row["round_speedups"] = [r["speedup"] for r in rounds]
    row["speedup"] = median(row["round_speedups"])
    read = zf["read_bytes"] if cold else zf["rchar"]
    row["read_ratio"] = read / zf["share"]
    row["rss_ratio"] = zf["rss"] / zf["share"]
    row["same_losses"] = all(r["deepspeed"]["losses"] == r["zeroflat"]["losses"] for r in rounds)
    ok = row["served"] and read <= 1.1 * zf["share"] + 8 * MB and \
        zf["rss"] <= 1.2 * zf["share"] + 256 * MB
    target = (1.3 if (stage < 3 and world == 4 and cold) else 1.0) if saved == world else 5.0
    row["target"] = target
    row["target_met"] = ok and min(row["round_speedups"]) >= target
    return row


def table(rows):
    lines = ["| stage | saved > resumed | cache | DeepSpeed s (convert + load) [range] | "
             "zeroflat s [range] | speedup (each round) | zeroflat read / share | "
             "zeroflat rss / share | DeepSpeed read MB | zeroflat read MB | share MB | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ds, zf = r["deepspeed"], r["zeroflat"]
        conv = f"{r['convert']:.2f} + {ds['seconds']:.2f}" if r["convert"] else \
            f"{ds['seconds']:.2f}"
        dlo, dhi = r["deepspeed_range"]
        zlo, zhi = r["zeroflat_range"]
        each = ", ".join(f"{x:.2f}" for x in r["round_speedups"])
        cold = r["cache"] == "cold"
        lines.append(
            f"| {r['stage']} | {r['saved']} > {r['world']} | {r['cache']} | {conv} "
            f"[{dlo:.2f}-{dhi:.2f}] | {zf['seconds']:.2f} [{zlo:.2f}-{zhi:.2f}] | "
            f"**{r['speedup']:.2f} x** ({each}) | {r['read_ratio']:.2f} | "
            f"{r['rss_ratio']:.2f} | {(ds['read_bytes'] if cold else ds['rchar']) / MB:.0f} | "
            f"{(zf['read_bytes'] if cold else zf['rchar']) / MB:.0f} | {zf['share'] / MB:.0f} | "
            f"{'met' if r['target_met'] else 'NOT met'} (>= {r['target']:.1f} x) |")
    return "\n".join(lines)


def plot(rows, path):
    """A bar per way per scenario, seconds (the conversion hatched over DeepSpeed's load)."""
    width, bar, gap, left, top = 900, 14, 18, 170, 30
    h = 20 + len(rows) * (2 * bar + gap)
    top_s = max(max(r["deepspeed_total"], r["zeroflat"]["seconds"]) for r in rows) or 1
    scale = (width - left - 80) / top_s
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h + top + 40}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="16" font-size="13">Resume from a DeepSpeed checkpoint: '
           'seconds (shorter is better)</text>']
    y = top
    for r in rows:
        label = f"ZeRO-{r['stage']} {r['saved']}>{r['world']} {r['cache']}"
        out.append(f'<text x="4" y="{y + bar + 4}">{label}</text>')
        conv, load = r["convert"] * scale, r["deepspeed"]["seconds"] * scale
        out.append(f'<rect x="{left}" y="{y}" width="{conv:.1f}" height="{bar}" fill="#f4a582"/>')
        out.append(f'<rect x="{left + conv:.1f}" y="{y}" width="{load:.1f}" height="{bar}" '
                   'fill="#ca0020"/>')
        out.append(f'<text x="{left + conv + load + 4:.1f}" y="{y + bar - 3}">'
                   f'{r["deepspeed_total"]:.2f} s</text>')
        zf = r["zeroflat"]["seconds"] * scale
        out.append(f'<rect x="{left}" y="{y + bar}" width="{zf:.1f}" height="{bar}" '
                   'fill="#0571b0"/>')
        out.append(f'<text x="{left + zf + 4:.1f}" y="{y + 2 * bar - 3}">'
                   f'{r["zeroflat"]["seconds"]:.2f} s ({r["speedup"]:.1f} x)</text>')
        y += 2 * bar + gap
    legend = [("#ca0020", "DeepSpeed load_checkpoint"), ("#f4a582", "ds_to_universal"),
              ("#0571b0", "zeroflat")]
    for i, (color, name) in enumerate(legend):
        x = left + i * 220
        out.append(f'<rect x="{x}" y="{y + 8}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 18}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="2,3",
                   help="ZeRO stages, comma-separated (1, 2, 3) [default: 2,3]")
    p.add_argument("--worlds", default="2>2,4>4,2>4,4>2",
                   help="saved>resumed world sizes, comma-separated [default: 2>2,4>4,2>4,4>2]")
    p.add_argument("--cache", default="cold,warm",
                   help="page cache before each load: cold, warm or both [default: cold,warm]")
    p.add_argument("--hidden", type=int, default=1024,
                   help="the model's hidden size [default: 1024]")
    p.add_argument("--layers", type=int, default=15,
                   help="blocks of two hidden x 4 hidden linear layers [default: 15]")
    p.add_argument("--vocab", type=int, default=32000,
                   help="rows of the embedding [default: 32000; with the defaults, 159M "
                   "parameters, a 2.2 GB checkpoint]")
    p.add_argument("--dir", help="where the checkpoints are kept and reused between runs "
                   "(default: a temporary one)")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds one side of a row may take [default: 1800]")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--save", help="write the rows as JSON to FILE")
    p.add_argument("--plot", help="write a bar chart to FILE.svg")
    p.add_argument("--profile", metavar="DIR",
                   help="write each rank's cProfile of each load into DIR (pstats files)")
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds per row, both ways each round in fresh processes; the row "
                   "shows the median and the range [default: 3]")
    p.add_argument("--quick", action="store_true",
                   help="a 20 MB model, 2>2 and 2>3, warm only (a smoke run)")
    p.add_argument("--rank-job", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_job:
        spawn_main(a.world, json.loads(a.rank_job))
        return 0
    if a.quick:
        a.hidden, a.layers, a.vocab, a.worlds, a.cache = 256, 4, 4000, "2>2,2>3", "warm"
        a.repeat = 1
    for name in ("hidden", "layers", "vocab", "repeat"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    try:
        worlds = [tuple(int(x) for x in w.split(">")) for w in a.worlds.split(",")]
        stages = [int(s) for s in a.stages.split(",")]
        caches = a.cache.split(",")
    except ValueError:
        p.error("--worlds takes S>N pairs, --stages numbers")
    if any(len(w) != 2 or min(w) < 1 for w in worlds) or not set(stages) <= {1, 2, 3} or \
            not set(caches) <= {"cold", "warm"}:
        p.error("--worlds S>N with S, N >= 1; --stages of 1, 2, 3; --cache cold and/or warm")
    args = {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab}
    params = a.vocab * a.hidden + a.layers * (8 * a.hidden * a.hidden + 5 * a.hidden)
    print(f"resume_bench: {params / 1e6:.1f} M parameters ({params * 4 / 1e9:.2f} GB in fp32; "
          f"checkpoint about {params * 14 / 1e9:.2f} GB)", file=sys.stderr)
    root = a.dir or tempfile.mkdtemp(prefix="resume_bench_")
    rows = []
    try:
        for stage in stages:
            for saved, world in worlds:
                for cache in caches:
                    row = scenario(args, stage, saved, world, cache == "cold", root, a.timeout,
                                   a.repeat, a.profile)
                    rows.append(row)
                    print(f"resume_bench: ZeRO-{stage} {saved}>{world} {cache}: DeepSpeed "
                          f"{row['deepspeed_total']:.2f} s, zeroflat "
                          f"{row['zeroflat']['seconds']:.2f} s (median of {a.repeat}; "
                          f"{row['speedup']:.2f} x, rounds "
                          f"{', '.join(f'{x:.2f}' for x in row['round_speedups'])})",
                          file=sys.stderr)
                    phases = row["zeroflat"].get("phases") or {}
                    if phases:
                        print("resume_bench:   zeroflat per phase (its slowest rank, median "
                              "round): " + ", ".join(f"{k} {v * 1e3:.0f} ms"
                                                     for k, v in phases.items()),
                              file=sys.stderr)
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table(rows))
    if a.save:
        with open(a.save, "w") as f:
            json.dump({"params": params, "args": args, "rows": rows}, f, indent=2)
    if a.plot:
        plot(rows, a.plot)
    if not all(r["same_losses"] for r in rows):
        print("resume_bench: the two ways' losses differ", file=sys.stderr)
        return 2
    return 0 if all(r["target_met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
