"""From a Hugging Face checkpoint to a ZeRO-2 DeepSpeed engine ready to train, the seed's
measurement at this machine's scale: Transformers' from_pretrained + deepspeed.initialize,
against zeroflat.hf.from_pretrained + deepspeed.initialize with the drop-in (which adopts the
loaded buffers).

    PYTHONPATH=build/python .venv/bin/python benchmarks/hf_load_bench.py [--layers 2]
        [--experts 16] [--vocab 32000] [--ranks 1,2] [--repeat 3] [--dir DIR] [--warm-gib 8]
        [--json]

The checkpoint: Qwen3-30B-A3B's shapes (hidden 2048, 32 heads, 4 KV heads, experts of 768)
with --layers layers, --experts experts and a --vocab vocabulary (the full 151,936 makes the
embeddings dwarf the layers at this scale), or with --experts 0 a dense Qwen3-1.7B-shaped model
(hidden 2048, MLP 6144, 16 heads, 8 KV heads, tied embeddings: with --vocab 151936 most of its
bytes are the embedding), bf16, deterministic values, written once by
Transformers' own save_pretrained in 200 MB shards with an index. Each row runs every rank as a
fresh process (torch.multiprocessing, gloo, the CPU accelerator), the two ways alternately,
--repeat times (at least 3 for a median), and reports each way's median, with the range of the
rounds' ratios beside it; every figure is the slowest rank's:
  load      from the model's config (its code already imported: a one-time Python cost of
            seconds, the same both ways, shown apart) to every parameter holding the
            checkpoint's values. Transformers maps the safetensors files and leaves a parameter
            stored as the model holds it as a view of the mapping, read from the page cache or
            the disk when first touched (by DeepSpeed's flatten, inside initialize): the table
            says what share of the bytes that is
  rss       the load's growth in resident memory (peak, sampled every 2 ms), against the flat
            buffers' bytes (the floor: the parameters themselves); the fp32 master partitions
            the load builds for the optimizer (with the drop-in in place), which DeepSpeed's
            optimizer takes and would otherwise allocate in initialize, are not counted
  init      deepspeed.initialize (ZeRO-2, bf16, AdamW), and where it goes: the ZeRO optimizer's
            constructor (its flatten, its optimizer state; the fp32 master partition is in the
            constructor too), the broadcast of the parameters from rank 0, the optimizer check
            (which imports DeepSpeed's Muon module, and torch.compile with it, once per
            process), and the rest
  ready     load + init: time to the first training step
cold: the checkpoint's files dropped from the page cache before each run (written back, then
posix_fadvise(DONTNEED)). The targets: ready >= 1.0x Transformers' in every round, at every rank
count, warm and cold; at 2 ranks also rss <= 1.1x the flat buffers and ready >= 1.4x (median).
The load alone is shown but not a target: with the drop-in in place zeroflat's load also builds
the fp32 master partition that Transformers' way builds inside initialize, so only time to
ready holds the same work on both sides.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The peak resident memory while the block runs, sampled every 2 ms."""

    def __enter__(self):
        self.base = rss_bytes()
        self.peak = self.base
        self.done = False

        def sample():
            while not self.done:
                self.peak = max(self.peak, rss_bytes())
                time.sleep(0.002)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.growth = self.peak - self.base


