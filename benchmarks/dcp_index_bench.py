#!/usr/bin/env python3
"""A large DCP index (.metadata) read by DCP's own FileSystemReader and by zeroflat.dcp.Reader,
each in a fresh process, median of --repeat rounds with the range and every round's ratio.

The index is what dcp.save writes for a Llama-shaped model saved with FSDP2 and AdamW at
--ranks ranks (every parameter, exp_avg and exp_avg_sq cut in dim 0 over the ranks, one chunk
per rank; 'step' and the hyperparameters as bytes items): built from DCP's own dataclasses and
pickled as DCP pickles it, with sparse data files the index's offsets fall inside. The default
shape is an 8B model at 64 ranks; a 405B model at 1,024 ranks is

  --layers 126 --hidden 16384 --intermediate 53248 --ranks 1024    (3.5 million chunks)

Each round times, in a fresh process, the reader's construction and read_metadata() (the import
of torch and of the reader before, untimed), and reports the growth of the process's peak
resident memory over the call (VmHWM, reset before it, less VmRSS then). DCP's reader unpickles the index with pickle.load (running what
it names); zeroflat's parses it with the library's restricted machine and builds DCP's Metadata
from it. The ratio is DCP's time over zeroflat's (above 1: zeroflat faster) and zeroflat's
memory over DCP's.
"""
import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import sys, time
which, path = sys.argv[1], sys.argv[2]
import torch
if which == "dcp":
    from torch.distributed.checkpoint import FileSystemReader as Reader
else:
    from zeroflat.dcp import Reader
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the resident size now
before = status("VmRSS")
start = time.perf_counter()
md = Reader(path).read_metadata()
took = time.perf_counter() - start
grew = status("VmHWM") - before
chunks = sum(len(getattr(v, "chunks", ())) for v in md.state_dict_metadata.values())
print(took, grew * 1024, chunks, len(md.storage_data))
"""


def build(path, layers, hidden, intermediate, vocab, ranks):
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       Metadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    kv = max(hidden // 8, 1)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    items, storage, at = {}, {}, 0
    files = [f"__{r}_0.distcp" for r in range(ranks)]
    for fqn, shape in shapes.items():
        for name in ("model." + fqn, "optim.state." + fqn + ".exp_avg",
                     "optim.state." + fqn + ".exp_avg_sq"):
            per = -(-shape[0] // ranks)
            chunks = []
            for r in range(ranks):
                lo, hi = min(r * per, shape[0]), min(r * per + per, shape[0])
                if hi <= lo:
                    continue
                off = torch.Size([lo] + [0] * (len(shape) - 1))
                chunks.append(ChunkStorageMetadata(offsets=off,
                                                   sizes=torch.Size([hi - lo, *shape[1:]])))
                storage[MetadataIndex(fqn=name, offset=off, index=len(chunks) - 1)] = _StorageInfo(
                    relative_path=files[r], offset=at, length=4096)
                at += 4096
            items[name] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32),
                                                size=torch.Size(shape), chunks=chunks)
        step = "optim.state." + fqn + ".step"
        items[step] = BytesStorageMetadata()
        storage[MetadataIndex(fqn=step)] = _StorageInfo(files[0], 0, 512)
    for k in ("lr", "betas", "eps", "weight_decay"):
        name = "optim.param_groups.0." + k
        items[name] = BytesStorageMetadata()
        storage[MetadataIndex(fqn=name)] = _StorageInfo(files[0], 0, 512)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=items, storage_data=storage), f)
    for name in files:
        with open(os.path.join(path, name), "wb") as f:
            f.truncate(at + 4096)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the index (a temporary folder)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as path:
        start = time.perf_counter()
        build(path, a.layers, a.hidden, a.intermediate, a.vocab, a.ranks)
        size = os.path.getsize(os.path.join(path, ".metadata"))
        print(f"index: {size / 1e6:.1f} MB, built in {time.perf_counter() - start:.1f} s "
              f"({a.layers} layers, hidden {a.hidden}, intermediate {a.intermediate}, "
              f"{a.ranks} ranks)", flush=True)
        rows = {"dcp": [], "zeroflat": []}
        for _ in range(a.repeat):
            for which in rows:
                out = subprocess.run([sys.executable, "-c", _CHILD, which, path], check=True,
                                     capture_output=True, text=True).stdout.split()
                rows[which].append((float(out[0]), int(out[1]), int(out[2]), int(out[3])))
        chunks = {r[2] for rs in rows.values() for r in rs}
        entries = {r[3] for rs in rows.values() for r in rs}
        if len(chunks) != 1 or len(entries) != 1:
            sys.exit(f"the readers disagree: chunks {chunks}, storage entries {entries}")
        print(f"chunks: {chunks.pop():,}, {size / max(entries.pop(), 1):.0f} bytes of index each")
        for which, rs in rows.items():
            t = [r[0] for r in rs]
            m = [r[1] for r in rs]
            print(f"{which:9s} read_metadata {statistics.median(t):7.2f} s "
                  f"[{min(t):.2f}-{max(t):.2f}]  memory +{statistics.median(m) / 1e9:.2f} GB")
        ratios = [d[0] / z[0] for d, z in zip(rows["dcp"], rows["zeroflat"])]
        mem = [z[1] / max(d[1], 1) for d, z in zip(rows["dcp"], rows["zeroflat"])]
        print(f"speed (dcp / zeroflat): median {statistics.median(ratios):.2f}x, rounds "
              + ", ".join(f"{r:.2f}" for r in ratios))
        print(f"memory (zeroflat / dcp): median {statistics.median(mem):.2f}x, rounds "
              + ", ".join(f"{r:.2f}" for r in mem))


if __name__ == "__main__":
    main()
