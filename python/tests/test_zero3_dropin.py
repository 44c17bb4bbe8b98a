"""The drop-in for DeepSpeed's Stage 3 optimizer against the real DeepSpeed ZeRO-3 (CPU
accelerator, gloo), for whichever release this interpreter imports (ctest runs it once more per
supported release, each from its own folder, with a reduced set of cases): a small model built
under ``deepspeed.zero.Init`` (an embedding, a layer norm, linear layers, a parameter smaller than
the world, sizes that are not multiples of it, a frozen parameter), two optimizer param groups
cut into several sub-groups, bf16 and fp16, offload_param and offload_optimizer to the CPU, at
1, 2 and 3 ranks: with and without the drop-in, the same lp_param_buffer, flat partitions, fp32
partitions, padding and ds_tensors, every buffer built by zeroflat; the same parameters and
losses after three steps. Partitions that already are back-to-back views of one buffer are
adopted as they are; a buffer zeroflat cannot build is DeepSpeed's own, with one warning. The
library's ``zero3_layout`` equals the release's own bookkeeping (sub-groups, their members and
offsets, each partition's size and offset, groups_padding)."""

import contextlib
import logging
import os
import sys

import pytest
import torch

import deepspeed  # noqa: E402  (the release under test)

sys.path.insert(0, os.path.dirname(__file__))
import zeroflat  # noqa: E402
import zeroflat.deepspeed as zd  # noqa: E402
from reference import (end_rank, init_deepspeed_rank,  # noqa: E402
                       spawn_deepspeed_workers, train_steps as train)

RELEASE = deepspeed.__version__.split("+")[0]
assert os.environ.get("ZEROFLAT_DEEPSPEED_RELEASE", RELEASE) == RELEASE, (
    f"expected DeepSpeed {os.environ.get('ZEROFLAT_DEEPSPEED_RELEASE')}, imported {RELEASE} "
    f"from {deepspeed.__file__}: run scripts/setup.sh, which installs every tested release")
# ctest's run for another release than the environment's own: the reduced set.
REDUCED = "ZEROFLAT_DEEPSPEED_RELEASE" in os.environ


class Model(torch.nn.Module):
    """Sizes that are not multiples of 2 or 3 (partition edges and the last rank's padding fall
    inside parameters), ``tiny`` with fewer elements than ranks, a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(37, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.fc1 = torch.nn.Linear(24, 29)
        self.fc2 = torch.nn.Linear(29, 11)
        self.tiny = torch.nn.Parameter(torch.full((1,), 0.5))
        self.frozen = torch.nn.Parameter(torch.linspace(-1, 1, 7), requires_grad=False)

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(self.norm(self.embed(x)))))
        return h.sum(-1) * self.tiny + self.frozen.sum()

    def groups(self):
        # Stage 3 leaves the frozen parameter out of its group.
        return [{"params": [self.embed.weight, self.frozen, self.norm.weight, self.norm.bias,
                            self.tiny]},
                {"params": [self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias],
                 "lr": 2e-3, "weight_decay": 0.0}]


def config_of(case):
    dtype, offload_param, offload_optimizer = case
    zero = {"stage": 3, "sub_group_size": 100, "stage3_param_persistence_threshold": 0}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "zero_force_ds_cpu_optimizer": False}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    else:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return config


def zero_padding(model):
    """zero.Init leaves the last rank's padding of each partition as it found the memory
    (torch.empty): both runs start from zeros there, so that whole buffers compare."""
    rank = torch.distributed.get_rank()
    for p in model.parameters():
        part = p.ds_tensor.numel()
        valid = max(0, min(part, p.ds_numel - rank * part))
        p.ds_tensor.data[valid:].zero_()


def build(case, drop_in, prepare=None, seed=0):
    """The engine and optimizer of a model made under zero.Init, with the drop-in or without.
    ``prepare(model, config)`` may rearrange the partitions before the optimizer sees them."""
    config = config_of(case)
    torch.manual_seed(seed)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Model()
    zero_padding(model)
    if prepare is not None:
        prepare(model, config)
    optimizer = torch.optim.AdamW(model.groups(), lr=1e-3, foreach=False)
    with zd.installed() if drop_in else contextlib.nullcontext():
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, opt


def snapshot():
    """zd.stats as it is now (its lists copied)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in zd.stats.items()}


