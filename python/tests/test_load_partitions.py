"""ZeRO-3 through the binding: zero3_layout's sub-groups are the ones DeepSpeed's own
_create_fp16_sub_groups cuts (the installed release's code, run on stand-in parameters), and the
library's load with the partitions placement on 2 gloo ranks gives each rank exactly torch's own
slicing of every tensor (flattened, padded to a multiple of the world, rank r's chunk; bf16 from
an fp32 file), with an error on one rank raised on both."""

import os
import random

import pytest
import torch
import torch.distributed as dist

from reference import end_rank, start_ranks
from test_load import save
from zeroflat import _C
from zeroflat._comm import TorchComm, comm_device


class _Param:
    """What _create_fp16_sub_groups asks of a parameter: its partition's element count."""

    def __init__(self, numel, world):
        self.numel = -(-numel // world)

    def partition_numel(self):
        return self.numel


def test_sub_groups_are_deepspeeds_own():
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    cut = stage3.DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups
    rnd = random.Random(5)
    for _ in range(300):
        world = rnd.choice([1, 2, 3, 4, 8])
        groups = [[rnd.choice([0, 1, 3, 7, 64, 1000, 4097]) for _ in range(rnd.randint(1, 9))]
                  for _ in range(rnd.randint(1, 3))]
        size = rnd.choice([0, 1, 5, 100, 2000, 10**9])
        lay = _C.zero3_layout(groups, world, size, world - 1)
        want, first = [], 0
        for g, numels in enumerate(groups):
            params = [_Param(n, world) for n in numels]
            holder = type("Stage3", (), {"sub_group_size": size})()
            for sub in cut(holder, params):
                ids = [first + params.index(p) for p in sub]
                assert ids == list(range(ids[0], ids[0] + len(ids)))
                want.append((g, ids[0], len(ids), sum(p.numel for p in sub)))
            first += len(numels)
        got = [(s["group"], s["params"][0], s["params"][1], s["numel"]) for s in lay["sub_groups"]]
        assert got == want, (groups, world, size)
        flat = [n for g in groups for n in g]
        assert lay["partition_numels"] == [-(-n // world) for n in flat]
        assert lay["groups_padding"] == [
            [(-n) % world for n in flat[s[1]: s[1] + s[2]]] for s in got]
        if world > 1:
            assert _C.zero3_layout(groups, world, size, 0)["groups_padding"] == [
                [0] * s[2] for s in got]


def tensors():
    g = torch.Generator().manual_seed(7)
    # Odd sizes: padding on the last rank, a tensor smaller than the world, one of 0 elements.
    return {"a": torch.randn(5, 7, generator=g), "b": torch.randn(3, generator=g),
            "c": torch.randn(1, generator=g), "d": torch.randn(0),
            "e": torch.randn(4, 4, generator=g)}


def worker(rank, world, port, path):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        ck = _C.Checkpoint(path)
        engine = _C.TorchDevice("cpu", 1)
        comm = TorchComm(dist.group.WORLD, engine, comm_device(dist.group.WORLD,
                                                               torch.device("cpu")))
        src = tensors()
        params = [_C.LoadParam(name=n, shape=list(t.shape)) for n, t in src.items()]
        options = _C.FlattenOptions(layout=_C.LayoutOptions(dp=world, dtype="bf16"), threads=1,
                                     master=False)
        report, flat, master, _ = _C.load(engine, comm, ck, params, options,
                                          _C.LoadPlacement("partitions"))
        assert report["tier"] == "load-partitions"
        assert master is None
        # torch's own slicing: flattened, padded to a multiple of the world, rank r's chunk.
        want = []
        for t in src.values():
            p = -(-t.numel() // world)
            padded = torch.zeros(p * world, dtype=torch.bfloat16)
            padded[: t.numel()] = t.reshape(-1).to(torch.bfloat16)
            want.append(padded[rank * p: (rank + 1) * p])
        want = torch.cat(want)
        got = flat[: want.numel() * 2].view(torch.bfloat16)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert report["bytes_read"] == sum(
            4 * max(0, min(-(-t.numel() // world), t.numel() - rank * -(-t.numel() // world)))
            for t in src.values())
        # A tensor one rank lacks: InvalidArgument on both, before anything is read.
        bad = params + ([_C.LoadParam(name="missing", shape=[2])] if rank == 1 else [])
        with pytest.raises(_C.InvalidArgument):
            _C.load(engine, comm, ck, bad, options, _C.LoadPlacement("partitions"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    end_rank()


def test_two_gloo_ranks_hold_torchs_own_slices(tmp_path):
    path = str(save(tmp_path / "model.safetensors", tensors()))
    start_ranks(worker, 2, path)
