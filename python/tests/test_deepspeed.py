"""The DeepSpeed drop-in against the real DeepSpeed (CPU accelerator, gloo), for whichever
release this interpreter imports (ctest runs it once per supported release, each from its own
folder): 1 to 3 ranks, ZeRO-1 and ZeRO-2, with and without round_robin_gradients, three param
groups holding a frozen and a zero-element parameter, optimizer offload, bf16 ZeRO-1 with fp32
gradient accumulation (BF16_Optimizer), parameters that are column slices or share storage,
MoE expert groups: the same buffers, partitions, padding, first offsets, fp32 masters and
parameters as DeepSpeed's own after init and after three training steps, every group built by
zeroflat, and a checkpoint saved with the drop-in loads into plain DeepSpeed. Random groups
(zero-element and frozen parameters among them) check `zeroflat.layout(deepspeed=release)`
against the release's own bookkeeping."""

import os
import random
import sys

import pytest
import torch

import deepspeed  # noqa: E402  (the release under test)

sys.path.insert(0, os.path.dirname(__file__))
import zeroflat  # noqa: E402
import zeroflat.deepspeed as zd  # noqa: E402
from zeroflat import _save  # noqa: E402
from reference import (end_rank, init_deepspeed_rank,  # noqa: E402
                       spawn_deepspeed_workers, train_steps as train)

RELEASE = deepspeed.__version__.split("+")[0]
# ctest names the release each run is for: it must be the one imported.
assert os.environ.get("ZEROFLAT_DEEPSPEED_RELEASE", RELEASE) == RELEASE, (
    f"expected DeepSpeed {os.environ.get('ZEROFLAT_DEEPSPEED_RELEASE')}, imported {RELEASE} "
    f"from {deepspeed.__file__}: run scripts/setup.sh, which installs every tested release")
RULES = zeroflat._C.deepspeed_rules(RELEASE)
V = tuple(int(x) for x in RELEASE.split(".")[:3])


class Model(torch.nn.Module):
    """Odd sizes (padding and partition edges fall inside parameters), a frozen parameter and a
    zero-element one inside optimizer groups, a layer norm. Every group is large enough that
    each of 3 ranks holds a parameter of it (0.17.6 cannot step otherwise)."""

    def __init__(self, seed=0, width=24, odd=False):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(37, width)
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 29)
        self.fc2 = torch.nn.Linear(29, 11)
        self.frozen = torch.nn.Parameter(torch.randn(7), requires_grad=False)
        self.empty = torch.nn.Parameter(torch.zeros(0))
        self.odd = odd
        if odd:
            # A column slice (not contiguous) and two Parameters over the same bytes: DeepSpeed
            # copies and unties them, and so must the drop-in.
            self.wide = torch.nn.Parameter(torch.randn(11, 40))
            self.slice = torch.nn.Parameter(torch.randn(11, 40)[:, 5:16])
            self.twin = torch.nn.Parameter(self.fc2.weight.data)

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(self.norm(self.embed(x)))))
        out = h.sum(-1) + self.frozen.sum() + self.empty.sum()
        if self.odd:
            out = out + (h @ self.slice).sum(-1) * 1e-3 + self.twin.sum() * 1e-3
        return out

    def groups(self):
        # Releases before 0.19.8 keep a zero-element parameter in its group, and their own
        # link_hp_params then asserts on it (a zero-length fragment inside a partition): such a
        # group cannot be trained by DeepSpeed itself. The layout check below covers them.
        middle = ([self.fc1.weight, self.empty, self.fc1.bias] if RULES.skips_zero_element
                  else [self.fc1.weight, self.fc1.bias])
        g = [{"params": [self.embed.weight, self.frozen, self.norm.weight, self.norm.bias]},
             {"params": middle, "lr": 2e-3},
             {"params": [self.fc2.weight, self.fc2.bias], "weight_decay": 0.0}]
        if self.odd:
            g[2]["params"] += [self.wide, self.slice, self.twin]
        return g


def build(stage, round_robin, drop_in, seed=0, offload=False, bf16_zero1=False, odd=False):
    model = Model(seed, odd=odd).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.groups(), lr=1e-3, foreach=False)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "round_robin_gradients": round_robin},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": True},
    }
    if bf16_zero1:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    return initialize(model, optimizer, config, drop_in)