def same(a, b):
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b))


def gathered(engine):
    """Every parameter whole, from the ranks' ds_tensors by torch's all-gather (GatheredParameters
    of the releases before 0.19 gave values that changed from one call to the next on the CPU
    accelerator here, with or without the drop-in)."""
    world = torch.distributed.get_world_size()
    out = []
    for p in engine.module.parameters():
        parts = [torch.empty_like(p.ds_tensor) for _ in range(world)]
        torch.distributed.all_gather(parts, p.ds_tensor.detach().contiguous())
        out.append(torch.cat(parts)[:p.ds_numel].view(p.ds_shape))
    return out


def ds_tensors(engine):
    return [p.ds_tensor.detach().clone() for p in engine.module.parameters()]


def buffers(opt):
    """The lp buffer(s) of a Stage 3 optimizer: lp_param_buffer (from 0.15; 0.14 keeps it only
    as the sub-groups' base), or the host buffer of each param group with offload_param."""
    if getattr(opt, "offload_param", False):
        return list(opt.param_groups_fp16_flat_cpu_memory)
    if hasattr(opt, "lp_param_buffer"):
        return [opt.lp_param_buffer]
    return []


def check_bookkeeping(opt, rank, world, where):
    """zeroflat's Stage 3 layout (the library's zero3_layout) against the release's own."""
    groups = [[p.ds_numel for p in g["params"]] for g in opt.trainable_param_groups]
    lay = zeroflat._C.zero3_layout(groups, world, int(opt.sub_group_size), rank)
    assert [sg["numel"] for sg in lay["sub_groups"]] == opt.fp16_partitioned_groups_flat_numel, \
        where
    assert lay["groups_padding"] == opt.groups_padding, where
    members, first = [], 0
    for sub_group in opt.fp16_groups:
        members.append([first, len(sub_group)])
        first += len(sub_group)
    assert [list(sg["params"]) for sg in lay["sub_groups"]] == members, (where, lay, members)
    assert [sg["group"] for sg in lay["sub_groups"]] == [
        opt.sub_group_to_group_id[i] for i in range(len(opt.fp16_groups))], where
    assert lay["buffer_numel"] == sum(opt.fp16_partitioned_groups_flat_numel), where
    partitions = [p.ds_tensor.numel() for sg in opt.fp16_groups for p in sg]
    assert lay["partition_numels"] == partitions, where
    if not opt.offload_param:  # where each partition sits in the rank's buffer
        base = opt.fp16_partitioned_groups_flat[0]
        offsets = [(p.ds_tensor.data_ptr() - base.data_ptr()) // base.element_size()
                   for sg in opt.fp16_groups for p in sg]
        assert lay["offsets"] == offsets, where
        assert [sg["offset"] for sg in lay["sub_groups"]] == [
            (f.data_ptr() - base.data_ptr()) // base.element_size()
            for f in opt.fp16_partitioned_groups_flat], where


def compare(rank, world, case):
    """One configuration: DeepSpeed alone, then with the drop-in, from the same zero.Init."""
    where = f"{RELEASE} world {world} rank {rank} {case}"
    plain, po = build(case, False)
    before = snapshot()
    dropped, do = build(case, True)
    n_buffers = len(buffers(po)) if buffers(po) else 1
    assert zd.stats["fallbacks"] == before["fallbacks"], (where, zd.stats["fallback_reasons"])
    assert zd.stats["groups"] == before["groups"] + n_buffers, (where, zd.stats)
    assert all(s["how"] not in ("release", "adopted")
               for s in zd.stats["stage3"][len(before["stage3"]):]), where
    assert zd.stats["not_adopted"] == before["not_adopted"], (where, zd.stats["not_adopted"])
    assert same(buffers(po), buffers(do)), where
    assert same(po.fp16_partitioned_groups_flat, do.fp16_partitioned_groups_flat), where
    assert same(po.fp32_partitioned_groups_flat, do.fp32_partitioned_groups_flat), where
    assert po.groups_padding == do.groups_padding, where
    assert po.fp16_partitioned_groups_flat_numel == do.fp16_partitioned_groups_flat_numel, where
    assert len(po.fp16_groups) > len(po.trainable_param_groups), where  # several sub-groups
    assert same(ds_tensors(plain), ds_tensors(dropped)), where
    # Every trained partition is a view into the drop-in's buffers (no second copy).
    spans = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size())
             for f in do.fp16_partitioned_groups_flat]
    for sub_group in do.fp16_groups:
        for p in sub_group:
            assert any(lo <= p.ds_tensor.data_ptr() < hi for lo, hi in spans), where
    check_bookkeeping(po, rank, world, where)
    assert same(gathered(plain), gathered(dropped)), where
    assert train(plain, rank) == train(dropped, rank), where
    assert same(gathered(plain), gathered(dropped)), where
    assert same(ds_tensors(plain), ds_tensors(dropped)), where
    assert same(po.fp32_partitioned_groups_flat, do.fp32_partitioned_groups_flat), where
    return dropped


