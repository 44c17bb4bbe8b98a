"""Saves a small ZeRO checkpoint with DeepSpeed itself, for the main job's resume (scripts/demo.sh):
a model of a few decoder-like blocks (about 20M parameters, two optimizer groups, a frozen
parameter and a buffer), trained two AdamW steps in bf16 at WORLD ranks on the CPU (gloo), then
saved by `engine.save_checkpoint(OUT, tag="step2")`.

With --zeroflat-save OUT2, it then saves again through zeroflat's drop-in
(`zeroflat.deepspeed.install()`): `save_checkpoint(OUT2, tag="step3")` returns once the state is
snapshotted, two more steps run while the library writes and publishes it, and a fresh engine
resumes from OUT2 through the drop-in and checks that every parameter is the saved one. Rank 0
prints how long each save blocked.

    python scripts/demo_checkpoint.py OUT [--world 2] [--stage 2] [--hidden 512] [--layers 4]
                                      [--zeroflat-save OUT2]"""

import argparse
import os
import socket
import sys


class Blocks:
    """Built inside the rank (torch is imported there)."""

    @staticmethod
    def make(hidden, layers, vocab):
        import torch

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.embed = torch.nn.Embedding(vocab, hidden)
                self.blocks = torch.nn.ModuleList(
                    torch.nn.Sequential(torch.nn.LayerNorm(hidden),
                                        torch.nn.Linear(hidden, 4 * hidden),
                                        torch.nn.GELU(),
                                        torch.nn.Linear(4 * hidden, hidden))
                    for _ in range(layers))
                self.head = torch.nn.Linear(hidden, 7)
                self.frozen = torch.nn.Parameter(torch.randn(11), requires_grad=False)
                self.register_buffer("scale", torch.arange(3, dtype=torch.float32))

            def forward(self, x):
                h = self.embed(x)
                for b in self.blocks:
                    h = h + b(h)
                return self.head(h).float().pow(2).mean() + self.frozen.sum() * 0

            def groups(self):
                decay = [p for n, p in self.named_parameters() if p.requires_grad and p.dim() > 1]
                other = [p for n, p in self.named_parameters() if p.requires_grad and p.dim() <= 1]
                return [{"params": decay, "weight_decay": 0.01},
                        {"params": other, "weight_decay": 0.0}]

        return Model()


def rank_main(rank, world, port, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import logging

    import torch

    torch.set_num_threads(1)
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    # The CPU accelerator would compile a shared-memory all-reduce on first use; gloo does.
    import importlib

    importlib.import_module("deepspeed.comm")
    comm_torch = sys.modules["deepspeed.comm.torch"]
    if hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    engine = make_engine(args)
    gen = torch.Generator().manual_seed(rank)

    def steps(n):
        for _ in range(n):
            loss = engine(torch.randint(0, args.vocab, (2, 8), generator=gen))
            engine.backward(loss)
            engine.step()

    import time

    steps(2)
    torch.distributed.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(args.out, tag="step2")
    theirs = time.perf_counter() - start
    torch.distributed.barrier()
    if args.zeroflat_save:
        zeroflat_save(engine, steps, theirs, rank, args)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def make_engine(args):
    """The demo's model under ZeRO (args.stage), AdamW in two groups, bf16."""
    import deepspeed
    import torch

    model = Blocks.make(args.hidden, args.layers, args.vocab)
    optimizer = torch.optim.AdamW(model.groups(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": args.stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def zeroflat_save(engine, steps, theirs, rank, args):
    """The drop-in's save in the background, steps while it writes, then a resume from it."""
    import time

    import torch

    import zeroflat.deepspeed as zd

    zd.install()
    steps(1)
    torch.distributed.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(args.zeroflat_save, tag="step3")
    ours = time.perf_counter() - start
    saved = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    steps(2)  # while the library writes step3
    during = time.perf_counter() - start
    zd.wait(every_rank=True)
    published = time.perf_counter() - start
    if rank == 0:
        print(f"save_checkpoint: DeepSpeed's own blocked {theirs * 1e3:.0f} ms; zeroflat's "
              f"returned in {ours * 1e3:.0f} ms ({theirs / ours:.1f}x sooner), 2 steps ran while "
              f"it wrote ({during * 1e3:.0f} ms after the call), published in "
              f"{published * 1e3:.0f} ms", flush=True)
    # A fresh engine resumes from what the drop-in wrote.
    import deepspeed

    fresh = make_engine(args)
    path, _ = fresh.load_checkpoint(args.zeroflat_save)
    assert path is not None, "the drop-in's checkpoint did not load"
    import contextlib

    gather = (deepspeed.zero.GatheredParameters(list(fresh.module.parameters()))
              if args.stage == 3 else contextlib.nullcontext())
    with gather:
        same = all(torch.equal(p.detach().float(), saved[n])
                   for n, p in fresh.module.named_parameters() if n in saved)
    if rank == 0:
        print(f"resumed from {os.path.basename(path)} by the drop-in: every parameter "
              f"{'equal to' if same else 'DIFFERENT from'} the saved one", flush=True)
    assert same


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--zeroflat-save", metavar="OUT2", default=None,
                   help="then save through zeroflat's drop-in here, in the background, and "
                        "resume from it")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    mp.start_processes(rank_main, args=(args.world, port, args), nprocs=args.world, join=True,
                       start_method="fork")


if __name__ == "__main__":
    main()