def initialize(model, optimizer, config, drop_in):
    """deepspeed.initialize, with the drop-in or DeepSpeed alone."""
    accel = deepspeed.accelerator.get_accelerator()
    if not drop_in and RELEASE == "0.18.9":
        # 0.18.9's own accelerator path leaves autograd history on the buffer, and its step()
        # then fails with more than one rank on gloo; its host path builds the same bytes.
        accel.available_memory = lambda *a, **k: 0
    if drop_in:
        zd.install()
    try:
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    finally:
        if drop_in:
            zd.uninstall()
        vars(accel).pop("available_memory", None)
    return engine, opt


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def params(engine):
    return [p.detach() for p in engine.module.parameters()]


def expect_zeroflat_built(before, where, groups):
    assert zd.stats["fallbacks"] == before["fallbacks"], (where, zd.stats["fallback_reasons"])
    assert zd.stats["groups"] == before["groups"] + groups, (where, zd.stats)


def compare(rank, stage, round_robin, offload=False, odd=False):
    where = f"{RELEASE} rank {rank} stage {stage} rr {round_robin} offload {offload} odd {odd}"
    plain, po = build(stage, round_robin, False, offload=offload, odd=odd)
    before = dict(zd.stats)
    dropped, do = build(stage, round_robin, True, offload=offload, odd=odd)
    expect_zeroflat_built(before, where, len(po.bit16_groups_flat))
    # Each fp32 master partition up-cast from the bf16 partition, whose clone was never made
    # (worker: every size goes through the engine here).
    masters = sum(1 for m in do.single_partition_of_fp32_groups if m.numel())
    assert zd.stats["clones_skipped"] == before["clones_skipped"] + masters, (where, masters)
    assert same(po.bit16_groups_flat, do.bit16_groups_flat), where
    for a, b in zip(po.parallel_partitioned_bit16_groups, do.parallel_partitioned_bit16_groups):
        assert same(a, b), where
    assert po.groups_padding == do.groups_padding, where
    assert same(po.single_partition_of_fp32_groups, do.single_partition_of_fp32_groups), where
    assert [len(x) for x in po.params_in_partition] == [len(x) for x in do.params_in_partition]
    assert po.first_offset == do.first_offset, where
    assert same(params(plain), params(dropped)), where
    # Every trained parameter is a view into the drop-in's buffers (no second copy).
    flats = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size())
             for f in do.bit16_groups_flat]
    for group in do.bit16_groups:
        for p in group:
            if p.numel():
                assert any(lo <= p.data_ptr() < hi for lo, hi in flats), where
    assert train(plain, rank) == train(dropped, rank), where
    assert same(params(plain), params(dropped)), where
    assert same(po.single_partition_of_fp32_groups, do.single_partition_of_fp32_groups), where
    return dropped


def compare_bf16_zero1(rank):
    """bf16 ZeRO-1 with fp32 gradient accumulation: BF16_Optimizer, which flattens too (or, in
    releases that misroute it, no ZeRO buffer at all, and the drop-in says so)."""
    where = f"{RELEASE} rank {rank} BF16_Optimizer"
    plain, po = build(1, False, False, bf16_zero1=True)
    before = dict(zd.stats)
    dropped, do = build(1, False, True, bf16_zero1=True)
    if hasattr(po, "bf16_groups_flat"):
        expect_zeroflat_built(before, where, len(po.bf16_groups_flat))
        masters = sum(1 for m in do.fp32_groups_flat_partition if m.numel())
        assert zd.stats["clones_skipped"] == before["clones_skipped"] + masters, (where, masters)
        assert type(do).__name__ == "BF16_Optimizer", where
        assert same(po.bf16_groups_flat, do.bf16_groups_flat), where
        assert same(po.fp32_groups_flat_partition, do.fp32_groups_flat_partition), where
        assert po.group_paddings == do.group_paddings, where
    else:
        assert type(po).__name__ == "FP16_UnfusedOptimizer", where
        assert zd.stats["not_flattened"], where  # the drop-in says there was nothing to build
    assert same(params(plain), params(dropped)), where
    assert train(plain, rank) == train(dropped, rank), where
    assert same(params(plain), params(dropped)), where


