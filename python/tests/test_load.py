"""The loader from Python without Transformers: dtype conversion of checkpoint tensors exactly as
torch's Tensor.to rounds (every 16-bit value, every midpoint, random fp32 bit patterns, NaN and
infinities), and load_param_groups on a plain module built on the meta device (groups, frozen
parameters, buffers, tied weights, bad names), checked against the state dict it was written
from."""

import json
import os
import struct

import pytest
import torch

import zeroflat

_ST = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}


def save(path, tensors):
    """A .safetensors file of these tensors (written here, so that the test needs no package)."""
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    return path


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def same_as_torch(got, want):
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan)
    assert torch.equal(bits(got)[~nan], bits(want)[~nan])


def test_conversions_round_exactly_as_torch(tmp_path):
    g = torch.Generator().manual_seed(3)
    all16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    sources = {}
    for t16 in (torch.bfloat16, torch.float16):
        values = all16.view(t16).float()
        finite = values[torch.isfinite(values)].unique()
        mids = (finite[1:].double() + finite[:-1].double()) / 2
        around = torch.cat([mids.float(), torch.nextafter(mids.float(), torch.tensor(0.0)),
                            torch.nextafter(mids.float(), torch.tensor(float("inf")))])
        sources[f"mids_{t16}"] = around
        sources[f"all_{t16}"] = all16.view(t16).clone()
    randbits = torch.randint(-2**31, 2**31 - 1, (300_000,), generator=g, dtype=torch.int64)
    sources["random"] = randbits.to(torch.int32).view(torch.float32)
    sources["special"] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                                       65504.0, 65519.99, 65520.0, -65520.0, 1e-8, -6e-8, 3.4e38,
                                       1.0 + 2**-8, 1.0 + 3 * 2**-8], dtype=torch.float32)
    path = save(tmp_path / "values.safetensors", sources)
    ck = zeroflat._C.Checkpoint(str(path))
    for name, src in sources.items():
        for to in (torch.bfloat16, torch.float16, torch.float32):
            out = torch.empty(src.shape, dtype=to)
            ck.read(name, out)
            same_as_torch(out, src.to(to))


