"""ZeRO-3 from a Hugging Face checkpoint to the first training step, two ways side by side:
Transformers' own ZeRO-3 loading (from_pretrained under a live HfDeepSpeedConfig, stage 3) +
deepspeed.initialize, against zeroflat.hf.from_pretrained under the same config + initialize
with the drop-in installed (which adopts the loaded partitions).

    PYTHONPATH=python .venv/bin/python benchmarks/zero3_bench.py [--ranks 1,2,4] [--rounds 3]
        [--cache warm,cold] [--ways transformers,zeroflat] [--layers 1] [--experts 26]
        [--vocab 32000] [--tiny] [--step-rounds 1] [--copies sampled] [--dir DIR]
        [--warm-gib 0] [--timeout 900] [--json] [--save FILE] [--quick]
    ... --report FILE... [--markdown]

What one run is: every rank a fresh process (gloo, DeepSpeed's CPU accelerator, cores split
between the ranks), the same DeepSpeed config both ways (ZeRO-3, bf16, torch's AdamW with one
group), the one-time imports done first and kept out of every phase (the model's code,
DeepSpeed's ZeRO-3 modules and the Muon module its optimizer check imports: the same both ways,
shown apart). Then, a barrier between phases, each rank times
  load      from_pretrained: from the config to every rank's partitions holding the
            checkpoint's values (Transformers: zero.Init builds and initializes every module
            and partitions it, then rank 0 reads the checkpoint and each module is gathered,
            filled by rank 0 and partitioned again)
  init      deepspeed.initialize, and where it goes: the Stage 3 optimizer's constructor, its
            parameter offload object and hooks, its flat partition buffers (what the drop-in
            adopts), its fp32 partitions and its optimizer state
  step      the first training step (forward, backward, optimizer step) on a fixed batch
            (32 tokens, a different one per rank), in the first --step-rounds rounds (the
            optimizer's state is allocated and zero-filled in it: seconds, the same both
            ways); then, untimed, the loss of the same batch again after the step
and counts, over the load:
  read      bytes the rank had the kernel read from storage (/proc/self/io read_bytes: what
            a cold cache costs; page-cache hits are not in it) and bytes it read through
            read()/pread() (rchar: what a warm load reads; bytes a rank touches through a
            memory mapping, as Transformers reads safetensors files, are in neither count
            when the page cache holds them); zeroflat's loader also reports its own count
  rss       the rank's peak resident memory during the load (VmHWM, reset just before the load
            by writing 5 to /proc/self/clear_refs, exact, no sampling) minus its resident
            memory before it; against the rank's partition bytes (its ds_tensors)
A row's times are each round's slowest rank, the median over --rounds rounds (the two ways
alternate within a round); bytes and rss are the largest over ranks and rounds.

The two ways must do the same work: every rank's loss of the first step, and its loss after
the step, must be bit-identical between the ways (checked in every round that takes a step;
the run fails when they are not). With one way only, each way's losses must agree across
rounds. cold: the checkpoint's files written back and dropped from the page cache
(posix_fadvise DONTNEED) before each run; warm: read into the cache before the first round.

The checkpoint: Qwen3-30B-A3B's shapes (hidden 2048, 32 heads, 4 KV heads, experts of 768)
with --layers layers, --experts experts and a --vocab vocabulary, bf16, deterministic values,
written once by Transformers' save_pretrained in 200 MB shards (defaults: 0.55 GB in 4
files); --tiny: a 2-layer model of 32 MB in 10 MB shards, for trying the harness. Kept in --dir
when given.

Targets (issue 21, at 2 and 4 ranks, warm and cold): load >= 5x faster than Transformers, load
+ initialize >= 2x; every zeroflat rank reads <= 1.15 x checkpoint / N + 8 MB (cold: read_bytes;
warm: rchar) and grows <= 1.2 x its partition bytes + 256 MB while loading. Exit status 1 when
a target is not met, 2 when the losses differ. --quick: the tiny checkpoint at 2 ranks, warm
and cold, one round (about 30 s on 2 idle cores).
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
sys.path.insert(0, HERE)
from hf_load_bench import (QWEN3_30B_A3B, drop_cache, free_port, import_once,  # noqa: E402
                           timed_calls, warm_memory, write_checkpoint)
RESULT = "ZERO3_BENCH "
WAYS = ("transformers", "zeroflat")
MB = 1_000_000


# --- one rank ----------------------------------------------------------------------------------

def proc_io():
    """This process's I/O counters (rchar, read_bytes, ...); empty where the kernel keeps none
    (some sandboxes have no /proc/self/io)."""
    out = {}
    if not os.path.exists("/proc/self/io"):
        return out
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return out


def proc_status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakResident:
    """The peak growth of resident memory over a block: VmHWM reset to the current resident
    size on entry (/proc/self/clear_refs "5"), read on exit. Where the file cannot be written,
    the growth of ru_maxrss (a lower bound: zero unless the block goes above every earlier
    peak of the process)."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM"
        except OSError:
            import resource

            self.method = "ru_maxrss"
            self.maxrss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.base = proc_status("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.method == "VmHWM":
            self.growth = proc_status("VmHWM") - self.base
        else:
            import resource

            self.growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - \
                max(self.maxrss0, self.base)


def timed_init_parts():
    """Where initialize goes: the Stage 3 optimizer's constructor and its steps (wrapped after
    the drop-in is installed: its hooks are timed with what they replace)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S3

    return timed_calls([(S3, name, label) for name, label in INIT_PARTS])


INIT_PARTS = [("__init__", "Stage 3 optimizer"),
              ("initialize_ds_offload", "  parameter offload and hooks"),
              ("_create_fp16_partitions_with_defragmentation", "  flat partitions"),
              ("_setup_for_real_optimizer", "  optimizer memory"),
              ("_create_fp32_partitions", "    fp32 partitions"),
              ("initialize_optimizer_states", "    optimizer state")]


def ds_config(world):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "train_batch_size": world,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000_000,
                                  "stage3_prefetch_bucket_size": 50_000_000,
                                  "stage3_param_persistence_threshold": 100_000},
            "zero_allow_untested_optimizer": True, "bf16": {"enabled": True},
            "steps_per_print": 1_000_000}


def rank_main(way):
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    path = env["ZERO3_BENCH_CHECKPOINT"]
    step = env.get("ZERO3_BENCH_STEP") == "1"
    env["DS_ACCELERATOR"] = "cpu"
    t0 = time.perf_counter()
    import importlib

    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import zeroflat.deepspeed as zd
    import zeroflat.hf

    importlib.import_module("deepspeed.comm")
    comm_torch = sys.modules["deepspeed.comm.torch"]
    if hasattr(comm_torch, "build_shm_op"):  # a C++ build on first use: not what is measured
        comm_torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    # One-time imports, the same both ways, kept out of every phase.
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)
    import_once("deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.partition_parameters")
    t_imports = time.perf_counter() - t0

    ds = ds_config(world)
    hf_ds = HfDeepSpeedConfig(ds)  # noqa: F841  (live: from_pretrained sees ZeRO-3 through it)
    drop_in = zd.installed() if way == "zeroflat" else None
    if drop_in is not None:
        drop_in.__enter__()
    dist.barrier()

    io0 = proc_io()
    loader = None
    with PeakResident() as resident:
        t0 = time.perf_counter()
        if way == "zeroflat":
            model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, dtype=torch.bfloat16,
                                                param_groups=None,
                                                copies=env.get("ZERO3_BENCH_COPIES", "sampled"))
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        t_load = time.perf_counter() - t0
    io1 = proc_io()
    if way == "zeroflat":
        reports = [getattr(g, "report", None) or {}
                   for g in getattr(model, "zeroflat_groups", None) or []]
        if reports:
            loader = sum(r.get("bytes_read") or 0 for r in reports)
    partition_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size()
                          for p in model.parameters() if hasattr(p, "ds_tensor"))
    not_partitioned = [n for n, p in model.named_parameters() if not hasattr(p, "ds_tensor")]
    if not_partitioned:  # initialize would partition them itself: not the loading compared here
        raise SystemExit(f"{way}: from_pretrained returned parameters that are not ZeRO-3 "
                         f"parameters ({len(not_partitioned)}, first {not_partitioned[0]})")
    dist.barrier()

    parts = timed_init_parts()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    t_init = time.perf_counter() - t0
    dist.barrier()

    t_step = loss = loss_after = step_parts = None
    if step:
        engine.train()
        gen = torch.Generator().manual_seed(1000 + rank)
        ids = torch.randint(0, config.vocab_size, (1, 32), generator=gen)
        t0 = time.perf_counter()
        out = engine(input_ids=ids, labels=ids)
        t1 = time.perf_counter()
        engine.backward(out.loss)
        t2 = time.perf_counter()
        engine.step()
        t_step = time.perf_counter() - t0
        step_parts = {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t_step - (t2 - t0)}
        loss = out.loss.detach().float().item()
        with torch.no_grad():
            loss_after = engine(input_ids=ids, labels=ids).loss.float().item()
    stats = None
    if zd.is_installed():
        stats = {k: zd.stats.get(k)
                 for k in ("adopted", "fallbacks", "not_adopted", "stage3_refused")}
    if drop_in is not None:
        drop_in.__exit__(None, None, None)
    dist.barrier()
    print(RESULT + json.dumps({
        "rank": rank, "world": world, "way": way, "imports": t_imports, "load": t_load,
        "init": t_init, "init_parts": parts, "step": t_step, "step_parts": step_parts,
        "loss": loss, "loss_after": loss_after,
        "loss_hex": None if loss is None else float.hex(loss),
        "loss_after_hex": None if loss_after is None else float.hex(loss_after),
        "read_bytes": io1["read_bytes"] - io0["read_bytes"], "rchar": io1["rchar"] - io0["rchar"],
        "loader_bytes_read": loader, "rss_growth": resident.growth,
        "rss_method": resident.method, "partition_bytes": partition_bytes,
        "drop_in": stats}), flush=True)
    # The rank ends here, both ways, without tearing the process group and the engine down:
    # Transformers' way sometimes aborts in that teardown ("terminate called without an active
    # exception", after its result is printed), which is no part of what is measured.
    sys.stderr.flush()
    os._exit(0)


# --- the runs ----------------------------------------------------------------------------------

def checkpoint_files(path):
    return [os.path.join(path, n) for n in sorted(os.listdir(path))]


def read_into_cache(path):
    for name in checkpoint_files(path):
        with open(name, "rb") as f:
            while f.read(1 << 24):
                pass


TINY = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64)


def run_once(way, world, path, cold, step, timeout, log, copies="sampled"):
    if cold:
        drop_cache(path)
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // world)
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu",
                   ZERO3_BENCH_CHECKPOINT=path, ZERO3_BENCH_STEP="1" if step else "0",
                   ZERO3_BENCH_COPIES=copies)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", way],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            out, err = p.communicate()
            err += f"\n(timed out after {timeout:g} s)"
        outs.append((p.returncode, out, err))
    ranks = []
    for rank, (code, out, err) in enumerate(outs):
        lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
        if code != 0 or not lines:
            raise RuntimeError(f"{way}, {world} rank(s), rank {rank} exited {code}:\n"
                               + err[-4000:] + out[-1000:])
        ranks.append(json.loads(lines[-1][len(RESULT):]))
    worst = lambda key: max(r[key] for r in ranks)  # noqa: E731
    res = {"load": worst("load"), "init": worst("init"), "imports": worst("imports"),
           "ready": max(r["load"] + r["init"] for r in ranks),
           "step": worst("step") if step else None, "ranks": ranks}
    log(f"  {way:>12} x{world} {'cold' if cold else 'warm'}: load {res['load']:.2f} s, init "
        f"{res['init']:.2f} s" + (f", step {res['step']:.2f} s (rank 0: " + ", ".join(
            f"{k} {v:.2f}" for k, v in ranks[0]["step_parts"].items()) + ")" if step else "")
        + f", rss {max(r['rss_growth'] for r in ranks) / MB:.0f} MB, read_bytes "
        f"{max(r['read_bytes'] for r in ranks) / MB:.0f} MB")
    return res


def compare_losses(runs, ways):
    """Every rank's loss of the first step and after it, bit for bit: between the ways in each
    round, or (one way) across the rounds. Returns a list of the differences."""
    bad = []
    stepped = {w: [r for r in runs[w] if r["step"] is not None] for w in ways}
    keys = ("loss_hex", "loss_after_hex")
    if len(ways) == 2:
        for i, (a, b) in enumerate(zip(stepped[ways[0]], stepped[ways[1]])):
            for ra, rb in zip(a["ranks"], b["ranks"]):
                for k in keys:
                    if ra[k] != rb[k]:
                        bad.append(f"round {i + 1}, rank {ra['rank']}, {k[:-4]}: {ways[0]} "
                                   f"{ra[k[:-4]]!r}, {ways[1]} {rb[k[:-4]]!r}")
    for w in ways:
        for i, run in enumerate(stepped[w][1:], 2):
            for ra, rb in zip(stepped[w][0]["ranks"], run["ranks"]):
                for k in keys:
                    if ra[k] != rb[k]:
                        bad.append(f"{w}, rank {ra['rank']}, {k[:-4]}: round 1 {ra[k[:-4]]!r}, "
                                   f"round {i} {rb[k[:-4]]!r}")
    return bad


def summarize(runs, ways, world, cache, size):
    row = {"ranks": world, "cache": cache, "rounds": len(runs[ways[0]])}
    for w in ways:
        rs = runs[w]
        steps = [r["step"] for r in rs if r["step"] is not None]
        ranks = [x for r in rs for x in r["ranks"]]
        row[w] = {"load": statistics.median(r["load"] for r in rs),
                  "init": statistics.median(r["init"] for r in rs),
                  "ready": statistics.median(r["ready"] for r in rs),
                  "step": statistics.median(steps) if steps else None,
                  "imports": max(r["imports"] for r in rs),
                  "read_bytes": max(x["read_bytes"] for x in ranks),
                  "read_bytes_per_rank": [max(x["read_bytes"] for x in ranks if x["rank"] == k)
                                          for k in range(world)],
                  "rchar": max(x["rchar"] for x in ranks),
                  "loader_bytes_read": max((x["loader_bytes_read"] or 0) for x in ranks),
                  "rss_growth": max(x["rss_growth"] for x in ranks),
                  "rss_method": ranks[0]["rss_method"],
                  "partition_bytes": max(x["partition_bytes"] for x in ranks),
                  "losses": [x["loss"] for x in rs[0]["ranks"]] if steps else None,
                  "drop_in": ranks[0]["drop_in"],
                  "init_parts": {k: statistics.median(r["ranks"][0]["init_parts"].get(k, 0)
                                                      for r in rs)
                                 for _, k in INIT_PARTS}}
    if len(ways) == 2:
        t, z = row["transformers"], row["zeroflat"]
        row["load_x"] = t["load"] / z["load"]
        row["ready_x"] = t["ready"] / z["ready"]
        row["init_x"] = t["init"] / z["init"]
        row["step_x"] = t["step"] / z["step"] if t["step"] and z["step"] else None
    # Per-rank budgets for the one who is meant to be lean.
    for w in ways:
        r = row[w]
        read = r["read_bytes"] if cache == "cold" else r["rchar"]
        r["read_budget"] = 1.15 * size / world + 8 * MB
        r["read_x_share"] = read / (size / world)
        r["rss_budget"] = 1.2 * r["partition_bytes"] + 256 * MB
    return row


def targets(rows, ways):
    out = []

    def add(name, value, limit, met):
        out.append({"target": name, "value": value, "limit": limit, "met": bool(met)})
    if "zeroflat" not in ways:
        return out
    for row in rows:
        if row["ranks"] not in (2, 4):
            continue
        at = f"{row['ranks']} ranks {row['cache']}"
        z = row["zeroflat"]
        if "transformers" in ways:
            add(f"{at}: load, Transformers / zeroflat >= 5", row["load_x"], 5,
                row["load_x"] >= 5)
            add(f"{at}: load + initialize, Transformers / zeroflat >= 2", row["ready_x"], 2,
                row["ready_x"] >= 2)
        read = z["read_bytes"] if row["cache"] == "cold" else z["rchar"]
        add(f"{at}: bytes read per rank ({'read_bytes' if row['cache'] == 'cold' else 'rchar'})"
            f" <= 1.15 x checkpoint / N + 8 MB, MB", read / MB, z["read_budget"] / MB,
            read <= z["read_budget"])
        add(f"{at}: resident growth per rank <= 1.2 x partition + 256 MB, MB",
            z["rss_growth"] / MB, z["rss_budget"] / MB, z["rss_growth"] <= z["rss_budget"])
    return out


def nested(parts, total, name):
    """'a 1.00 (b 0.50 (c 0.20, other 0.30), other 0.50), the rest of name 0.10' from labels
    indented two spaces a level."""
    def level(keys, depth, whole, label):
        own = [k for k in keys if len(k) - len(k.lstrip()) == depth]
        if not own:
            return ""
        items = []
        for i, k in enumerate(own):
            below = keys[keys.index(k) + 1:keys.index(own[i + 1]) if i + 1 < len(own) else None]
            inner = level(below, depth + 2, parts[k], "other")
            items.append(f"{k.strip()} {parts[k]:.2f}" + (f" ({inner})" if inner else ""))
        items.append(f"{label} {whole - sum(parts[k] for k in own):.2f}")
        return ", ".join(items)
    return level(list(parts), 0, total, f"the rest of {name}")


def markdown(rows, ways):
    """The ratio table for docs/performance.md: times T / Z with T/Z, and zeroflat's (and
    Transformers') worst rank's bytes read and resident growth against their budgets."""
    print("| ranks | cache | load s | x | initialize s | x | load + initialize s | x | first step "
          "s | read per rank MB | budget | resident growth MB | budget |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        t, z = (r[w] for w in ways)
        read = {w: r[w]["read_bytes"] if r["cache"] == "cold" else r[w]["rchar"] for w in ways}
        cells = [str(r["ranks"]), r["cache"]]
        for key, x in (("load", "load_x"), ("init", "init_x"), ("ready", "ready_x")):
            cells += [f"{fmt(t[key])} / {fmt(z[key])}", f"**{r[x]:.2f}**"]
        cells.append(f"{fmt(t['step'])} / {fmt(z['step'])}")
        cells += [f"{read['zeroflat'] / MB:.0f} ({read['transformers'] / MB:.0f})",
                  f"{z['read_budget'] / MB:.0f}",
                  f"{z['rss_growth'] / MB:.0f} ({t['rss_growth'] / MB:.0f})",
                  f"{z['rss_budget'] / MB:.0f}"]
        print("| " + " | ".join(cells) + " |")


def report(args, describe, size, rows, ways, verdicts, bad):
    print(f"{describe}: {size / 1e9:.3f} GB; ZeRO-3, bf16, gloo, CPU accelerator; median of "
          f"{args.rounds} round(s), slowest rank; times in s, T = Transformers, Z = zeroflat")
    two = len(ways) == 2
    head = f"{'ranks':>5} {'cache':>5} |"
    for phase in ("load", "init", "load+init", "step"):
        head += f" {phase + ' T':>9} {'Z':>6} {'T/Z':>5} |" if two else f" {phase:>9} |"
    print(head)
    for r in rows:
        line = f"{r['ranks']:>5} {r['cache']:>5} |"
        for phase, key, x in (("load", "load", "load_x"), ("init", "init", "init_x"),
                              ("ready", "ready", "ready_x"), ("step", "step", "step_x")):
            vals = [r[w][key] for w in ways]
            fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            if two:
                ratio = r.get(x)
                line += f" {fmt(vals[0]):>9} {fmt(vals[1]):>6} {fmt(ratio):>5} |"
            else:
                line += f" {fmt(vals[0]):>9} |"
        print(line)
    print("per rank, the largest over ranks and rounds (MB): read_bytes (the kernel's, from "
          "storage) / rchar (read() calls) / the loader's count; resident growth during the "
          "load / partition bytes")
    for r in rows:
        for w in ways:
            x = r[w]
            per_rank = " ".join(f"{b / MB:.0f}" for b in x["read_bytes_per_rank"])
            print(f"{r['ranks']:>5} {r['cache']:>5} {w:>12}: read_bytes {x['read_bytes'] / MB:7.1f}"
                  f" (ranks: {per_rank}) rchar {x['rchar'] / MB:7.1f} loader "
                  f"{x['loader_bytes_read'] / MB:7.1f} | budget {x['read_budget'] / MB:6.1f} | "
                  f"rss +{x['rss_growth'] / MB:7.1f} / partition {x['partition_bytes'] / MB:6.1f}"
                  f" (budget {x['rss_budget'] / MB:6.1f}, {x['rss_method']})"
                  + (f" | drop-in {x['drop_in']}" if w == "zeroflat" else ""))
    print("where initialize goes (rank 0, median s):")
    for r in rows:
        for w in ways:
            parts = r[w]["init_parts"]
            print(f"{r['ranks']:>5} {r['cache']:>5} {w:>12}: {r[w]['init']:.2f} s (slowest rank):"
                  f" {nested(parts, r[w]['init'], 'initialize')}")
    imports = max(r[w]["imports"] for r in rows for w in ways)
    print(f"not in any phase: the one-time imports, up to {imports:.2f} s per rank (the same both "
          "ways)")
    losses = [f"{r['ranks']} {r['cache']}: " + ", ".join(f"{v:.6f}" for v in r[ways[0]]["losses"])
              for r in rows if r[ways[0]]["losses"]]
    if losses:
        same = "both ways" if two else "across rounds"
        print(f"first-step losses per rank ({'NOT ' if bad else ''}bit-identical {same}): "
              + "; ".join(losses))
    if verdicts:
        print("targets (2 and 4 ranks):")
        for v in verdicts:
            print(f"  {'met    ' if v['met'] else 'NOT met'} {v['target']}: {v['value']:.2f}"
                  f" (limit {v['limit']:.2f})")


def save(path, describe, size, args, ways, rows, bad):
    doc = {"checkpoint": describe, "checkpoint_bytes": size, "rounds": args.rounds,
           "step_rounds": args.step_rounds, "ways": ways, "rows": rows,
           "targets": targets(rows, ways), "loss_differences": bad}
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


def main():
    if sys.argv[1:2] == ["--rank"]:
        return rank_main(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes (default "
                                                     "1,2,4)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh runs per way and row; the "
                                                          "median is reported (default 3)")
    ap.add_argument("--cache", default="warm,cold", help="warm, cold or both (default both)")
    ap.add_argument("--ways", default="transformers,zeroflat",
                    help="which ways to run (one alone: no ratios; its losses are compared "
                         "across rounds)")
    ap.add_argument("--step-rounds", type=int, default=None,
                    help="rounds that also take the first training step (default: all); the "
                         "losses are compared in those")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=26,
                    help="experts per layer (default 26: with 1 layer and a 32,000 vocabulary, "
                         "0.55 GB)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer model of hidden 512 (32 MB): try the harness quickly")
    ap.add_argument("--dir", help="where the checkpoint is kept (written there when missing; "
                                  "default: a temporary directory, removed at the end)")
    ap.add_argument("--warm-gib", type=int, default=0,
                    help="GiB of memory to touch once before measuring (on a virtual machine "
                         "the first touch of memory the guest has not used costs a hypervisor "
                         "fault; see docs/performance.md)")
    ap.add_argument("--copies", default="sampled", choices=("sampled", "full", "off"),
                    help="zeroflat's check that the ranks' copies of the checkpoint agree "
                         "(from_pretrained's copies; default sampled: it reads a sample of the "
                         "other ranks' bytes)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--quick", action="store_true",
                    help="--tiny --ranks 2 --rounds 1: about 30 s on 2 idle cores")
    ap.add_argument("--json", action="store_true", help="the results as JSON on stdout")
    ap.add_argument("--save", help="also write the results as JSON there (after every row)")
    ap.add_argument("--report", metavar="FILE", nargs="+",
                    help="print the tables of files --save wrote (a run cut short included), "
                         "their rows together (the same checkpoint and ways)")
    ap.add_argument("--markdown", action="store_true",
                    help="with --report: the rows as one Markdown table")
    args = ap.parse_args()
    if args.report:
        docs = []
        for name in args.report:
            with open(name) as f:
                docs.append(json.load(f))
        doc = docs[0]
        if any((d["checkpoint"], d["ways"]) != (doc["checkpoint"], doc["ways"]) for d in docs):
            ap.error("--report: the files are of different checkpoints or ways")
        rows = [r for d in docs for r in d["rows"]]
        ways = tuple(doc["ways"])
        bad = [b for d in docs for b in d["loss_differences"]]
        if args.markdown:
            markdown(rows, ways)
            return 0
        args.rounds = "/".join(sorted({str(d["rounds"]) for d in docs}))
        report(args, doc["checkpoint"], doc["checkpoint_bytes"], rows, ways,
               targets(rows, ways), bad)
        return 0
    if args.quick:
        args.tiny, args.ranks, args.rounds = True, "2", 1
    ways = tuple(w for w in args.ways.split(",") if w)
    caches = [c for c in args.cache.split(",") if c]
    worlds = [int(r) for r in args.ranks.split(",") if r]
    if not ways or any(w not in WAYS for w in ways) or any(c not in ("warm", "cold")
                                                            for c in caches):
        ap.error("--ways takes transformers and/or zeroflat, --cache warm and/or cold")
    if args.rounds < 1 or not worlds or min(worlds) < 1:
        ap.error("--rounds and every --ranks must be at least 1")
    step_rounds = args.rounds if args.step_rounds is None else args.step_rounds
    log = (lambda msg: print(f"[zero3_bench] {msg}", file=sys.stderr, flush=True))

    tmp = tempfile.mkdtemp(prefix="zeroflat-zero3-bench-")
    name = "checkpoint-tiny" if args.tiny else \
        f"checkpoint-l{args.layers}-e{args.experts}-v{args.vocab}"
    path = os.path.join(args.dir or tmp, name)
    rows = []
    bad = []
    try:
        if not os.path.exists(os.path.join(path, "config.json")):
            log(f"writing the checkpoint to {path}")
            if args.tiny:
                write_checkpoint(path, 2, 8, 8192, TINY, shard="10MB")
            else:
                write_checkpoint(path, args.layers, args.experts, args.vocab, QWEN3_30B_A3B)
        size = sum(os.path.getsize(f) for f in checkpoint_files(path)
                   if f.endswith(".safetensors"))
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        files = sum(f.endswith(".safetensors") for f in checkpoint_files(path))
        experts = cfg.get("num_local_experts") or cfg.get("num_experts")
        describe = (f"{cfg.get('model_type')}, {cfg.get('num_hidden_layers')} layer(s), "
                    f"{experts} experts, hidden {cfg.get('hidden_size')}, vocab "
                    f"{cfg.get('vocab_size')}, {files} file(s)")
        warm_memory(args.warm_gib)
        for world in worlds:  # in the order given: the rows wanted first, first
            for cache in caches:
                if cache == "warm":
                    read_into_cache(path)
                runs = {w: [] for w in ways}
                for i in range(args.rounds):
                    for w in ways:
                        runs[w].append(run_once(w, world, path, cache == "cold", i < step_rounds,
                                                args.timeout, log, args.copies))
                diff = compare_losses(runs, ways)
                bad += [f"{world} rank(s) {cache}: {d}" for d in diff]
                rows.append(summarize(runs, ways, world, cache, size))
                if args.save:  # after every row: a run cut short keeps what it measured
                    save(args.save, describe, size, args, ways, rows, bad)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    verdicts = targets(rows, ways)
    doc = save(args.save, describe, size, args, ways, rows, bad)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        report(args, describe, size, rows, ways, verdicts, bad)
    if bad:
        print("LOSSES DIFFER (the two ways did not do the same work):\n  " + "\n  ".join(bad),
              file=sys.stderr)
        return 2
    return 0 if all(v["met"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