def check_checkpoint(rank, world, case, dropped, ckpt_dir):
    """A checkpoint the drop-in's engine saves loads into DeepSpeed alone (other weights)."""
    where = f"{RELEASE} world {world} rank {rank} checkpoint {case}"
    dropped.save_checkpoint(ckpt_dir, tag="t")
    fresh, fo = build(case, False, seed=7)
    fresh.load_checkpoint(ckpt_dir, tag="t")
    do = dropped.optimizer
    assert same(ds_tensors(fresh), ds_tensors(dropped)), where
    assert same(fo.fp16_partitioned_groups_flat, do.fp16_partitioned_groups_flat), where
    assert same(fo.fp32_partitioned_groups_flat, do.fp32_partitioned_groups_flat), where
    assert train(fresh, rank) == train(dropped, rank), where


def back_to_back(model, config):
    """The partitions of the optimizer's parameters, in its order, moved into one buffer (with
    offload_param, one per param group) as views, as zeroflat's loader leaves them."""
    offload = "offload_param" in config["zero_optimization"]
    groups = [[p for p in g["params"] if p.requires_grad] for g in model.groups()]
    if not offload:
        groups = [[p for g in groups for p in g]]
    made = []
    for g in groups:
        flat = torch.cat([p.ds_tensor.detach().reshape(-1) for p in g])
        at = 0
        for p in g:
            p.ds_tensor.data = flat.narrow(0, at, p.ds_tensor.numel())
            at += p.ds_tensor.numel()
        made.append(flat)
    model.made = made


