"""The DeepSpeed drop-in against the real DeepSpeed (CPU accelerator, gloo), 1 to 3 ranks:
ZeRO-1 and ZeRO-2, with and without round_robin_gradients, two param groups; the same buffers,
partitions, padding, fp32 masters and parameters as DeepSpeed's own, the same losses and
parameters after training, and a checkpoint saved with the drop-in loads without it."""

import os
import socket
import sys
import tempfile

import pytest
import torch

import deepspeed  # noqa: E402  (scripts/setup.sh installs it; python/requirements.txt)
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import zeroflat  # noqa: E402
import zeroflat.deepspeed as zd  # noqa: E402
from reference import tiny_model  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(stage, round_robin, drop_in, dtype=torch.bfloat16, seed=0, offload=False):
    model = tiny_model(dtype, seed=seed)
    # Two param groups, so that each gets its own buffer.
    groups = [{"params": [model.embed.weight, model.norm.weight, model.norm.bias]},
              {"params": [model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias],
               "lr": 2e-3}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, foreach=False)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "round_robin_gradients": round_robin},
        "zero_allow_untested_optimizer": True,
        "bf16" if dtype == torch.bfloat16 else "fp16": {"enabled": True},
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    if drop_in:
        zd.install()
    try:
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    finally:
        if drop_in:
            zd.uninstall()
    return engine, opt


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


def train(engine, rank, steps=3):
    losses = []
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randint(0, 31, (2, 5), generator=gen)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def compare(rank, stage, round_robin, offload=False):
    where = f"rank {rank} stage {stage} round_robin {round_robin} offload {offload}"
    plain, po = build(stage, round_robin, False, offload=offload)
    before = zd.stats["groups"]
    dropped, do = build(stage, round_robin, True, offload=offload)
    assert zd.stats["groups"] == before + 2, f"{where}: zeroflat built {zd.stats}"
    assert zd.stats["fallbacks"] == 0, where
    assert bool(do.cpu_offload) == offload, where
    assert same(po.bit16_groups_flat, do.bit16_groups_flat), where
    for a, b in zip(po.parallel_partitioned_bit16_groups, do.parallel_partitioned_bit16_groups):
        assert same(a, b), where
    assert po.groups_padding == do.groups_padding, where
    assert same(po.single_partition_of_fp32_groups, do.single_partition_of_fp32_groups), where
    assert po.params_in_partition.__len__() == do.params_in_partition.__len__()
    assert po.first_offset == do.first_offset, where
    assert same(list(plain.module.parameters()), list(dropped.module.parameters())), where
    # The model's parameters are views into the drop-in's buffers (no second copy).
    flats = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size())
             for f in do.bit16_groups_flat]
    for p in dropped.module.parameters():
        if p.requires_grad:
            assert any(lo <= p.data_ptr() < hi for lo, hi in flats), where
    assert train(plain, rank) == train(dropped, rank), where
    assert same(list(plain.module.parameters()), list(dropped.module.parameters())), where
    assert same(po.single_partition_of_fp32_groups, do.single_partition_of_fp32_groups), where
    return dropped


def check_checkpoint(rank, dropped, ckpt_dir):
    dropped.save_checkpoint(ckpt_dir, tag="t")
    fresh, _ = build(2, False, False, seed=7)  # other weights, DeepSpeed alone
    fresh.load_checkpoint(ckpt_dir, tag="t")
    assert same(list(fresh.module.parameters()), list(dropped.module.parameters()))
    assert same(fresh.optimizer.single_partition_of_fp32_groups,
                dropped.optimizer.single_partition_of_fp32_groups)


def worker(rank, world, port, ckpt_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    last = None
    for stage in (1, 2):
        for round_robin in (False, True):
            last = compare(rank, stage, round_robin)
    compare(rank, 2, True, offload=True)
    check_checkpoint(rank, last, ckpt_dir)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_drop_in_matches_deepspeed(world):
    os.environ["DS_ACCELERATOR"] = "cpu"
    with tempfile.TemporaryDirectory() as ckpt:
        mp.spawn(worker, args=(world, free_port(), ckpt), nprocs=world, join=True)


def test_untested_versions_are_refused_and_nothing_changes(monkeypatch):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Opt

    init, flatten = Opt.__init__, Opt.flatten_dense_tensors_aligned
    monkeypatch.setattr(deepspeed, "__version__", "0.1.0")
    with pytest.raises(RuntimeError, match="DeepSpeed 0.1.0 is not a version"):
        zd.install()
    assert Opt.__init__ is init and Opt.flatten_dense_tensors_aligned is flatten
    assert not zd.is_installed()
    with zd.installed(allow_untested=True):
        assert zd.is_installed() and Opt.__init__ is not init
    assert Opt.__init__ is init and Opt.flatten_dense_tensors_aligned is flatten
    monkeypatch.undo()
    zd.install()
    zd.install()  # twice is harmless
    zd.uninstall()
    zd.uninstall()
    assert Opt.__init__ is init and Opt.flatten_dense_tensors_aligned is flatten