def test_a_tensor_of_another_dtype_reads_as_stored_and_sizes_are_checked(tmp_path):
    ids = torch.arange(10, dtype=torch.int64)
    path = save(tmp_path / "ids.safetensors", {"ids": ids, "w": torch.ones(4)})
    ck = zeroflat._C.Checkpoint(str(path))
    out = torch.empty(10, dtype=torch.int64)
    ck.read("ids", out.view(torch.uint8))
    assert torch.equal(out, ids)
    with pytest.raises(ValueError, match="needs"):
        ck.read("w", torch.empty(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no tensor named"):
        ck.read("nope", torch.empty(1))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Linear(16, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.head = torch.nn.Linear(24, 50, bias=False)
        self.out = torch.nn.Linear(16, 50, bias=False)
        self.out.weight = self.embed.weight  # tied
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def test_load_param_groups_on_a_meta_module(tmp_path):
    torch.manual_seed(0)
    ref = Net()
    ref.steps += torch.tensor([1, 2, 3])
    state = {k: v for k, v in ref.state_dict().items() if k != "out.weight"}  # tied: saved once
    path = save(tmp_path / "net.safetensors", state)
    with zeroflat.meta_parameters():
        model = Net()
    assert all(p.device.type == "meta" for p in model.parameters())
    model.norm.bias.requires_grad_(False)
    groups = [["embed.weight", "body.weight", "body.bias"], ["norm.weight", "norm.bias",
                                                              "head.weight"]]
    fgs = zeroflat.load_param_groups(model, path, param_groups=groups, dtype=torch.bfloat16,
                                     device="cpu", deepspeed=None)
    assert len(fgs) == 2
    for name, p in model.named_parameters(remove_duplicate=False):
        want = dict(ref.named_parameters(remove_duplicate=False))[name]
        assert p.dtype == torch.bfloat16 and torch.equal(p, want.to(torch.bfloat16)), name
    assert model.out.weight is model.embed.weight
    assert torch.equal(model.steps, ref.steps)
    assert torch.equal(model.scratch, torch.ones(2))  # not in the checkpoint, kept
    assert [len(fg.params) for fg in fgs] == [3, 2]  # the frozen bias is not in a buffer
    for fg in fgs:
        assert fg.tier == "load" and fg.master.dtype == torch.float32
        for p, off in zip(fg.params, fg.layout["offsets"]):
            assert p.data_ptr() == fg.flat.data_ptr() + off * 2
    # A name the checkpoint lacks, before anything is read.
    del state["body.bias"]
    bad = save(tmp_path / "bad.safetensors", state)
    with zeroflat.meta_parameters():
        model = Net()
    with pytest.raises(ValueError, match="body.bias"):
        zeroflat.load_param_groups(model, bad, device="cpu")
    assert all(p.device.type == "meta" for p in model.parameters())


class WeightRenaming:
    """The shape of Transformers' renaming rule: checkpoint patterns -> the model's pattern."""

    def __init__(self, sources, target):
        self.source_patterns, self.target_patterns, self.operations = sources, [target], []


class MergeModulelist:
    def __init__(self, dim):
        self.dim = dim


class Concatenate(MergeModulelist):
    pass


class WeightConverter:
    def __init__(self, sources, target, operations):
        self.source_patterns, self.target_patterns = sources, [target]
        self.operations = operations


def test_renamed_and_fused_tensors_are_found_under_the_checkpoints_names(tmp_path):
    """A module the checkpoint stores under an older name (undone through the renaming rules,
    escaped dots and anchors included) and experts stored one by one that the model stacks:
    each parameter gets the checkpoint's tensors, stacked in order; a regular expression that
    cannot be undone is left alone, and a missing tensor is still an error naming it."""
    from zeroflat import _load

    rules = [WeightRenaming([r"^legacy\.model"], "model"),
             WeightRenaming([".block_sparse_moe."], ".mlp."),
             WeightRenaming([r"gamma(\d)"], "scale"),
             WeightConverter([".experts.*.w1.weight", ".experts.*.w3.weight"],
                             ".experts.gate_up_proj", [MergeModulelist(0), Concatenate(1)])]
    assert _load._checkpoint_names("model.layers.0.mlp.gate.weight", rules) == [
        "model.layers.0.mlp.gate.weight", "legacy.model.layers.0.mlp.gate.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
        "legacy.model.layers.0.block_sparse_moe.gate.weight"]
    assert _load._checkpoint_names("x.model.scale", rules) == ["x.model.scale"]  # ^: not here

    g = torch.Generator().manual_seed(3)
    w1 = [torch.randn(3, 4, generator=g) for _ in range(2)]
    w3 = [torch.randn(3, 4, generator=g) for _ in range(2)]
    gate = torch.randn(2, 4, generator=g)
    stored = {"legacy.model.block_sparse_moe.gate.weight": gate}
    for e in range(2):
        stored[f"legacy.model.block_sparse_moe.experts.{e}.w1.weight"] = w1[e]
        stored[f"legacy.model.block_sparse_moe.experts.{e}.w3.weight"] = w3[e]
    save(tmp_path / "model.safetensors", stored)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.empty(2, 6, 4))

    class Moe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(4, 2, bias=False)
            self.experts = Experts()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = Moe()

    class Top(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Model()

    real = _load._converters
    _load._converters = lambda model: rules
    try:
        with zeroflat.meta_parameters():
            top = Top()
        zeroflat.load_param_groups(top, str(tmp_path), deepspeed=None, device="cpu",
                                   master_dtype=None)
        assert torch.equal(top.model.mlp.gate.weight, gate)
        want = torch.stack([torch.cat([w1[e], w3[e]]) for e in range(2)])
        assert torch.equal(top.model.mlp.experts.gate_up_proj, want)

        del stored["legacy.model.block_sparse_moe.experts.1.w3.weight"]
        save(tmp_path / "model.safetensors", stored)
        with zeroflat.meta_parameters():
            top = Top()
        with pytest.raises(ValueError, match="model.mlp.experts.gate_up_proj"):
            zeroflat.load_param_groups(top, str(tmp_path), deepspeed=None, device="cpu")
    finally:
        _load._converters = real
