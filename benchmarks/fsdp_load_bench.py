#!/usr/bin/env python3
"""A Hugging Face checkpoint into PyTorch FSDP2's DTensor shards, each way side by side, every
row's every side in fresh processes (gloo on the CPU, one thread per rank), cold and warm,
median of --repeat rounds with the range and every round's speedup:

  transformers  AutoModelForCausalLM.from_pretrained(path, distributed_config=
                DistributedConfig(fsdp_size=N), dtype=bf16): builds the sharded model and
                reads each tensor's rows through safetensors' get_slice
  zeroflat      zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, distributed_config=...,
                storage="read"): the same model, each rank reading its shards' bytes through
                the library into memory of their own
  zeroflat-map  the same call with storage="map" (on the host, what its default "auto" does):
                the shards that lie in the files as they are (the file's dtype, whole rows)
                mapped in place and brought in during the call, as Transformers maps its
                files; the rest read
  dcp           into the same sharded model, built first (untimed):
                torch.distributed.checkpoint.load(get_model_state_dict(model),
                storage_reader=HuggingFaceStorageReader(path, thread_count=T)) for T = 1 (its
                default) and --dcp-threads (its best here)
  zeroflat-dcp  the same call with storage_reader=zeroflat.dcp.Reader(path)
  ceiling       no model: each rank reads its 1/N of the safetensors files' bytes (a contiguous
                cut, one thread, 8 MiB preads) into a fresh buffer: storage's pace cold, a
                memcpy from the page cache warm; the loads' "x ceiling" is their time over it
  accelerate    accelerate's fsdp_cpu_ram_efficient_loading: rank 0 loads the whole model
                (from_pretrained on the host), the others build it on meta, and
                accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict broadcasts every tensor
                from rank 0, each rank keeping its shard

With --device cuda the ranks are GPUs (NCCL), the model is built and loaded on them, and the
times wait for the GPU (at one rank, where Transformers shards nothing, both sides are the plain
load onto the GPU: from_pretrained(..., device_map="cuda") and zeroflat.hf.from_pretrained(...,
device="cuda")).

The time of a row is its slowest rank's, to ready: the call returned, then every local shard
read once (the first step reads them all; Transformers' load maps the files and reads nothing
until then, so its "returned" time is not a load). Both are printed, "ready (returned)". Per rank it also counts the bytes read through
read()/pread() (/proc/self/io rchar: page-cache hits included; under cold the kernel's bytes
from storage, read_bytes) against the rank's share (the file bytes of its shards), and the
growth of its resident memory over the load (VmHWM, reset before). For the DCP rows it also
prints where the time goes: the reader's import and construction, get_model_state_dict, each
storage-reader method DCP calls (read_metadata, set_up_storage_reader, the plans, read_data),
the rest of dcp.load (DCP's planner and collectives) and the touch after it; each phase's
slowest rank, the median over rounds.

The model: a Qwen3 causal LM of --layers layers of --hidden, --vocab rows of embedding, an
untied lm_head, bf16 (--moe: a Qwen3-MoE of --experts experts). Targets (issue "FSDP2"):
zeroflat >= 3x transformers cold and >= 2x warm at 2 and 4 ranks, never slower at 1;
zeroflat-dcp >= 1.5x dcp at its best thread count cold, never slower warm; read <= 1.05x
share + 8 MB; resident growth <= 1.1x the shards + 256 MB.

    fsdp_load_bench.py --ranks 1,2,4 --hidden 1024 --layers 24 --vocab 151936   # ~1.3 GB
    fsdp_load_bench.py --quick                                                   # a smoke run
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
sys.path.insert(0, HERE)
from hf_load_bench import (drop_cache, free_port, gloo_rank, rank_done, rank_env,  # noqa: E402
                           run_rank_job, timed_calls)
from zero3_bench import PeakResident, proc_io  # noqa: E402

MB = 1 << 20
METHODS = ("transformers", "zeroflat", "zeroflat-map", "dcp", "dcp-best", "zeroflat-dcp",
           "accelerate", "ceiling")


def config_of(a):
    if a.moe:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(vocab_size=a.vocab, hidden_size=a.hidden,
                              intermediate_size=4 * a.hidden, moe_intermediate_size=a.hidden,
                              num_hidden_layers=a.layers, num_attention_heads=8,
                              num_key_value_heads=4, head_dim=a.hidden // 8,
                              num_experts=a.experts, num_experts_per_tok=2,
                              tie_word_embeddings=False)
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                       num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=a.hidden // 8, tie_word_embeddings=False)


def save(a, path):
    import torch
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(a), dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="400MB")


# --- one rank -----------------------------------------------------------------------------------

def cuda_rank(rank, world, port):
    """One rank of `world` on this host's GPUs: torchrun's variables, GPU `rank`, NCCL."""
    rank_env(rank, world, port)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def rank_main(rank, world, port, job):
    cuda = job.get("device") == "cuda"
    (cuda_rank if cuda else gloo_rank)(rank, world, port)
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    path, method = job["path"], job["method"]
    config = DistributedConfig(fsdp_size=world)
    # Every module of torch and Transformers any side imports while it loads, first: they are
    # the user's program's before any load. zeroflat's own are imported inside the timed call,
    # as a user's first call pays them.
    import importlib

    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoConfig, initialization  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    importlib.import_module(f"transformers.models.{job['model_type']}.modeling_"
                            f"{job['model_type']}")
    assert job["model_type"] in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    # On a GPU at one rank Transformers shards nothing (a config of one process): both sides
    # are then the plain load onto the device, as a one-GPU user loads.
    on_device = {"device_map": "cuda"} if cuda and world == 1 else {}
    zf_device = {"device": "cuda"} if cuda and world == 1 else {}
    model = None
    if method in ("dcp", "dcp-best", "zeroflat-dcp"):
        model = built(path, config, "cuda" if cuda else "cpu")  # untimed: the same built model
    dist.barrier()
    if job["cold"] and rank == 0:
        drop_cache(path)
    dist.barrier()
    io0 = proc_io()
    if method == "ceiling":
        return ceiling_rank(rank, world, path, job)
    phases = {}
    with PeakResident() as peak:
        t0 = time.perf_counter()
        if method == "transformers":
            model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config,
                                                         dtype=torch.bfloat16, **on_device)
        elif method in ("zeroflat", "zeroflat-map"):
            import zeroflat.hf

            # One rank shards nothing: the plain load (read), as Transformers' is its plain load.
            storage = ({} if world == 1 else
                       {"storage": "map" if method == "zeroflat-map" else "read"})
            model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path,
                                                distributed_config=config, dtype=torch.bfloat16,
                                                **zf_device, **storage)
        elif method == "accelerate":
            model = accelerate_load(path, config, rank)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import HuggingFaceStorageReader
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            if method == "zeroflat-dcp":  # its import timed, as a user's first call pays it
                import zeroflat.dcp

                reader = zeroflat.dcp.Reader(path)
            else:
                reader = HuggingFaceStorageReader(path, thread_count=(
                    job["dcp_threads"] if method == "dcp-best" else 1))
            phases["reader"] = time.perf_counter() - t0
            parts = timed_calls([(reader, name, phase) for name, phase in READER_PHASES])
            t_state = time.perf_counter()
            state = get_model_state_dict(model)
            phases["state dict"] = time.perf_counter() - t_state
            dcp.load(state, storage_reader=reader)
            phases.update(parts)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if phases:  # DCP's own: its planner, its collectives, what no reader method holds
            phases["dcp"] = seconds - sum(phases.values())
        # Ready: every local shard read once more, as the first step reads it (a load that
        # maps the files and reads nothing, as Transformers' does, reads them here).
        t1 = time.perf_counter()
        with torch.no_grad():
            for p in model.parameters():
                x = local(p).detach()
                if x.numel():
                    x.contiguous().view(-1).view(torch.uint8)[::4096].sum()
                    x.view(-1).view(torch.uint8).max()
        if cuda:
            torch.cuda.synchronize()
        touch = time.perf_counter() - t1
    if phases:
        phases["touch"] = touch
    io1 = proc_io()
    shards = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    devices = sorted({str(local(p).device.type) for p in model.parameters()})
    out = {"rank": rank, "seconds": seconds + touch, "returned": seconds,
           "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
           "read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
           "rss": peak.growth, "shards": shards, "digest": digest(model), "devices": devices,
           "phases": phases}
    rank_done(job, rank, out)


def ceiling_rank(rank, world, path, job):
    """This rank's 1/world of the files' bytes read into a fresh buffer, timed like a load."""
    import torch

    files = [os.path.join(path, f) for f in sorted(os.listdir(path))
             if f.endswith(".safetensors")]
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    lo, hi = total * rank // world, total * (rank + 1) // world
    io0 = proc_io()
    with PeakResident() as peak:
        t0 = time.perf_counter()
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        at, done = 0, 0
        for f, n in zip(files, sizes):
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                fd = os.open(f, os.O_RDONLY)
                try:
                    for off in range(a, b, 8 << 20):
                        m = min(8 << 20, b - off)
                        done += os.preadv(fd, [view[off - lo:off - lo + m]], off - at)
                finally:
                    os.close(fd)
            at += n
        seconds = time.perf_counter() - t0
    io1 = proc_io()
    out = {"rank": rank, "seconds": seconds, "returned": seconds,
           "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
           "read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
           "rss": peak.growth, "shards": hi - lo, "digest": None, "devices": ["cpu"]}
    assert done == hi - lo, (done, hi - lo)
    rank_done(job, rank, out)


def accelerate_load(path, config, rank):
    """accelerate's fsdp_cpu_ram_efficient_loading: rank 0 loads the whole model on the host,
    every rank builds it sharded on meta, then accelerate's fsdp2_load_full_state_dict
    broadcasts every tensor from rank 0 and each rank keeps its shard; the non-persistent
    buffers (rotary inv_freq) made as the model makes them."""
    import torch
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers import initialization as hf_init
    from transformers.distributed import initialize_distributed_mesh

    class Main:  # the one thing fsdp2_load_full_state_dict asks of its Accelerator
        is_main_process = rank == 0

    full = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
            if rank == 0 else {})
    device, meshes = initialize_distributed_mesh(config)
    with torch.device("meta"), hf_init.no_tie_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                 dtype=torch.bfloat16)
    model = type(model).maybe_distribute_model(model, config, meshes)
    fsdp2_load_full_state_dict(Main(), model, full)
    with torch.device(device or "cpu"):
        for name, module in model.named_modules():
            for attr in list(module._non_persistent_buffers_set):
                fresh = getattr(type(module)(module.config), attr, None) if hasattr(
                    module, "config") else None
                if fresh is not None:
                    module.register_buffer(attr, fresh, persistent=False)
    return model


# Where a DCP load's time goes: the storage reader's methods, each timed on the instance
# (timed_calls; the same names on DCP's reader and zeroflat's); "reader" is its import and construction, "state
# dict" get_model_state_dict, "dcp" the rest of dcp.load (its planner and collectives), "touch"
# the read of every shard after it.
READER_PHASES = (("read_metadata", "metadata"), ("set_up_storage_reader", "set up"),
                 ("prepare_local_plan", "plan"), ("prepare_global_plan", "plan"),
                 ("read_data", "read"))
PHASE_ORDER = ("reader", "state dict", "metadata", "set up", "plan", "read", "dcp", "touch")


def phase_lines(world, cache, phases):
    """Per method, each phase's median over rounds of its slowest rank, in ms."""
    out = []
    for m, rounds in phases.items():
        if not rounds or not rounds[0]:
            continue
        names = [p for p in PHASE_ORDER if any(p in r for r in rounds)]
        cells = [f"{p} {1e3 * statistics.median(r.get(p, 0.0) for r in rounds):.1f}"
                 for p in names]
        out.append(f"  {world} ranks {cache} {m:>13}: " + ", ".join(cells))
    return out