def warm_memory(gib):
    """Touches gib GiB once and frees it: on a virtual machine the first touch of a page the guest
    has not used also costs the hypervisor's fault, which would land on whichever run meets such
    pages first (see docs/performance.md)."""
    for _ in range(gib):
        block = bytearray(1 << 30)
        for i in range(0, len(block), 4096):
            block[i] = 1
        del block


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, world, port):
    """torchrun's variables for rank `rank` of `world`, all on this host."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def gloo_rank(rank, world, port):
    """One rank of `world` on this host: torchrun's variables, one thread, a gloo group."""
    rank_env(rank, world, port)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def rank_done(job, rank, out):
    """A rank's end in a --rank-job: every rank waits for the others, writes its report to
    JOB["result"].RANK (what run_rank_job reads), leaves the group and exits at once (no
    teardown of what the measured way built)."""
    import torch.distributed as dist

    dist.barrier()
    with open(f"{job['result']}.{rank}", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def run_rank_job(script, world, job, timeout, what, env=()):
    """``script --rank-job JOB --world N`` in a fresh process (its ranks write their reports to
    JOB["result"].RANK as JSON); the ranks' reports, or exit naming ``what`` with the stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        job = dict(job, result=os.path.join(tmp, "rank"))
        r = subprocess.run([sys.executable, os.path.abspath(script), "--rank-job",
                            json.dumps(job), "--world", str(world)], capture_output=True,
                           text=True, timeout=timeout,
                           env=dict(os.environ, OMP_NUM_THREADS="1", **dict(env)))
        rows = []
        for rank in range(world):
            path = f"{job['result']}.{rank}"
            if os.path.exists(path):
                with open(path) as f:
                    rows.append(json.load(f))
    if r.returncode != 0 or len(rows) != world:
        sys.exit(f"{what} at {world} ranks failed:\n{r.stderr[-4000:]}")
    return rows


QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128)


# Qwen3-1.7B's: a dense model whose bytes sit mostly in its embedding (tied to the head).
QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128)


def write_checkpoint(path, layers, experts, vocab, shape=QWEN3_30B_A3B, shard="200MB"):
    """experts 0: a dense Qwen3 (Qwen3-1.7B's shapes, tied embeddings) instead of the MoE."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    if experts == 0:
        config = Qwen3Config(vocab_size=vocab, num_hidden_layers=layers, tie_word_embeddings=True,
                             dtype="bfloat16", **QWEN3_1_7B)
    else:
        config = Qwen3MoeConfig(vocab_size=vocab, num_hidden_layers=layers, num_experts=experts,
                                num_experts_per_tok=min(8, experts), tie_word_embeddings=False,
                                dtype="bfloat16", **shape)
    import zeroflat

    # Built without memory, then filled with deterministic values tensor by tensor.
    with zeroflat.meta_parameters():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            t = torch.empty(p.shape, dtype=torch.float32).normal_(0, 0.02, generator=gen)
            module._parameters[name] = torch.nn.Parameter(t.to(torch.bfloat16))
    if config.tie_word_embeddings:
        model.tie_weights()  # the head is the embedding again, saved once
    model.save_pretrained(path, max_shard_size=shard)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return len(json.load(f)["weight_map"])
    from safetensors import safe_open  # a model small enough for one file has no index

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return len(list(f.keys()))


def drop_cache(path):
    """Every file under `path` written back and dropped from the page cache."""
    for top, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(top, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed_init_parts():
    """Wraps the pieces of deepspeed.initialize that take time, to see where it goes: the ZeRO
    optimizer's constructor and its flatten and optimizer-state steps, the engine's broadcast of
    the parameters from rank 0, and its optimizer check (which imports DeepSpeed's Muon module,
    and with it torch.compile's, once per process)."""
    from deepspeed.runtime import engine
    from deepspeed.runtime.zero import stage_1_and_2

    cls = stage_1_and_2.DeepSpeedZeroOptimizer
    return timed_calls([(cls, "__init__", "ZeRO optimizer"),
                        (cls, "flatten_dense_tensors_aligned", "  flatten"),
                        (cls, "initialize_optimizer_states", "  optimizer state"),
                        (engine.DeepSpeedEngine, "_broadcast_model", "broadcast"),
                        (engine, "is_zero_supported_optimizer", "optimizer check (imports)")])


def timed_calls(targets):
    """Wraps each (class or module, function name, label) so that its calls add their seconds to
    the returned dict under the label (labels indented by two spaces: parts of the one above)."""
    parts = {}

    def wrap(owner, name, label):
        fn = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None:
            return

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[label] = parts.get(label, 0.0) + time.perf_counter() - t0
        timed.__wrapped__ = fn
        setattr(owner, name, timed)

    for owner, name, label in targets:
        wrap(owner, name, label)
    return parts


def import_once(*extra):
    """Imports now what a timed call would import on first use, once per process, the same both
    ways: the module DeepSpeed's optimizer check imports (its Muon optimizer, and torch.compile
    with it: 1 to 2 s in whichever initialize meets it first), and the modules named in
    `extra`."""
    import importlib

    for name in ("deepspeed.runtime.zero.muon.muon_optimizer", *extra):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def file_backed_bytes(model):
    """Bytes of the parameters that are still mappings of the checkpoint's files (read lazily,
    on first touch) rather than memory of their own."""
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                maps.append((lo, hi))
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if any(lo <= p.data_ptr() < hi for lo, hi in maps))


def worker(rank, world, port, path, way, cold, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(max(1, os.cpu_count() // world))
    import importlib

    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import zeroflat.hf

    importlib.import_module("deepspeed.comm")
    comm_torch = sys.modules["deepspeed.comm.torch"]
    if hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    # The model's code imported (Transformers imports a model's module on first use, seconds of
    # Python either way): timed, shown, and kept out of the load phase of both ways.
    from transformers import AutoConfig

    t0 = time.perf_counter()
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    import_once()
    t_import = time.perf_counter() - t0
    if cold and rank == 0:
        drop_cache(path)
    dist.barrier()

    t0 = time.perf_counter()
    with PeakRss() as rss:
        if way == "zeroflat":
            # One group (the optimizer below), and the drop-in for the whole process.
            model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, dtype=torch.bfloat16,
                                                device="cpu", param_groups=None,
                                                install_drop_in=True)
            flat_bytes = sum(fg.flat.numel() * fg.flat.element_size()
                             for fg in model.zeroflat_groups)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
            flat_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t_load = time.perf_counter() - t0
    mapped = file_backed_bytes(model)
    parts = timed_init_parts()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": True}}
    t1 = time.perf_counter()
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    t_init = time.perf_counter() - t1
    import zeroflat.deepspeed as zd

    adopted = zd.stats["adopted"] if zd.is_installed() else 0
    masters = zd.stats.get("masters_taken", 0) if zd.is_installed() else 0
    master_bytes = sum(m.numel() * m.element_size()
                       for m in opt.single_partition_of_fp32_groups) if masters else 0
    # The slowest rank's figures.
    vals = torch.tensor([t_load, t_init, t_load + t_init, float(rss.growth - master_bytes),
                         t_import],
                        dtype=torch.float64)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"load": vals[0].item(), "init": vals[1].item(), "ready": vals[2].item(),
                       "rss": vals[3].item(), "import": vals[4].item(), "mapped": mapped,
                       "flat_bytes": flat_bytes, "adopted": adopted,
                       "masters_taken": masters, "parts": parts}, f)
    dist.barrier()
    dist.destroy_process_group()


def run(way, world, path, cold, tmp):
    out = os.path.join(tmp, f"{way}-{world}-{cold}.json")
    mp.spawn(worker, args=(world, free_port(), path, way, cold, out), nprocs=world, join=True)
    with open(out) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16, help="experts per layer; 0: a dense model")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="where the checkpoint is (written there if missing)")
    ap.add_argument("--warm-gib", type=int, default=8,
                    help="GiB of memory to touch once before measuring (0: none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.repeat < 1 or args.layers < 1 or args.experts < 0:
        ap.error("--repeat and --layers must be at least 1, --experts at least 0 (dense)")
    tmp = tempfile.mkdtemp(prefix="zeroflat-hf-bench-")
    path = os.path.join(args.dir or tmp, "checkpoint")
    rows = []
    try:
        tensors = None
        if not os.path.exists(os.path.join(path, "config.json")):
            tensors = write_checkpoint(path, args.layers, args.experts, args.vocab)
        size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                   if n.endswith(".safetensors"))
        warm_memory(args.warm_gib)
        for cold in (False, True):
            for world in [int(r) for r in args.ranks.split(",") if r]:
                if not cold:
                    run("transformers", world, path, False, tmp)  # the files into the cache
                runs = {"transformers": [], "zeroflat": []}
                for _ in range(args.repeat):
                    for way in ("transformers", "zeroflat"):
                        runs[way].append(run(way, world, path, cold, tmp))
                med = {w: {k: statistics.median(r[k] for r in rs)
                            for k in ("load", "init", "ready", "rss", "import")}
                        for w, rs in runs.items()}
                pairs = list(zip(runs["transformers"], runs["zeroflat"]))
                # Where initialize goes: the run with the best time to ready, each way.
                fastest = {w: min(rs, key=lambda r: r["ready"]) for w, rs in runs.items()}
                z = runs["zeroflat"][0]
                rows.append({"ranks": world, "cache": "cold" if cold else "warm",
                             "transformers": med["transformers"], "zeroflat": med["zeroflat"],
                             "flat_bytes": z["flat_bytes"], "adopted": z["adopted"],
                             "masters_taken": z.get("masters_taken", 0),
                             "hf_mapped_bytes": runs["transformers"][0]["mapped"],
                             "parts": {w: dict(r["parts"], total=r["init"])
                                       for w, r in fastest.items()},
                             "load_x": med["transformers"]["load"] / med["zeroflat"]["load"],
                             "ready_x": med["transformers"]["ready"] / med["zeroflat"]["ready"],
                             "load_x_runs": [t["load"] / z["load"] for t, z in pairs],
                             "ready_x_runs": [t["ready"] / z["ready"] for t, z in pairs],
                             "rss_x": med["zeroflat"]["rss"] / z["flat_bytes"]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"checkpoint_bytes": size, "rows": rows}, indent=2))
        return 0
    model = (f"Qwen3-30B-A3B shapes, {args.experts} experts" if args.experts else
             "Qwen3-1.7B shapes (dense, tied embeddings)")
    print(f"{model}, {args.layers} layers, vocab "
          f"{args.vocab}: {size / 1e9:.2f} GB bf16" + (f", {tensors} tensors" if tensors else "")
          + f"; median of {args.repeat}, slowest rank; Transformers, then zeroflat; the "
          "range of the rounds' ratios in brackets")
    print(f"{'ranks':>5} {'cache':>5} | {'load s':>11} {'x':>5} | {'rss / flat':>10} | "
          f"{'init s':>11} | {'ready s':>11} {'x':>5} | targets: ready >= 1.0 every round; "
          "at 2 ranks rss <= 1.1, ready >= 1.4")
    met = True
    for r in rows:
        t, z = r["transformers"], r["zeroflat"]
        ok = min(r["ready_x_runs"]) >= 1.0
        if r["ranks"] == 2:
            ok = ok and r["rss_x"] <= 1.1 and r["ready_x"] >= 1.4
        met = met and ok
        print(f"{r['ranks']:>5} {r['cache']:>5} | {t['load']:5.2f} {z['load']:5.2f} "
              f"{r['load_x']:5.2f} ({min(r['load_x_runs']):.2f}-{max(r['load_x_runs']):.2f}) | "
              f"{r['rss_x']:10.2f} | {t['init']:5.2f} {z['init']:5.2f} | "
              f"{t['ready']:5.2f} {z['ready']:5.2f} {r['ready_x']:5.2f} "
              f"({min(r['ready_x_runs']):.2f}-{max(r['ready_x_runs']):.2f}) | "
              f"{'met' if ok else 'NOT met'} (adopted {r['adopted']}, masters taken "
              f"{r['masters_taken']}; Transformers: rss "
              f"{t['rss'] / r['flat_bytes']:.2f} x flat, "
              f"{r['hf_mapped_bytes'] / r['flat_bytes']:.0%} of the bytes still file mappings)")
    imports = max(max(r["transformers"]["import"], r["zeroflat"]["import"]) for r in rows)
    print(f"  not in either load: importing the model's code, up to {imports:.2f} s (the same "
          "both ways)")
    for r in rows:
        for way, parts in r["parts"].items():
            parts = dict(parts)
            total = parts.pop("total")
            rest = total - sum(v for k, v in parts.items() if not k.startswith(" "))
            text = ", ".join(f"{k.strip()} {v:.2f}" for k, v in parts.items())
            print(f"  initialize, {way:>12}, {r['ranks']} rank(s) {r['cache']}: {total:.2f} s = "
                  f"{text}, the rest {rest:.2f}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
