"""Where a load's time goes when there is almost nothing to read: zeroflat's load of a checkpoint
with a real model's tensor count (Qwen3-30B-A3B's 48 layers x 128 experts: 18,867 tensors) whose
tensors are shrunk to a few KB, so that every second measured is a fixed cost (per file, per
tensor, per parameter, per call) and none is reading.

    PYTHONPATH=build/python .venv/bin/python benchmarks/fixed_costs_bench.py [--layers 48]
        [--experts 128] [--hidden 64] [--moe-intermediate 32] [--vocab 1024] [--ranks 1,2]
        [--stage 2] [--repeat 3] [--dir DIR] [--cli build/zeroflat] [--json]

The checkpoint: a Qwen3-MoE config of those sizes, written once by `zeroflat write-checkpoint`
(Hugging Face names and sharding, one tensor per expert), into --dir or a temporary directory.
Each round runs every rank as a fresh process (gloo, the CPU); the figures are the slowest
rank's, the median of --repeat rounds with the spread (lowest-highest) beside it:
  import        import torch, transformers' model code and zeroflat (once per process)
  config        AutoConfig.from_pretrained
  model         the model built on the meta device (zeroflat.meta_parameters)
  open          the checkpoint's files opened and their headers parsed (every tensor's entry)
  prepare       Python before the library: each parameter's checkpoint tensors found by name
                (Transformers' renaming and fused-expert rules), the optimizer's groups, the
                entries the ranks compare
  library       the library's load call (agreement of the ranks, plan, reads, all-gather,
                copy check); its read and all-gather steps are shown apart
  finish        the parameters made views of the buffers
  load          zeroflat.hf.from_pretrained, start to end (config to finish)
  transformers  Transformers' own from_pretrained of the same checkpoint, for scale (1 rank)
With --cold the checkpoint's files are dropped from the page cache before every round, and the
round first reads them once, sequentially, cold (1 MiB reads, one thread: what the disk gives
for the same bytes), then drops them again: `load / sequential` is the load's time against the
disk's for the bytes the ranks read between them (each rank its share), the issue's "at the
disk" ratio (target <= 1.25 from 0.25 GB up; with tensors this small it is all fixed cost).
CLI rows: `zeroflat load CHECKPOINT --dp N` (one process, N ranks as threads), and the
rehearsal of the full-size model (`zeroflat load --model qwen3-30b-a3b --layers 48 --device
sim:h100-80gb --no-data --dp 8`), each a fresh process, wall time.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = ("import", "config", "model", "open", "prepare", "library", "read", "allgather",
          "finish", "load")


def sequential_read(path):
    """Seconds to read the checkpoint's tensor files once, in order, 1 MiB at a time."""
    start = time.perf_counter()
    buf = bytearray(1 << 20)
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(path, name), "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - start


def write_checkpoint(cli, path, args):
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
              "moe_intermediate_size": args.moe_intermediate, "num_hidden_layers": args.layers,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": args.hidden // 4,
              "num_experts": args.experts, "num_experts_per_tok": min(8, args.experts),
              "vocab_size": args.vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
              "torch_dtype": "bfloat16"}
    os.makedirs(path + ".config", exist_ok=True)
    cfg = os.path.join(path + ".config", "config.json")
    with open(cfg, "w") as f:
        json.dump(config, f)
    subprocess.run([cli, "write-checkpoint", path, "--model", cfg, "--quiet"], check=True,
                   stdout=subprocess.DEVNULL)
    shutil.copy(cfg, os.path.join(path, "config.json"))
    shutil.rmtree(path + ".config")