def check_adoption(rank, world, case, only_rank=None):
    """Partitions that are back-to-back views of one buffer: that buffer, as it is, on every
    rank; when one rank's are not (only_rank), no rank adopts and zeroflat builds them all."""
    where = f"{RELEASE} world {world} rank {rank} adoption {case} only_rank {only_rank}"
    plain, po = build(case, False)
    before = snapshot()
    adopt = only_rank is None
    prepare = back_to_back if only_rank in (None, rank) else None
    dropped, do = build(case, True, prepare=prepare)
    made = getattr(dropped.module, "made", [])
    n_buffers = len(buffers(po)) if buffers(po) else 1
    assert zd.stats["adopted"] == before["adopted"] + (n_buffers if adopt else 0), \
        (where, zd.stats)
    assert zd.stats["groups"] == before["groups"] + n_buffers, (where, zd.stats)
    assert zd.stats["fallbacks"] == before["fallbacks"], (where, zd.stats["fallback_reasons"])
    got = buffers(do) or [do.fp16_partitioned_groups_flat[0]]
    assert ([b.data_ptr() for b in got] == [m.data_ptr() for m in made]) == adopt, where
    said = zd.stats["not_adopted"][len(before["not_adopted"]):]
    assert len(said) == (n_buffers if only_rank == rank else 0), (where, said)
    assert all("another rank's partitions" in m for m in said), (where, said)
    assert same(buffers(po), buffers(do)), where
    assert same(po.fp16_partitioned_groups_flat, do.fp16_partitioned_groups_flat), where
    assert same(po.fp32_partitioned_groups_flat, do.fp32_partitioned_groups_flat), where
    assert same(ds_tensors(plain), ds_tensors(dropped)), where
    assert train(plain, rank) == train(dropped, rank), where
    assert same(gathered(plain), gathered(dropped)), where


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def check_fallback(rank, world, case):
    """A buffer zeroflat cannot build (here: nothing fits) is DeepSpeed's own, with one
    warning naming why, and everything DeepSpeed builds from it is as without the drop-in."""
    where = f"{RELEASE} world {world} rank {rank} fallback {case}"
    plain, po = build(case, False)
    real = zeroflat.flatten_param_group

    def nothing_fits(*args, **kwargs):
        raise zeroflat.NoFeasiblePlan("no way of flattening fits: test", {})

    seen = _Warnings()
    logger = logging.getLogger("zeroflat.deepspeed")
    logger.addHandler(seen)
    before = snapshot()
    zeroflat.flatten_param_group = nothing_fits
    try:
        dropped, do = build(case, True)
    finally:
        zeroflat.flatten_param_group = real
        logger.removeHandler(seen)
    n_buffers = len(buffers(po)) if buffers(po) else 1
    assert zd.stats["fallbacks"] == before["fallbacks"] + n_buffers, (where, zd.stats)
    assert zd.stats["groups"] == before["groups"], where
    mine = [m for m in seen.messages if "built by DeepSpeed itself" in m]
    assert len(mine) == n_buffers, (where, seen.messages)
    assert "no way of flattening fits" in mine[0], (where, mine)
    assert same(buffers(po), buffers(do)), where
    assert same(po.fp16_partitioned_groups_flat, do.fp16_partitioned_groups_flat), where
    assert same(po.fp32_partitioned_groups_flat, do.fp32_partitioned_groups_flat), where
    assert same(ds_tensors(plain), ds_tensors(dropped)), where


# (dtype, offload_param, offload_optimizer)
CASES = {
    1: [("bf16", False, False), ("fp16", True, True)],
    2: [("bf16", False, False), ("fp16", False, False), ("bf16", True, False),
        ("bf16", False, True), ("fp16", True, True)],
    3: [("bf16", False, False), ("fp16", False, True), ("bf16", True, True)],
}


def worker(rank, world, port, ckpt_dir):
    os.environ["LOCAL_SIZE"] = str(world)  # as DeepSpeed's launcher sets it (0.14, 0.15 ask)
    init_deepspeed_rank(rank, world, port)
    # The CPU accelerator refuses fp16 where the CPU lacks oneDNN's fp16 kernels; torch computes
    # fp16 on any CPU, and the comparison needs only the two runs to do the same.
    accel = deepspeed.accelerator.get_accelerator()
    accel.is_fp16_supported = lambda: True
    if REDUCED:  # each hook of the release once: built, adopted, handed back
        compare(rank, world, ("bf16", False, False))
        check_adoption(rank, world, ("fp16", True, True))
        check_fallback(rank, world, ("bf16", True, False))
    else:
        for case in CASES[world]:
            dropped = compare(rank, world, case)
            if world == 2 and case == ("bf16", False, True):
                check_checkpoint(rank, world, case, dropped, ckpt_dir)
        if world == 2:
            check_adoption(rank, world, ("bf16", False, False))
            check_adoption(rank, world, ("fp16", True, False))
            check_adoption(rank, world, ("bf16", False, False), only_rank=0)
            check_fallback(rank, world, ("bf16", False, False))
            check_fallback(rank, world, ("bf16", True, False))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    end_rank()


WORLDS = [2] if REDUCED else [1, 2, 3]


@pytest.mark.parametrize("world", WORLDS)
def test_stage3_drop_in_matches_deepspeed(world):
    spawn_deepspeed_workers(worker, world)


