"""zeroflat.flatten_param_group in one process: the DeepSpeed layout, views, training through
them, every tier, bad input refused before anything changes, failures rolled back."""

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import zeroflat  # noqa: E402
from reference import deepspeed_flat, tiny_model  # noqa: E402

TIERS = ["device", "sharded", "staged", "host"]


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("tier", ["auto"] + TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_flat_equals_deepspeed_reference_and_views_alias_it(tier, dtype):
    model = tiny_model(dtype)
    frozen_before = model.frozen.data_ptr()
    want, _ = deepspeed_flat(trainable(model), 1)
    values = [p.detach().clone() for p in trainable(model)]
    fg = zeroflat.flatten_param_group(model.parameters(), tier=tier, verify=True)
    assert fg.tier == (tier if tier != "auto" else "device")
    assert fg.flat.dtype == dtype and fg.flat.dim() == 1
    assert torch.equal(fg.flat, want)
    assert not fg.flat.requires_grad and fg.flat.grad_fn is None
    es = fg.flat.element_size()
    for p, v, off in zip(trainable(model), values, fg.layout["offsets"]):
        assert p.data_ptr() == fg.flat.data_ptr() + off * es
        assert torch.equal(p, v)
    # The frozen parameter is left alone, as DeepSpeed leaves it.
    assert model.frozen.data_ptr() == frozen_before
    assert fg.partition.data_ptr() == fg.flat.data_ptr()
    assert fg.master.dtype == torch.float32
    assert torch.equal(fg.master, fg.partition.float())
    assert fg.master.data_ptr() != fg.partition.data_ptr()
    # The views alias the buffer: a write through one shows in the other.
    p0 = trainable(model)[0]
    with torch.no_grad():
        fg.flat[fg.layout["offsets"][0]] = 3
    assert p0.view(-1)[0].item() == 3
    assert fg.report["predicted_peak_device_bytes"] == fg.report["measured_peak_device_bytes"]


def test_training_through_the_views_matches_an_unflattened_copy():
    model = tiny_model(torch.float32, seed=3)
    twin = copy.deepcopy(model)
    fg = zeroflat.flatten_param_group(model.parameters())
    assert fg.tier == "device"
    opt_a = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    opt_b = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    x = torch.randint(0, 31, (4, 6))
    for _ in range(3):
        for m, opt in ((model, opt_a), (twin, opt_b)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    # The steps wrote through the views into the flat buffer.
    want, _ = deepspeed_flat(trainable(twin), 1)
    assert torch.equal(fg.flat, want)


def test_master_dtype_none_and_alignment_options():
    model = tiny_model()
    fg = zeroflat.flatten_param_group(model.parameters(), master_dtype=None,
                                      alignment_factor=8, param_align_bytes=16,
                                      deepspeed=None)
    assert fg.master is None
    assert fg.flat.numel() % 8 == 0
    for off in fg.layout["offsets"][1:]:
        assert (off * 2) % 16 == 0


def test_param_groups_of_an_optimizer():
    model = tiny_model()
    groups = [{"params": [model.embed.weight, model.norm.weight, model.norm.bias]},
              {"params": [model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias]}]
    opt = torch.optim.SGD(groups, lr=0.1)
    refs = [deepspeed_flat(g["params"], 1)[0] for g in opt.param_groups]
    fgs = zeroflat.flatten_param_groups(opt.param_groups)
    assert len(fgs) == 2
    for fg, ref in zip(fgs, refs):
        assert torch.equal(fg.flat, ref)


def snapshot(model):
    return [(p.data_ptr(), p.detach().clone()) for p in model.parameters()]


def unchanged(model, snap):
    return all(p.data_ptr() == ptr and torch.equal(p, v)
               for p, (ptr, v) in zip(model.parameters(), snap))


def test_bad_groups_are_refused_before_anything_changes():
    model = tiny_model()
    snap = snapshot(model)
    # Mixed dtypes.
    model.fc2.weight.data = model.fc2.weight.data.float()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"mixed dtypes.*parameter 6 \(shape \[5, 17\]"):
        zeroflat.flatten_param_group(model.parameters())
    assert unchanged(model, snap)

    model = tiny_model()
    # A non-contiguous parameter.
    model.fc1.weight.data = model.fc1.weight.data.t().contiguous().t()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"parameter 4 \(shape \[17, 13\].*not contiguous"):
        zeroflat.flatten_param_group(model.parameters())
    assert unchanged(model, snap)

    # Tied weights: two parameters over the same storage.
    a = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.bfloat16))
    b = torch.nn.Parameter(a.data[1:3])
    with pytest.raises(ValueError, match=r"parameter 0 .* and parameter 1 .* share storage"):
        zeroflat.flatten_param_group([a, b])

    # Types and options.
    with pytest.raises(TypeError, match="parameter 1 is a list"):
        zeroflat.flatten_param_group([a, [1, 2]])
    with pytest.raises(TypeError, match=r"parameter 0 \(shape \[3\], torch.float64"):
        zeroflat.flatten_param_group([torch.nn.Parameter(torch.ones(3, dtype=torch.float64))])
    c = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="tier 'fast'"):
        zeroflat.flatten_param_group([c], tier="fast")
    with pytest.raises(ValueError, match="alignment"):
        zeroflat.flatten_param_group([c], alignment_factor=0)
    with pytest.raises(ValueError, match="no trainable parameters"):
        zeroflat.flatten_param_group([torch.zeros(3)])
    with pytest.raises(TypeError, match="master_dtype"):
        zeroflat.flatten_param_group([c], master_dtype=torch.int32)