def rank_main(rank, world, port, path, stage, out):
    t0 = time.perf_counter()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    import transformers
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401 - the model code

    import zeroflat
    import zeroflat.hf
    from zeroflat import _load, _zero3

    times = dict.fromkeys(PHASES, 0.0)
    times["import"] = time.perf_counter() - t0
    dist.init_process_group("gloo", rank=rank, world_size=world)
    zero3 = None
    if stage == 3:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        zero3 = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 3}}

    def timed(owner, name, phase, minus=()):
        original = getattr(owner, name)

        def wrapper(*a, **k):
            inner0 = {m: times[m] for m in minus}
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                spent = time.perf_counter() - start
                times[phase] += spent - sum(times[m] - inner0[m] for m in minus)
        setattr(owner, name, wrapper)

    timed(transformers.AutoConfig, "from_pretrained", "config")
    timed(_load, "checkpoint_of", "open")
    timed(_load, "_prepare", "prepare", minus=("open",))
    timed(_load, "call_loader", "library")
    timed(_load._Flat, "finish", "finish")
    timed(_zero3.Partitions, "finish", "finish")
    original_load = zeroflat.hf.load_param_groups
    marks = {}

    def load(*a, **k):
        marks["load"] = time.perf_counter()
        groups = original_load(*a, **k)
        for g in groups:
            report = g.report
            times["read"] += report.get("read_seconds", 0.0)
            times["allgather"] += report.get("allgather_seconds", 0.0)
        return groups
    zeroflat.hf.load_param_groups = load

    dist.barrier()
    start = time.perf_counter()
    model = zeroflat.hf.from_pretrained(transformers.AutoModelForCausalLM, path,
                                        param_groups=None, zero3=zero3)
    times["load"] = time.perf_counter() - start
    times["model"] = marks["load"] - start - times["config"]
    assert model is not None
    t = torch.tensor([times[p] for p in PHASES], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        tensors = zeroflat._C.Checkpoint(path).tensors()
        out.put({"times": dict(zip(PHASES, t.tolist())), "tensors": len(tensors),
                 "parameters": len(list(model.parameters()))})
    dist.barrier()
    dist.destroy_process_group()


def transformers_main(path, out):
    import torch
    import transformers
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401 - the model code

    transformers.utils.logging.disable_progress_bar()
    start = time.perf_counter()
    transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    out.put(time.perf_counter() - start)


def timed_run(cmd):
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return time.perf_counter() - start


def summary(values):
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[2:]))
    ap.add_argument("--layers", type=int, default=48, help="decoder layers (default 48)")
    ap.add_argument("--experts", type=int, default=128, help="experts per layer (default 128)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    ap.add_argument("--moe-intermediate", type=int, default=32,
                    help="each expert's intermediate size (default 32)")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary (default 1024)")
    ap.add_argument("--ranks", default="1,2", help="rank counts, comma-separated (default 1,2)")
    ap.add_argument("--stage", type=int, choices=(2, 3), default=2,
                    help="ZeRO-2 flat buffers or ZeRO-3 partitions (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per row (default 3)")
    ap.add_argument("--cold", action="store_true",
                    help="drop the checkpoint from the page cache before each round, and time a "
                         "sequential read of it")
    ap.add_argument("--dir", help="where the checkpoint is (written there if missing)")
    ap.add_argument("--cli", default=os.path.join(ROOT, "build", "zeroflat"),
                    help="the zeroflat program for the CLI rows")
    ap.add_argument("--json", action="store_true", help="the results as JSON on stdout")
    args = ap.parse_args()
    if args.repeat < 1 or args.layers < 1 or args.experts < 1:
        ap.error("--repeat, --layers and --experts must be at least 1")
    ranks = [int(r) for r in args.ranks.split(",") if r]

    import torch.multiprocessing as mp

    sys.path.insert(0, HERE)
    from hf_load_bench import drop_cache, free_port

    tmp = None
    path = args.dir
    if path is None:
        tmp = tempfile.mkdtemp(prefix="zeroflat-fixed-")
        path = os.path.join(tmp, "ckpt")
    try:
        if not os.path.exists(os.path.join(path, "model.safetensors.index.json")) and \
                not os.path.exists(os.path.join(path, "model.safetensors")):
            write_checkpoint(args.cli, path, args)
        ctx = mp.get_context("spawn")
        rows = []
        meta = {}
        for world in ranks:
            rounds = []
            for _ in range(args.repeat):
                sequential = None
                if args.cold:
                    drop_cache(path)
                    sequential = sequential_read(path)
                    drop_cache(path)
                out = ctx.SimpleQueue()
                mp.spawn(rank_main, args=(world, free_port(), path, args.stage, out),
                         nprocs=world, join=True)
                got = out.get()
                meta = {k: got[k] for k in ("tensors", "parameters")}
                if sequential is not None:
                    got["times"]["sequential"] = sequential
                    got["times"]["load / sequential"] = got["times"]["load"] / sequential
                rounds.append(got["times"])
            rows.append({"ranks": world, "phases": {p: summary([r[p] for r in rounds])
                                                    for p in rounds[0]}})
        hf = []
        for _ in range(args.repeat):
            out = ctx.SimpleQueue()
            p = ctx.Process(target=transformers_main, args=(path, out))
            p.start()
            hf.append(out.get())
            p.join()
        cli = {}
        for world in ranks:
            cli[f"load --dp {world}"] = summary(
                [timed_run([args.cli, "load", path, "--dp", str(world), "--quiet", "--json"])
                 for _ in range(args.repeat)])
        cli["rehearsal: qwen3-30b-a3b, 48 layers, --no-data --dp 8"] = summary(
            [timed_run([args.cli, "load", "--model", "qwen3-30b-a3b", "--layers", "48",
                        "--device", "sim:h100-80gb", "--no-data", "--dp", "8", "--quiet",
                        "--json"]) for _ in range(args.repeat)])
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                   if f.endswith(".safetensors"))
        result = {"shape": {k: getattr(args, k) for k in ("layers", "experts", "hidden",
                                                            "moe_intermediate", "vocab")},
                  "stage": args.stage, "cold": args.cold, "bytes": size, **meta, "rows": rows,
                  "transformers": summary(hf), "cli": cli, "repeat": args.repeat}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return 0

    def cell(s):
        return f"{s['median']:7.3f} ({s['low']:.3f}-{s['high']:.3f})"
    print(f"fixed costs: {result['tensors']:,} tensors ({size / 1e6:.1f} MB) into "
          f"{result['parameters']:,} parameters, ZeRO-{args.stage}, "
          f"{'cold' if args.cold else 'warm'}; seconds, slowest rank, median (lowest-highest) "
          f"of {args.repeat} fresh-process rounds")
    heads = [f"{r['ranks']} rank(s)" for r in rows]
    print(f"{'phase':<18}" + "".join(f"{h:>26}" for h in heads))
    for p in rows[0]["phases"]:
        print(f"{p:<18}" + "".join(f"{cell(r['phases'][p]):>26}" for r in rows))
    print(f"{'transformers':<18}{cell(result['transformers']):>26}   (from_pretrained, 1 rank)")
    for name, s in cli.items():
        print(f"CLI {name}: {cell(s)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