def check_checkpoint(last, ckpt_dir):
    dropped, stage, round_robin = last
    # Releases before 0.16 load their own checkpoints with torch.load's old default
    # (weights_only=False), which torch 2.6 changed: the file is this test's own.
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    dropped.save_checkpoint(ckpt_dir, tag="t")
    fresh, _ = build(stage, round_robin, False, seed=7)  # other weights, DeepSpeed alone
    fresh.load_checkpoint(ckpt_dir, tag="t")
    assert same(params(fresh), params(dropped))
    assert same(fresh.optimizer.single_partition_of_fp32_groups,
                dropped.optimizer.single_partition_of_fp32_groups)


def check_layouts_against_bookkeeping(rank, world, monkeypatch_link):
    """zeroflat.layout(deepspeed=RELEASE) for random groups with zero-element and frozen
    parameters, with and without round-robin and parameter alignment, against the offsets,
    params in and not in each partition, first offset, padding and flat size the release keeps
    for the same group. (These optimizers are never trained: the link between their bf16 and
    fp32 fragments, which releases before 0.19.8 cannot make for zero-element parameters, comes
    after all of the bookkeeping and is skipped.)"""
    monkeypatch_link()
    rng = random.Random(1234)
    aligns = (False, True) if RULES.has_parameter_alignment else (False,)
    for case in range(3):
        sizes = [rng.choice([0, 1, 3, 7, 16, 33, 250, 1001]) for _ in range(rng.randint(4, 12))]
        frozen = [rng.random() < 0.2 for _ in sizes]
        frozen[0] = False
        sizes[0] = max(sizes[0], 1)
        for rr in (False, True):
            for align in aligns:
                where = f"{RELEASE} case {case} sizes {sizes} frozen {frozen} rr {rr} align {align}"
                module = torch.nn.Module()
                module.ps = torch.nn.ParameterList(
                    [torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16), requires_grad=not f)
                     for n, f in zip(sizes, frozen)])
                module.forward = lambda x, m=module: sum(p.sum() for p in m.ps) * x.sum()
                opt = torch.optim.AdamW([{"params": list(module.ps)}], lr=1e-3)
                config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                          "zero_allow_untested_optimizer": True,
                          "zero_optimization": {"stage": 2, "round_robin_gradients": rr}}
                if align:
                    config["zero_optimization"]["parameter_alignment"] = True
                _, ds = initialize(module, opt, config, False)
                lay = zeroflat.layout(sizes, world, round_robin=rr, dtype=torch.bfloat16,
                                      param_align_bytes=16 if align else 0, deepspeed=RELEASE,
                                      frozen=frozen)
                group = ds.bit16_groups[0]
                index = {id(p): k for k, p in enumerate(module.ps)}
                kept = [index[id(p)] for p in group]
                assert sorted(kept) == [k for k in range(len(sizes)) if lay["offsets"][k]
                                        is not None], where
                flat = ds.bit16_groups_flat[0]
                assert lay["flat_numel"] == flat.numel(), where
                for p in group:
                    k = index[id(p)]
                    if p.numel():
                        assert p.data_ptr() == flat.data_ptr() + lay["offsets"][k] * 2, where
                mine = lay["ranks"][rank]
                assert [index[id(p)] for p in ds.params_in_partition[0]] == \
                    mine["params_in_partition"], where
                assert [index[id(p)] for p in ds.params_not_in_partition[0]] == \
                    mine["params_not_in_partition"], where
                assert int(ds.first_offset[0]) == mine["first_offset"], where
                assert ds.groups_padding[0] == mine["padding"], where


def check_moe(rank, world):
    """DeepSpeed MoE: expert parameters in their own groups, over an expert data-parallel group
    smaller than the world (2 ranks, 2 experts, expert parallelism 2: expert-dp of 1)."""
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    def make(drop_in):
        torch.manual_seed(3)
        model = torch.nn.Sequential()
        model.embed = torch.nn.Embedding(37, 16)
        model.moe = MoE(hidden_size=16, expert=torch.nn.Linear(16, 16), num_experts=2,
                        ep_size=world, k=1, min_capacity=8)
        model.head = torch.nn.Linear(16, 5)
        model = model.to(torch.bfloat16)

        def forward(x, m=model):
            h, _, _ = m.moe(m.embed(x))
            return m.head(h).sum(-1)

        model.forward = forward
        groups = split_params_into_different_moe_groups_for_optimizer(
            [{"params": list(model.parameters()), "name": "all"}])
        opt = torch.optim.AdamW(groups, lr=1e-3)
        config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                  "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": 2}}
        return initialize(model, opt, config, drop_in)

    plain, po = make(False)
    before = dict(zd.stats)
    dropped, do = make(True)
    where = f"{RELEASE} rank {rank} moe"
    expect_zeroflat_built(before, where, len(po.bit16_groups_flat))
    assert any(do.is_moe_param_group), where
    assert same(po.bit16_groups_flat, do.bit16_groups_flat), where
    assert same(po.single_partition_of_fp32_groups, do.single_partition_of_fp32_groups), where
    assert train(plain, rank) == train(dropped, rank), where
    assert same(params(plain), params(dropped)), where