def test_a_plan_that_cannot_fit_is_refused_before_anything_changes():
    model = tiny_model()
    snap = snapshot(model)
    with pytest.raises(zeroflat.NoFeasiblePlan, match="nothing was touched"):
        zeroflat.flatten_param_group(model.parameters(), margin_bytes=1 << 62)
    assert unchanged(model, snap)


@pytest.mark.parametrize("tier", TIERS)
def test_a_failure_at_any_step_keeps_every_value(tier):
    probe = zeroflat.flatten_param_group(tiny_model().parameters(), tier=tier)
    steps = len(probe.report["plan"]["steps"])
    for k in range(steps + 1):
        model = tiny_model()
        snap = snapshot(model)
        if k == steps:  # past the last step: nothing happens
            zeroflat.flatten_param_group(model.parameters(), tier=tier, _fault_step=k)
            continue
        with pytest.raises(zeroflat.ExecutionError, match=f"step {k}") as err:
            zeroflat.flatten_param_group(model.parameters(), tier=tier, _fault_step=k)
        assert err.value.outcome in ("rolled back", "recovered")
        for p, (ptr, v) in zip(model.parameters(), snap):
            assert torch.equal(p, v), f"{tier} step {k}"
        if err.value.outcome == "rolled back":
            assert unchanged(model, snap)
        else:
            fg = err.value.flat_group
            trained = [v for _, v in snap[1:]]  # [0] is the frozen parameter
            assert torch.equal(fg.flat, deepspeed_flat(trained, 1)[0])


def test_layout_helper_matches_the_cli_shape():
    lay = zeroflat.layout([5, 7, 3], 4)
    assert lay["flat_numel"] == 16 and lay["offsets"] == [0, 5, 12]
    assert [r["padding"] for r in lay["ranks"]] == [0, 0, 0, 1]


def test_the_report_holds_the_probe_document_of_zeroflat_probe():
    """The front door's probe, as `zeroflat probe --json` prints it for the same device."""
    import json
    import pathlib
    import subprocess

    fg = zeroflat.flatten_param_group(tiny_model().parameters())
    probe = fg.report["probe"]
    cli = pathlib.Path(zeroflat.__file__).resolve().parents[2] / "zeroflat"
    assert cli.exists(), f"the build's zeroflat command is not at {cli}"
    doc = json.loads(subprocess.run([str(cli), "probe", "--json"], check=True,
                                    capture_output=True, text=True).stdout)
    assert list(probe) == list(doc)
    assert probe["device"] == doc["device"] == "cpu"
    assert probe["used"] == doc["used"]
    assert [s["source"] for s in probe["sources"]] == [s["source"] for s in doc["sources"]]
    assert fg.report["plan"]["free_bytes"] <= probe["free_bytes"]
    assert "host_probe" in fg.report


