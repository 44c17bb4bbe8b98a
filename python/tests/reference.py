"""Independent references for the tests: DeepSpeed's flat buffer built with torch.cat, and small
models; and the set-up of one rank of a DeepSpeed process group on the CPU."""

import importlib
import os
import sys

import torch


def init_deepspeed_rank(rank, world, port):
    """This process as rank ``rank`` of ``world`` for DeepSpeed on the CPU accelerator over gloo,
    one thread. The CPU accelerator would compile its shared-memory all-reduce on first use (a
    minute per release, and files it leaves in /dev/shm); gloo does the collectives without it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed

    importlib.import_module("deepspeed.comm")
    comm_torch = sys.modules["deepspeed.comm.torch"]
    if hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def free_port():
    """A TCP port for a process group's store that no concurrent test takes before the store
    listens: the nodes harness's reservation (outside the ephemeral range, locked)."""
    import importlib.util

    if "zeroflat_nodes_harness" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                            "nodes.py")
        spec = importlib.util.spec_from_file_location("zeroflat_nodes_harness", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["zeroflat_nodes_harness"] = module
    return sys.modules["zeroflat_nodes_harness"].free_port()


# What a rank imports anyway, imported once before the ranks are forked. The last two are
# imported late by a rank otherwise, each rank again: torch._dynamo by the first optimizer's
# constructor, and DeepSpeed's Muon module (from 0.17; torch.compile at its import brings in
# the inductor) by DeepSpeed's check of the optimizer: together about 2 s of CPU per rank, the
# larger part of a short test's time on 2 cores. A module a release lacks is left out.
PRELOAD = ("torch", "torch.distributed", "deepspeed", "zeroflat", "zeroflat.deepspeed",
           "torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer")


def start_ranks(worker, world, *args, preload=()):
    """``worker(rank, world, port, *args)`` on ``world`` fresh ranks, as torch's spawn runs
    them, but forked by multiprocessing's fork server, which imported torch, DeepSpeed (its
    CPU accelerator), zeroflat and ``preload`` once: a spawned rank would import them again,
    seconds of CPU per rank, per run. The server does no work before it forks, so each rank
    starts as clean as a spawned one. The first call of a process starts the server; its
    modules are that call's."""
    import multiprocessing

    import torch.multiprocessing as mp

    os.environ["DS_ACCELERATOR"] = "cpu"
    multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, *preload])
    mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, join=True,
                       start_method="forkserver")


def spawn_deepspeed_workers(worker, world):
    """``worker(rank, world, port, tmpdir)`` on ``world`` ranks of DeepSpeed's CPU accelerator
    (start_ranks), sharing a temporary directory (for checkpoints) removed afterwards."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        start_ranks(worker, world, tmp)


def fork_deepspeed_ranks(worker, world, *args):
    """``worker(rank, world, port, *args)`` on ``world`` ranks forked from this process once it
    has imported PRELOAD (a spawned rank imports torch and DeepSpeed again: seconds per rank,
    per run, on 2 cores). Meant for a process of its own that has run no torch work yet (a
    script the test starts), not for the test process."""
    import torch.multiprocessing as mp

    import importlib

    os.environ["DS_ACCELERATOR"] = "cpu"
    for name in PRELOAD:  # before the fork, so that no rank imports them again
        try:
            importlib.import_module(name)
        except ImportError:
            pass

    mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, join=True,
                       start_method="fork")


def end_rank():
    """End a spawned rank that passed, after its process group is destroyed, without the
    interpreter's teardown. torch's gloo worker threads may still be releasing the last
    collective's work then; when that drops the last reference to a tensor Python made, the
    worker needs the GIL, and a thread that asks for it while the interpreter finalizes is ended
    by it, which aborts the process ("terminate called without an active exception", from
    ProcessGroupGloo::runLoop). A failing rank raises instead, and torch reports its error."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class CheckpointModel(torch.nn.Module):
    """Odd sizes (padding and partition edges fall inside parameters), two optimizer groups, a
    frozen parameter and a buffer: the DeepSpeed checkpoints test_torch_file and test_resume
    save."""

    def __init__(self, hidden=17):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(37, 13)
        self.norm = torch.nn.LayerNorm(13)
        self.fc1 = torch.nn.Linear(13, hidden)
        self.fc2 = torch.nn.Linear(hidden, 5)
        self.frozen = torch.nn.Parameter(torch.randn(7), requires_grad=False)
        self.register_buffer("scale", torch.arange(3, dtype=torch.float32))

    def forward(self, x):
        h = self.norm(self.embed(x))
        return self.fc2(torch.relu(self.fc1(h))).sum(-1) + self.frozen.sum() + self.scale.sum()

    def groups(self):
        return [{"params": [self.embed.weight, self.norm.weight, self.norm.bias]},
                {"params": [self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias],
                 "lr": 2e-3}]



def train_steps(engine, rank, steps=3, seed=100):
    """``steps`` optimizer steps of a DeepSpeed engine over a model taking token ids below 37
    (the same batches for the same rank and seed); the losses."""
    losses = []
    gen = torch.Generator().manual_seed(seed + rank)
    for _ in range(steps):
        x = torch.randint(0, 37, (2, 5), generator=gen)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def deepspeed_flat(tensors, dp, *, round_robin=False, alignment_factor=2):
    """The flat buffer as DeepSpeed builds it: the tensors (in round-robin bucket order if
    asked), concatenated, then zero-padded to a multiple of alignment_factor * dp elements."""
    tensors = list(tensors)
    if round_robin:
        order = [i for b in range(dp) for i in range(len(tensors)) if i % dp == b]
    else:
        order = list(range(len(tensors)))
    flat = torch.cat([tensors[i].detach().reshape(-1) for i in order])
    align = alignment_factor * dp
    pad = (-flat.numel()) % align
    if pad:
        flat = torch.cat([flat, torch.zeros(pad, dtype=flat.dtype, device=flat.device)])
    return flat, order


class Tiny(torch.nn.Module):
    """A small model with odd sizes (so that padding and partition edges fall inside
    parameters), a frozen parameter (its own, so parameters() lists it first) and a layer
    norm."""

    def __init__(self, seed=0, width=13):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(31, width)
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 17)
        self.fc2 = torch.nn.Linear(17, 5)
        self.frozen = torch.nn.Parameter(torch.randn(7), requires_grad=False)

    def forward(self, x):
        h = self.norm(self.embed(x))
        return self.fc2(torch.relu(self.fc1(h))).sum(-1) + self.frozen.sum()


def tiny_model(dtype=torch.bfloat16, seed=0):
    return Tiny(seed).to(dtype)