def check_adoption(rank, world, tmpdir):
    """A model loaded by zeroflat.load_param_groups (its parameters views into the loader's
    buffers, laid out by this release's rules): with the drop-in, deepspeed.initialize adopts
    every group's buffer as it is, and everything equals DeepSpeed's own from the same values."""
    path = os.path.join(tmpdir, "model.safetensors")
    if rank == 0:
        from safetensors.torch import save_file

        m = Model(0).to(torch.bfloat16)
        save_file({k: v.contiguous() for k, v in m.state_dict().items()}, path)
    torch.distributed.barrier()
    group = torch.distributed.group.WORLD if world > 1 else None
    for stage, rr in ((1, False), (2, True)):
        where = f"{RELEASE} rank {rank} adoption stage {stage} rr {rr}"
        plain, po = build(stage, rr, False)
        with zeroflat.meta_parameters():
            model = Model(0)
        model = model.to(torch.bfloat16)
        fgs = zeroflat.load_param_groups(model, path, group, param_groups=model.groups(),
                                         round_robin=rr, deepspeed=RELEASE, master_dtype=None,
                                         device="cpu")
        optimizer = torch.optim.AdamW(model.groups(), lr=1e-3, foreach=False)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage, "round_robin_gradients": rr},
                  "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}}
        before = dict(zd.stats)
        dropped, do = initialize(model, optimizer, config, True)
        assert zd.stats["adopted"] == before["adopted"] + len(po.bit16_groups_flat), \
            (where, zd.stats)
        assert [f.data_ptr() for f in do.bit16_groups_flat] == [fg.flat.data_ptr() for fg in fgs]
        assert same(po.bit16_groups_flat, do.bit16_groups_flat), where
        assert same(po.single_partition_of_fp32_groups, do.single_partition_of_fp32_groups), where
        assert train(plain, rank) == train(dropped, rank), where
        assert same(params(plain), params(dropped)), where


def worker(rank, world, port, ckpt_dir):
    init_deepspeed_rank(rank, world, port)
    # The optimizers' host copies (clones, up-casts, zeros) through zeroflat's engine at every
    # size, not only from 8 MiB: every master and state below is compared with DeepSpeed's own.
    zd._FastHostCopies.kMinBytes = 1
    # Every case at 2 ranks; at 1 and 3 the ones whose partitions differ most.
    cases = {1: [(2, False, False, False), (1, True, False, True)],
             2: [(1, False, False, False), (1, True, False, False), (2, False, False, False),
                 (2, True, False, False), (2, False, True, False), (1, True, False, True)],
             3: [(1, True, False, False), (2, False, False, True), (2, True, True, False)]}
    last = None
    for stage, round_robin, offload, odd in cases[world]:
        dropped = compare(rank, stage, round_robin, offload=offload, odd=odd)
        if not odd and not offload:
            last = (dropped, stage, round_robin)
    if world < 3:
        compare_bf16_zero1(rank)
    if world == 2:
        check_moe(rank, world)
    if world < 3:
        check_adoption(rank, world, ckpt_dir)
    check_checkpoint(last, ckpt_dir)
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def skip_link():
        def unlinked(self):
            for group in self.bit16_groups:
                for p in group:
                    p._hp_mapping = None

        DeepSpeedZeroOptimizer._link_all_hp_params = unlinked

    # Last: it leaves the optimizer class without its hp link.
    check_layouts_against_bookkeeping(rank, world, skip_link)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    end_rank()


# The environment's own release at 1, 2 and 3 ranks; every other release (run once more per
# release from its own folder, ZEROFLAT_DEEPSPEED_RELEASE set) at 2, where every case runs,
# odd sizes and their padding included.
WORLDS = [1, 2, 3] if "ZEROFLAT_DEEPSPEED_RELEASE" not in os.environ else [2]


@pytest.mark.parametrize("world", WORLDS)
def test_drop_in_matches_deepspeed(world):
    spawn_deepspeed_workers(worker, world)