@pytest.mark.parametrize("kwargs, error", [
    ({"threads": -1}, ValueError), ({"threads": 10**6}, ValueError), ({"threads": "2"}, TypeError),
    ({"margin_bytes": -5}, ValueError), ({"margin_bytes": 2**70}, ValueError),
    ({"alignment_factor": 0}, ValueError), ({"param_align_bytes": -16}, ValueError),
    ({"master_dtype": "float32"}, TypeError), ({"round_robin": "no"}, TypeError),
    ({"verify": "yes"}, TypeError), ({"tier": 3}, ValueError),
])
def test_bad_arguments_are_refused_where_they_enter(kwargs, error):
    """Not pybind's "incompatible function arguments", not an AttributeError, not a string
    taken as True: a clear error naming the argument, and nothing changed."""
    model = tiny_model()
    snap = snapshot(model)
    name = next(iter(kwargs))
    with pytest.raises(error, match=name):
        zeroflat.flatten_param_group(model.parameters(), **kwargs)
    assert unchanged(model, snap)


def test_host_buffers_are_fresh_huge_page_mappings_freed_with_the_tensor():
    """On the CPU the flat buffer and the master are zeroflat's own host memory (2 MiB-aligned,
    advised for huge pages, faulted in by the threads that fill them), handed to torch without
    a copy and given back when torch frees the tensors."""
    big = [torch.randn(1024, 1024).to(torch.bfloat16) for _ in range(3)]  # 6 MiB
    values = [p.clone() for p in big]
    fg = zeroflat.flatten_param_group(big, trainable_only=False, deepspeed=None)
    assert fg.flat.data_ptr() % (2 << 20) == 0
    assert fg.master.data_ptr() % (2 << 20) == 0
    assert torch.equal(fg.master, fg.partition.float())
    assert all(torch.equal(p, v) for p, v in zip(big, values))
    assert fg.report["master_seconds"] > 0
    ptr = fg.flat.data_ptr()
    del fg, big
    import gc
    gc.collect()
    with open("/proc/self/maps") as maps:  # the mapping is gone with the tensors
        assert not any(line.startswith(f"{ptr:x}-") for line in maps)


def test_the_engine_host_copies_refuse_what_they_cannot_read():
    """upcast and clone read a tensor's bytes from its data pointer: a strided tensor, or an
    up-cast of anything but bf16 or fp16, is a ValueError, never a read past the end."""
    engine = zeroflat._C.TorchDevice("cpu", 1)
    half = torch.randn(64, 32).to(torch.float16)
    assert torch.equal(engine.upcast(half).view(torch.float32).view(64, 32), half.float())
    assert torch.equal(engine.clone(half).view(torch.float16).view(64, 32), half)
    for bad in (torch.ones(16, dtype=torch.uint8), torch.ones(4, dtype=torch.float32)):
        with pytest.raises(ValueError, match="bfloat16 or float16"):
            engine.upcast(bad)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        engine.upcast(half.t())
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        engine.clone(half.t())


def test_the_engine_checks_what_it_is_lent_and_where_its_memory_comes_from():
    """TorchDevice.adopt takes a contiguous tensor of its device or None (the resume's reads in
    place are checked in test_resume.py: bytes_in_place, and the put-back after a failure);
    host_memory is one of torch, plain, huge."""
    for where in ("torch", "plain", "huge", None):
        e = zeroflat._C.TorchDevice("cpu", 1, where)
        e.adopt(torch.arange(6, dtype=torch.float32))
        e.adopt(None)
    with pytest.raises(ValueError, match="contiguous"):
        e.adopt(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="host_memory 'pinned'"):
        zeroflat._C.TorchDevice("cpu", 1, "pinned")