def built(path, config, on="cpu"):
    """The sharded model as Transformers builds it, materialized (on `on` where Transformers'
    mesh names no device), nothing read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers import initialization as hf_init
    from transformers.distributed import initialize_distributed_mesh

    device, meshes = initialize_distributed_mesh(config)
    with torch.device("meta"), hf_init.no_tie_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                 dtype=torch.bfloat16)
    if meshes is not None:
        model = type(model).maybe_distribute_model(model, config, meshes)
    model.to_empty(device=device or on)
    return model


def local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def digest(model):
    """A checksum of this rank's local shards: every way must load the same values."""
    import hashlib

    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(local(p).detach().contiguous().view(-1).view(__import__("torch").uint8)[:4096]
                 .cpu().numpy().tobytes())
    return h.hexdigest()


def run_ranks(world, job, timeout):
    return run_rank_job(__file__, world, job, timeout, f"fsdp_load_bench: {job['method']}")


# --- the comparison -----------------------------------------------------------------------------

def share_bytes(path, world):
    """Per rank, the file bytes of its shards (the library's count, as the load reads them)."""
    out = []
    for rank in range(world):
        r = subprocess.run([sys.executable, "-c", SHARE, path, str(world), str(rank)],
                           capture_output=True, text=True, check=True)
        out.append(int(r.stdout))
    return out