def test_the_tested_releases_are_listed_once():
    listed = [line.strip() for line in open(os.path.join(os.path.dirname(__file__), "..",
                                                         "deepspeed-releases.txt"))
              if line.strip() and not line.startswith("#")]
    assert tuple(listed) == zeroflat.TESTED_DEEPSPEED_RELEASES == zd.SUPPORTED_VERSIONS


def test_other_releases_warn_and_older_ones_are_refused(monkeypatch, caplog):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Opt

    init, flatten = Opt.__init__, Opt.flatten_dense_tensors_aligned
    monkeypatch.setattr(deepspeed, "__version__", "0.13.1")
    with pytest.raises(RuntimeError, match="older than the releases zeroflat knows"):
        zd.install()
    assert Opt.__init__ is init and Opt.flatten_dense_tensors_aligned is flatten
    assert not zd.is_installed()
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with caplog.at_level("WARNING", logger="zeroflat.deepspeed"):
        with zd.installed():
            assert zd.is_installed() and Opt.__init__ is not init
    assert "not one of the releases" in caplog.text
    assert Opt.__init__ is init and Opt.flatten_dense_tensors_aligned is flatten
    monkeypatch.undo()
    zd.install()
    zd.install()  # twice is harmless
    # Inside installed(), its own save options; after it, the ones of the install before.
    zd.install(save_priority="low", save_staging_bytes=1 << 20)
    with zd.installed(save_in_background=False):
        assert _save.options() == (False, "idle", None)
    assert _save.options() == (True, "low", 1 << 20)
    zd.uninstall()
    zd.uninstall()
    assert Opt.__init__ is init and Opt.flatten_dense_tensors_aligned is flatten


def test_host_copies_and_zeros_run_on_the_engine_while_an_optimizer_is_built(monkeypatch):
    """While an optimizer is built, a large bf16 -> fp32 up-cast and a clone run on the engine
    (a fresh 2 MiB-aligned buffer, the same values), with one thread per rank or more; large
    zeros are a fresh mapping, zeros to the last byte; anything else is torch's. A clone
    up-cast in the same expression, as DeepSpeed makes its fp32 masters, is not made; one
    converted to its own dtype is."""
    big = torch.randn(4 << 20).to(torch.bfloat16)  # 8 MiB: the smallest the engine takes
    for threads in (2, 1):
        monkeypatch.setattr(zeroflat._C, "default_threads", lambda local, t=threads: t)
        float_before, zeros_before = torch.Tensor.float, torch.zeros
        skipped = zd.stats["clones_skipped"]
        with zd._FastHostCopies().on():
            assert torch.Tensor.float is not float_before and torch.zeros is not zeros_before
            up = big.float()
            copy = big.clone()
            master = big.clone().float()  # as BF16_Optimizer and 0.14-0.17's ZeRO-1/2
            master_to = big.detach().clone().to(  # as 0.18's ZeRO-1/2
                device="cpu", dtype=torch.float32)
            kept = big.clone().to(dtype=torch.bfloat16)  # .to returns the clone itself
            zeros = torch.zeros(3 << 20, dtype=torch.float32, device="cpu")
            square = torch.zeros((2048, 2048), dtype=torch.bfloat16)
            small = torch.zeros(1000)
            grad = torch.zeros(4 << 20, requires_grad=True)
            meta = torch.zeros(4 << 20, device="meta")
        assert torch.Tensor.float is float_before and torch.zeros is zeros_before
        assert torch.equal(up, big.to(torch.float32)) and torch.equal(copy, big)
        assert zd.stats["clones_skipped"] == skipped + 2
        assert torch.equal(master, big.float()) and torch.equal(master_to, big.float())
        assert torch.equal(kept, big) and kept.data_ptr() not in (big.data_ptr(), copy.data_ptr())
        kept[0] += 1  # its own memory
        assert not torch.equal(kept, big)
        for t in (up, copy, zeros, square):
            assert t.data_ptr() % (2 << 20) == 0  # the engine's
        assert zeros.shape == (3 << 20,) and zeros.dtype == torch.float32
        assert square.shape == (2048, 2048) and square.dtype == torch.bfloat16
        assert not zeros.any() and not square.any()
        zeros[-1] = 1.0  # its own memory, writable
        assert zeros.sum().item() == 1.0
        assert small.shape == (1000,) and not small.any()
        assert grad.requires_grad and meta.device.type == "meta"