def test_install_puts_stage3_back_as_it_was():
    from deepspeed.runtime.zero import stage3

    cls = stage3.DeepSpeedZeroOptimizer_Stage3
    names = ("__init__", "defragment", "_create_param_groups_fp16_flat_cpu_memory",
             "_move_to_flat_buffer")
    before = {n: vars(cls).get(n) for n in names}
    module_defragment = vars(stage3).get("defragment")
    with zd.installed():
        assert zd.stats["stage3_refused"] is None
        assert cls.__init__ is not before["__init__"]
        if isinstance(before["defragment"], staticmethod):  # up to 0.18
            assert isinstance(vars(cls)["defragment"], staticmethod)
            assert vars(cls)["defragment"] is not before["defragment"]
        else:  # 0.19: the module's name for deepspeed.runtime.zero.utils.defragment
            assert stage3.defragment is not module_defragment
    assert {n: vars(cls).get(n) for n in names} == before
    assert vars(stage3).get("defragment") is module_defragment


def test_a_stage3_without_its_steps_is_left_to_deepspeed(monkeypatch):
    """A release whose Stage 3 has no defragment step: install() serves ZeRO-1/2, leaves Stage 3
    to DeepSpeed and says so, naming the release and why."""
    from deepspeed.runtime.zero import stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    cls = stage3.DeepSpeedZeroOptimizer_Stage3
    monkeypatch.delitem(vars(stage3), "defragment", raising=False)
    if "defragment" in vars(cls):
        monkeypatch.delattr(cls, "defragment")
    init = cls.__init__
    seen = _Warnings()
    logging.getLogger("zeroflat.deepspeed").addHandler(seen)
    try:
        with zd.installed():
            assert DeepSpeedZeroOptimizer.__init__.__zeroflat__
            assert cls.__init__ is init
            refused = zd.stats["stage3_refused"]
    finally:
        logging.getLogger("zeroflat.deepspeed").removeHandler(seen)
    assert refused and RELEASE in refused and "no defragment step" in refused
    assert any(refused in m for m in seen.messages)


def test_buffers_adopted_built_and_handed_back():
    """One rank, no DeepSpeed: partitions back to back in one storage are that storage; in one
    storage but out of order, a new buffer in the order given and one warning; separate ones, a
    new buffer and no warning; mixed dtypes, the release's own function and one warning."""
    import types
    from zeroflat import _stage3

    opt = types.SimpleNamespace(dp_process_group=None)
    storage = torch.arange(10, dtype=torch.bfloat16)
    parts = [storage[0:3], storage[3:3], storage[3:7], storage[7:10]]
    before = snapshot()
    flat = _stage3._buffer(opt, "b2b", parts, lambda: pytest.fail("handed back"))
    assert flat.data_ptr() == storage.data_ptr() and flat.numel() == 10
    assert zd.stats["adopted"] == before["adopted"] + 1
    assert parts[2].data_ptr() == storage[3:].data_ptr()
    swapped = [storage[5:10], storage[0:5]]
    flat = _stage3._buffer(opt, "swapped", swapped, lambda: pytest.fail("handed back"))
    assert flat.data_ptr() != storage.data_ptr()
    assert torch.equal(flat, torch.cat([torch.arange(5, 10), torch.arange(5)]).bfloat16())
    assert swapped[1].data_ptr() == flat.data_ptr() + 5 * 2
    said = zd.stats["not_adopted"][len(before["not_adopted"]):]
    assert len(said) == 1 and "not back to back in the optimizer's order" in said[0], said
    separate = [torch.ones(3, dtype=torch.float16), torch.zeros(2, dtype=torch.float16)]
    flat = _stage3._buffer(opt, "separate", separate, lambda: pytest.fail("handed back"))
    assert torch.equal(flat, torch.tensor([1, 1, 1, 0, 0], dtype=torch.float16))
    assert len(zd.stats["not_adopted"]) == len(before["not_adopted"]) + 1
    mixed = [torch.ones(3, dtype=torch.float16), torch.zeros(2, dtype=torch.bfloat16)]
    own = torch.empty(5)
    assert _stage3._buffer(opt, "mixed", mixed, lambda: own) is own
    assert zd.stats["fallbacks"] == before["fallbacks"] + 1
    assert "mix dtypes" in zd.stats["fallback_reasons"][-1]
    assert zd.stats["groups"] == before["groups"] + 3
    assert [s["how"] for s in zd.stats["stage3"][-4:]][::3] == ["adopted", "release"]