# Each parameter's bytes as FSDP2's Shard(0) cuts it on `world` ranks (the library's arithmetic).
SHARE = """
import sys, zeroflat._C as C
ck = C.Checkpoint(sys.argv[1]); world, rank = int(sys.argv[2]), int(sys.argv[3])
ts = ck.tensors()
params = [C.LoadParam(name=t.name, shape=list(t.shape)) for t in ts]
where = C.LoadPlacement("shards", mesh=[world], coords=[[r] for r in range(world)],
                       placements=[["Shard(0)"] for _ in ts])
print(C.load_read_bytes(ck, params, where, C.LayoutOptions(dp=world), rank))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__[__doc__.index("\n\n") + 2:])
    ap.add_argument("--ranks", default="1,2,4", help="rank counts, comma-separated")
    ap.add_argument("--cache", default="cold,warm", help="cold, warm or both")
    ap.add_argument("--methods", default=",".join(METHODS), help="ways to compare")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE (--experts experts)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--dcp-threads", type=int, default=4,
                    help="HuggingFaceStorageReader's thread_count in the dcp-best rows")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per row (median and range)")
    ap.add_argument("--dir", help="where the checkpoint is kept between runs")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--save", help="write the rows as JSON to FILE")
    ap.add_argument("--plot", help="write a bar chart of the rows to FILE.svg")
    ap.add_argument("--quick", action="store_true", help="a small model, 2 ranks, warm, 1 round")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model is loaded: cpu (gloo), or cuda (NCCL, one GPU a rank; "
                    "at one rank both sides load the plain model onto the GPU)")
    ap.add_argument("--rank-job", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_job:
        import torch.multiprocessing as mp

        mp.spawn(rank_main, args=(a.world, free_port(), json.loads(a.rank_job)),
                 nprocs=a.world, join=True)
        return 0
    if a.quick:
        a.ranks, a.cache, a.repeat, a.hidden, a.layers, a.vocab = "2", "warm", 1, 256, 2, 8000
    ranks = [int(x) for x in a.ranks.split(",")]
    if a.device == "cuda":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if max(ranks) > have:
            ap.error(f"--device cuda --ranks {a.ranks}: this machine has {have} GPU(s)")
    caches = [c for c in a.cache.split(",") if c]
    methods = [m for m in a.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            ap.error(f"--methods: {m!r} is not one of {', '.join(METHODS)}")
    root = a.dir or tempfile.mkdtemp(prefix="zeroflat-fsdp-bench-")
    path = os.path.join(root, f"{'moe' if a.moe else 'dense'}_{a.hidden}_{a.layers}_{a.vocab}")
    save(a, path)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".safetensors"))
    print(f"fsdp_load_bench: {path}: {size / 1e9:.2f} GB of safetensors", file=sys.stderr)
    rows = []
    for world in ranks:
        shares = share_bytes(path, world)
        for cache in caches:
            times = {m: [] for m in methods}
            returned = {m: [] for m in methods}
            worst = {m: {} for m in methods}
            phases = {m: [] for m in methods}
            digests = {}
            for _ in range(a.repeat):
                for m in methods:
                    job = {"path": path, "method": m, "cold": cache == "cold", "device": a.device,
                           "dcp_threads": a.dcp_threads,
                           "model_type": "qwen3_moe" if a.moe else "qwen3"}
                    res = run_ranks(world, job, a.timeout)
                    times[m].append(max(r["seconds"] for r in res))
                    returned[m].append(max(r["returned"] for r in res))
                    phases[m].append({p: max(r.get("phases", {}).get(p, 0.0) for r in res)
                                      for p in {p for r in res for p in r.get("phases", {})}})
                    if m != "ceiling":  # reads bytes, loads no model
                        digests.setdefault(m, [r["digest"] for r in res])
                    read_key = "read_bytes" if cache == "cold" else "rchar"
                    worst[m] = {
                        "read_ratio": max(r[read_key] / max(1, s) for r, s in zip(res, shares)),
                        "read_over": max(r[read_key] - s for r, s in zip(res, shares)),
                        "rss_ratio": max(r["rss"] / max(1, r["shards"]) for r in res),
                        "rss_over": max(r["rss"] - 1.1 * r["shards"] for r in res),
                        "devices": sorted({d for r in res for d in r.get("devices", [])})}
            same = len({tuple(d) for d in digests.values()}) == 1
            row = {"ranks": world, "cache": cache, "same_values": same,
                   "share_mb": max(shares) / MB, "device": a.device}
            for m in methods:
                row[m] = {"median": statistics.median(times[m]), "min": min(times[m]),
                          "max": max(times[m]), "returned": statistics.median(returned[m]),
                          **worst[m]}
            for ours, theirs in (("zeroflat", "transformers"), ("zeroflat-map", "transformers"),
                                 ("zeroflat-dcp", "dcp"),
                                 ("zeroflat-dcp", "dcp-best"), ("zeroflat", "accelerate"),
                                 ("ceiling", "zeroflat"), ("ceiling", "zeroflat-dcp"),
                                 ("ceiling", "dcp-best"), ("ceiling", "transformers"),
                                 ("ceiling", "zeroflat-map")):
                if ours in times and theirs in times:
                    row[f"{ours} vs {theirs}"] = [t / o for o, t in
                                                  zip(times[ours], times[theirs])]
            row["phase_lines"] = phase_lines(world, cache, phases)
            rows.append(row)
            print(line(row), file=sys.stderr, flush=True)
            if a.save:  # after every row: a run stopped midway keeps the rows it finished
                # The shape and the methods, not where this machine kept the files.
                shown = {k: v for k, v in vars(a).items()
                         if k not in ("dir", "save", "plot", "rank_job", "world")}
                with open(a.save, "w") as f:
                    json.dump({"checkpoint_gb": size / 1e9, "args": shown, "rows": rows}, f,
                              indent=1)
    print(table(rows, methods))
    breakdown = [text for row in rows for text in row["phase_lines"]]
    if breakdown:
        print("where a DCP load's time goes (ms; each phase's slowest rank, median over rounds; "
              "reader: import and construction, dcp: dcp.load's own planning and collectives, "
              "touch: every shard read after it):")
        print("\n".join(breakdown))
    if a.plot:
        plot(rows, methods, a.plot, f"{os.path.basename(path)} into FSDP2 shards "
             f"({size / 1e9:.2f} GB)")
    return 0


def line(row):
    parts = [f"{row['ranks']} ranks {row['cache']}"]
    for k, v in row.items():
        if " vs " in k:
            parts.append(f"{k} {statistics.median(v):.2f}x ({', '.join(f'{x:.2f}' for x in v)})")
    return "fsdp_load_bench: " + "; ".join(parts)


def target(row, key):
    """Whether a speedup row meets its target in every round."""
    v = row.get(key)
    if not v:
        return ""
    cold = row["cache"] == "cold"
    if key in ("zeroflat vs transformers", "zeroflat-map vs transformers"):
        need = 1.0 if row["ranks"] == 1 else (3.0 if cold else 2.0)
    elif key == "zeroflat-dcp vs dcp-best":
        need = 1.5 if cold else 1.0
    else:
        return ""
    return f"{'met' if min(v) >= need else 'NOT met'} (>= {need:g} x)"


COLORS = {"transformers": "#ca0020", "zeroflat": "#0571b0", "zeroflat-map": "#053061",
          "dcp": "#f4a582",
          "dcp-best": "#e66101", "zeroflat-dcp": "#92c5de"}


def plot(rows, methods, path, title):
    """A bar per way per row: seconds to ready (shorter is better)."""
    width, bar, gap, left, top = 900, 12, 16, 120, 30
    h = 20 + len(rows) * (len(methods) * bar + gap)
    top_s = max(r[m]["median"] for r in rows for m in methods) or 1
    scale = (width - left - 120) / top_s
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h + top + 40}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="16" font-size="13">{title}: seconds to ready, median '
           '(shorter is better)</text>']
    y = top
    for r in rows:
        out.append(f'<text x="4" y="{y + bar * len(methods) / 2 + 4}">{r["ranks"]} rank(s) '
                   f'{r["cache"]}</text>')
        for m in methods:
            w = r[m]["median"] * scale
            out.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar - 1}" '
                       f'fill="{COLORS.get(m, "#999999")}"/>')
            out.append(f'<text x="{left + w + 4:.1f}" y="{y + bar - 2}">{r[m]["median"]:.2f} s'
                       '</text>')
            y += bar
        y += gap
    for i, m in enumerate(methods):
        x = left + i * 150
        out.append(f'<rect x="{x}" y="{y + 8}" width="12" height="12" '
                   f'fill="{COLORS.get(m, "#999999")}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 18}">{m}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def table(rows, methods):
    head = ["ranks", "cache"] + [f"{m} s ready [range] (returned)" for m in methods] + [
        "zeroflat vs transformers (each round)", "target", "zeroflat-map vs transformers",
        "target", "zeroflat-dcp vs dcp-best", "target",
        "zeroflat vs accelerate (each round)", "time / the ceiling's (median)",
        "zeroflat read / share", "zeroflat rss / shards", "zeroflat-map read / share",
        "zeroflat-map rss / shards", "accelerate rss / shards", "same values"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["ranks"]), r["cache"]]
        for m in methods:
            cells.append(f"{r[m]['median']:.2f} [{r[m]['min']:.2f}-{r[m]['max']:.2f}] "
                         f"({r[m]['returned']:.2f})")
        for key in ("zeroflat vs transformers", "zeroflat-map vs transformers",
                    "zeroflat-dcp vs dcp-best"):
            v = r.get(key)
            cells.append(f"**{statistics.median(v):.2f} x** ({', '.join(f'{x:.2f}' for x in v)})"
                         if v else "")
            cells.append(target(r, key))
        v = r.get("zeroflat vs accelerate")
        cells.append(f"{statistics.median(v):.2f} x ({', '.join(f'{x:.2f}' for x in v)})"
                     if v else "")
        cells.append(", ".join(f"{m} {statistics.median(r[f'ceiling vs {m}']):.2f}"
                               for m in ("zeroflat", "zeroflat-map", "zeroflat-dcp", "dcp-best",
                                         "transformers")
                               if r.get(f"ceiling vs {m}")))
        z = r.get("zeroflat") or r.get("zeroflat-dcp")
        cells.append(f"{z['read_ratio']:.2f}" if z else "")
        cells.append(f"{z['rss_ratio']:.2f}" if z else "")
        zm = r.get("zeroflat-map")
        cells.append(f"{zm['read_ratio']:.2f}" if zm else "")
        cells.append(f"{zm['rss_ratio']:.2f}" if zm else "")
        acc = r.get("accelerate")
        cells.append(f"{acc['rss_ratio']:.2f}" if acc else "")
        cells.append("yes" if r["same_values"] else "NO")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
