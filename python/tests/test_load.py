"""The loader from Python without Transformers: dtype conversion of checkpoint tensors exactly as
torch's Tensor.to rounds (every 16-bit value, every midpoint, random fp32 bit patterns, NaN and
infinities), and load_param_groups on a plain module built on the meta device (groups, frozen
parameters, buffers, tied weights, bad names), checked against the state dict it was written
from.

Past 700 lines on purpose: the conversions and the loads share the checkpoint writers and the
reference state dicts built here."""

import json
import os
import pathlib
import struct

import pytest
import torch

import zeroflat
from reference import end_rank, start_ranks

_ST = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
       torch.float64: "F64", torch.int32: "I32", torch.uint8: "U8"}


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


def test_meta_parameters_skip_random_fills_of_meta_tensors_only():
    """Initializing a meta parameter changes nothing, so meta_parameters() skips its random
    fills (torch's decompositions of them cost a millisecond each); a real tensor's fill runs."""
    originals = (torch.Tensor.normal_, torch.Tensor.uniform_)
    calls = []
    with zeroflat.meta_parameters():
        lin = torch.nn.Linear(4, 4)  # its reset_parameters() fills the meta weight and bias
        torch.nn.init.normal_(lin.weight)
        real = torch.zeros(64)
        torch.nn.init.normal_(real, mean=5.0)
        calls.append(torch.zeros(64).uniform_(1.0, 2.0))
        skipping = torch.Tensor.normal_ is not originals[0]
    assert skipping and lin.weight.is_meta and lin.bias.is_meta
    assert bool((real != 0).all()) and bool((calls[0] >= 1.0).all())
    assert (torch.Tensor.normal_, torch.Tensor.uniform_) == originals


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
    # A buffer stored in another dtype than the model's is converted as load_state_dict's copy
    # converts it, never its bytes taken as the model's dtype; one the library cannot read is
    # refused naming it.
    for stored in (torch.float64, torch.int32, torch.uint8):
        other = save(tmp_path / f"steps_{stored}.safetensors",
                     dict(state, steps=ref.steps.to(stored)))
        with zeroflat.meta_parameters():
            model = Net()
        zeroflat.load_param_groups(model, other, device="cpu", deepspeed=None)
        assert model.steps.dtype == torch.int64 and torch.equal(model.steps, ref.steps), stored
    # Both ways: a float buffer stored as integers (or float64) is converted too, as the copy
    # converts it (it was refused while int64 buffers took floats).
    class Scaled(Net):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.zeros(4, dtype=torch.float32))

    scale = torch.tensor([1.0, -2.0, 3.0, 2.0**30 + 1], dtype=torch.float64)
    for stored in (torch.int64, torch.int32, torch.float64):
        other = save(tmp_path / f"scale_{stored}.safetensors",
                     dict(state, scale=scale.to(stored)))
        with zeroflat.meta_parameters():
            model = Scaled()
        zeroflat.load_param_groups(model, other, device="cpu", deepspeed=None)
        want = scale.to(stored).to(torch.float32)
        assert model.scale.dtype == torch.float32 and torch.equal(model.scale, want), stored
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


def test_a_path_whose_name_is_not_utf8_loads(tmp_path):
    """Linux names are bytes: a folder named with a byte that is not UTF-8 loads whether the path
    comes as the str os.fsdecode makes of it, as bytes or as a pathlib.Path, and DCP's reader
    reads its index (the binding once refused such a str with a TypeError)."""
    import zeroflat.dcp

    folder = os.fsdecode(os.fsencode(str(tmp_path)) + b"/ck\xff")
    try:
        os.mkdir(folder)
    except OSError as e:  # a file system that keeps names in UTF-8 (ZFS utf8only)
        pytest.skip(f"this file system refuses a name that is not UTF-8: {e}")
    torch.manual_seed(0)
    ref = Net()
    state = {k: v for k, v in ref.state_dict().items() if k != "out.weight"}
    save(os.path.join(folder, "model.safetensors"), state)
    for path in (folder, os.fsencode(folder), pathlib.Path(folder)):
        with zeroflat.meta_parameters():
            model = Net()
        zeroflat.load_param_groups(model, path, dtype=torch.float32, device="cpu",
                                   deepspeed=None)
        assert torch.equal(model.body.weight, ref.body.weight), path
    meta = zeroflat.dcp.Reader(folder).read_metadata()
    assert "body.weight" in meta.state_dict_metadata
    # Errors quoting the name reach the library as its bytes (a rank's own error, and what the
    # ranks compare), and come back as raised.
    options = zeroflat._C.FlattenOptions()
    options.local_error, options.must_match = f"no tensor in {folder}", [folder]
    assert options.local_error == f"no tensor in {folder}" and options.must_match == [folder]
    save(os.path.join(folder, "model.safetensors"), {k: v for k, v in state.items()
                                                      if k != "body.weight"})
    with zeroflat.meta_parameters():
        model = Net()
    with pytest.raises(ValueError, match="body.weight"):
        zeroflat.load_param_groups(model, folder, dtype=torch.float32, device="cpu",
                                   deepspeed=None)


def test_renamed_and_fused_tensors_are_found_under_the_checkpoints_names(tmp_path):
    """A module the checkpoint stores under an older name (undone through the renaming rules,
    escaped dots and anchors included) and experts stored one by one that the model stacks:
    each parameter gets the checkpoint's tensors, stacked in order; a regular expression that
    cannot be undone is left alone, and a missing tensor is still an error naming it."""
    from zeroflat import _hf_names

    rules = [WeightRenaming([r"^legacy\.model"], "model"),
             WeightRenaming([".block_sparse_moe."], ".mlp."),
             WeightRenaming([r"gamma(\d)"], "scale"),
             WeightConverter([".experts.*.w1.weight", ".experts.*.w3.weight"],
                             ".experts.gate_up_proj", [MergeModulelist(0), Concatenate(1)])]
    assert _hf_names.checkpoint_names("model.layers.0.mlp.gate.weight", rules) == [
        "model.layers.0.mlp.gate.weight", "legacy.model.layers.0.mlp.gate.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
        "legacy.model.layers.0.block_sparse_moe.gate.weight"]
    assert _hf_names.checkpoint_names("x.model.scale", rules) == ["x.model.scale"]  # ^: not here

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

    real = _hf_names.converters
    _hf_names.converters = lambda model: rules
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
        _hf_names.converters = real


def test_a_stacked_expert_stored_transposed_is_refused_naming_it(tmp_path):
    """Experts stored one by one and stacked into one parameter are checked tensor by tensor
    against the shape Transformers' rule takes them as: one stored transposed has the right
    size but would load as other values, so it is refused, naming it."""
    from zeroflat import _hf_names

    rules = [WeightConverter([".experts.*.w1.weight"], ".experts.w1", [MergeModulelist(0)]),
             WeightConverter([".experts.*.up.weight", ".experts.*.gate.weight"],
                             ".experts.gate_up", [MergeModulelist(0), Concatenate(1)])]
    g = torch.Generator().manual_seed(4)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.empty(2, 3, 4))
            self.gate_up = torch.nn.Parameter(torch.empty(2, 6, 4))

    class Top(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts()

    good = {f"experts.{e}.{k}.weight": torch.randn(3, 4, generator=g)
            for e in range(2) for k in ("w1", "up", "gate")}
    real = _hf_names.converters
    _hf_names.converters = lambda model: rules
    try:
        save(tmp_path / "model.safetensors", good)
        with zeroflat.meta_parameters():
            top = Top()
        zeroflat.load_param_groups(top, str(tmp_path), deepspeed=None, device="cpu")
        assert torch.equal(top.experts.w1, torch.stack([good[f"experts.{e}.w1.weight"]
                                                        for e in range(2)]))
        for bad_name, bad in (("experts.1.w1.weight", good["experts.1.w1.weight"].t()),
                              ("experts.0.gate.weight", good["experts.0.gate.weight"].t()),
                              ("experts.1.up.weight", good["experts.1.up.weight"].reshape(12))):
            stored = dict(good)
            stored[bad_name] = bad.contiguous()
            save(tmp_path / "model.safetensors", stored)
            with zeroflat.meta_parameters():
                top = Top()
            with pytest.raises(ValueError, match=bad_name.replace(".", r"\.") + ".*transposed"):
                zeroflat.load_param_groups(top, str(tmp_path), deepspeed=None, device="cpu")
            assert all(p.device.type == "meta" for p in top.parameters())
    finally:
        _hf_names.converters = real


def test_release_rules_come_from_the_library(monkeypatch):
    """Every rule of a DeepSpeed release is the library's (ReleaseRules), among them the memory
    check of 0.18.7 on; without DeepSpeed installed, "installed" means the newest tested
    release's rules, so a zero-element parameter stays out of the group as 0.19.8 leaves it."""
    from zeroflat import _C, _common

    assert not zeroflat.release_rules("0.18.6").checks_accelerator_memory
    assert zeroflat.release_rules("0.18.7").checks_accelerator_memory
    assert zeroflat.release_rules("0.19.8+cu121").checks_accelerator_memory
    kept, left_out = _C.select_for_release([3, 0, 4, 5], [False, False, True, False],
                                           zeroflat.release_rules("0.19.8"))
    assert list(kept) == [0, 3] and list(left_out) == [(1, "zero elements"), (2, "frozen")]
    kept, _ = _C.select_for_release([3, 0], [], zeroflat.release_rules("0.18.6"))
    assert list(kept) == [0, 1]
    with pytest.raises(zeroflat.InvalidArgument, match="alignment factor 4.*deepspeed=None"):
        zeroflat.layout([4, 4], 2, alignment_factor=4, deepspeed="latest")

    monkeypatch.setattr(_common, "installed_deepspeed", lambda: None)
    assert zeroflat.release_rules("installed").rules == zeroflat.TESTED_DEEPSPEED_RELEASES[-1]
    params = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in (3, 0, 5)]
    fg = zeroflat.flatten_param_group(params)
    assert [p is q for p, q in zip(fg.params, (params[0], params[2]))] == [True, True]
    assert fg.report["deepspeed"]["rules"] == zeroflat.TESTED_DEEPSPEED_RELEASES[-1]
    assert fg.flat.numel() == 8


def test_a_long_load_reports_bytes_rate_and_time_left(tmp_path, monkeypatch, caplog):
    """Progress: the callback's reports only grow and end with every byte the rank read, and the
    log's lines are the library's own words (the command line's)."""
    import logging

    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(1024, 4096, bias=False)
            self.b = torch.nn.Linear(4096, 1024)

    torch.manual_seed(0)
    ref = Big()
    path = save(tmp_path / "big.safetensors", ref.state_dict())
    monkeypatch.setenv("ZEROFLAT_PROGRESS_SECONDS", "0.0005")
    got = []
    with zeroflat.meta_parameters():
        model = Big()
    with caplog.at_level(logging.INFO, logger="zeroflat"):
        fgs = zeroflat.load_param_groups(model, path, device="cpu", deepspeed=None,
                                         dtype=torch.float32, threads=1, progress=got.append)
    assert torch.equal(model.a.weight, ref.a.weight)
    read = sum(fg.report["bytes_read"] for fg in fgs)
    assert read == sum(t.numel() * 4 for t in ref.state_dict().values())
    last = got[-1]
    assert isinstance(last, zeroflat.Progress) and last.finished and last.rank == 0
    assert last.done == last.total == read and last.seconds_left == 0
    # An interval too long for the waits' timeouts is the longest one: the load ends, and its
    # last report comes.
    monkeypatch.setenv("ZEROFLAT_PROGRESS_SECONDS", "1e300")
    import threading

    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    got.clear()
    with zeroflat.meta_parameters():
        model = Big()
    zeroflat.load_param_groups(model, path, device="cpu", deepspeed=None, dtype=torch.float32,
                               threads=1, progress=got.append)
    assert got and got[-1].finished and got[-1].done == read
    assert not died, [d.exc_value for d in died]
    assert last.what == f"load {path}" and "(100%)" in last.line and "done in" in last.line
    assert [p.done for p in got] == sorted(p.done for p in got)
    assert all(not p.finished for p in got[:-1])
    for p in got[:-1]:
        assert p.line == zeroflat._C.describe_progress(p.done, p.total, p.seconds)
    lines = [r.getMessage() for r in caplog.records if r.name == "zeroflat"]
    assert all(x.startswith(f"zeroflat: rank 0: load {path}: read ") for x in lines), lines
    # The words, for any counts.
    assert zeroflat._C.describe_progress(0, 0, 0) == "read 0 B"
    assert zeroflat._C.describe_progress(2_000_000, 8_000_000, 2.0) == \
        "read 2.00 MB of 8.00 MB (25%), 1.00 MB/s, about 6 s left"
    assert zeroflat._C.describe_progress(3 << 30, 0, 0.5).endswith("GB/s")
    assert "about 2 h 00 min left" in zeroflat._C.describe_progress(10**6, 7_201_000_000, 1.0)
    # A read that has all but stalled: no overflowing estimate.
    assert zeroflat._C.describe_progress(1, 2**64 - 1, 1e9).endswith(", over 100 h left")
    # A bad callback is refused before anything is read; one that raises is dropped, logged.
    with zeroflat.meta_parameters():
        model = Big()
    with pytest.raises(TypeError, match="progress"):
        zeroflat.load_param_groups(model, path, device="cpu", deepspeed=None, progress=3)

    def bad(p):
        raise RuntimeError("no display")

    with caplog.at_level(logging.INFO, logger="zeroflat"):
        zeroflat.load_param_groups(model, path, device="cpu", deepspeed=None, progress=bad)
    assert any("progress callback raised" in r.getMessage() for r in caplog.records)
    assert torch.equal(model.b.bias, ref.b.bias)


def test_library_errors_arrive_as_zeroflat_exception_classes(tmp_path):
    """C++ errors are zeroflat's classes, each also the built-in a caller would catch: an
    invalid argument is a ValueError, every one is a zeroflat.Error and a RuntimeError; the
    binding's options are the library's structs, made from keyword arguments."""
    from zeroflat import _C

    with pytest.raises(zeroflat.InvalidArgument, match="nowhere") as e:
        _C.Checkpoint(str(tmp_path / "nowhere"))
    assert isinstance(e.value, ValueError) and isinstance(e.value, zeroflat.Error)
    assert isinstance(e.value, RuntimeError)
    assert issubclass(zeroflat.OutOfMemory, MemoryError)
    assert issubclass(zeroflat.Unsupported, NotImplementedError)
    assert issubclass(zeroflat.NoFeasiblePlan, MemoryError)
    for kind in (zeroflat.CommError, zeroflat.ResourceExhausted, zeroflat.InternalError,
                 zeroflat.ExecutionError, zeroflat.NoFeasiblePlan, zeroflat.OutOfMemory):
        assert issubclass(kind, zeroflat.Error) and issubclass(kind, RuntimeError)
    options = _C.FlattenOptions(layout=_C.LayoutOptions(dp=2, dtype="fp16"), tier="sharded")
    assert options.layout.dp == 2 and options.layout.dtype == "fp16" and options.tier == "sharded"
    with pytest.raises(AttributeError):
        _C.FlattenOptions(colde=True)
    with pytest.raises(zeroflat.InvalidArgument, match="tier"):
        _C.FlattenOptions(tier="fast")
    # A file's bytes that are not text in what the library says keep the message whole.
    bad = tmp_path / "model.safetensors"
    header = b'{"\xff": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}'
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(zeroflat.InvalidArgument) as e:
        _C.Checkpoint(str(bad))
    assert str(bad) in str(e.value) and "not valid JSON" in str(e.value), repr(e.value)


def test_a_load_that_fits_nowhere_is_refused_in_its_words_with_nothing_read(tmp_path):
    """A plan that does not fit (a margin larger than any host's memory) is NoFeasiblePlan in
    the load's own words, with the planner's reason and its report, before anything is read:
    the model keeps its meta parameters."""
    torch.manual_seed(0)
    ref = Net()
    state = {k: v for k, v in ref.state_dict().items() if k != "out.weight"}
    save(str(tmp_path / "model.safetensors"), state)
    with zeroflat.meta_parameters():
        model = Net()
    with pytest.raises(zeroflat.NoFeasiblePlan) as e:
        zeroflat.load_param_groups(model, str(tmp_path), dtype=torch.float32, device="cpu",
                                   deepspeed=None, margin_bytes=1 << 60)
    words = str(e.value)
    assert words.startswith("buffer 0 does not fit on cpu: ") and "nothing was read" in words
    assert "{reason}" not in words and e.value.report["outcome"] == "infeasible"
    assert e.value.report["dp"] == 1  # the load's own notes, in the report it raises with
    assert model.body.weight.is_meta


def test_no_module_of_the_package_imports_back_from_it():
    """The package's modules import each other's private modules, never the package itself
    (which imports them): no import cycle, no names reached for inside functions."""
    import ast
    import pathlib

    root = pathlib.Path(zeroflat.__file__).parent
    public = set(zeroflat.__all__)
    for path in root.glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module is None:
                    names = {a.name for a in node.names}
                    assert not names & public, (path.name, names & public)
                if node.level == 0 and node.module == "zeroflat":
                    raise AssertionError(f"{path.name} imports from the package: "
                                         f"{[a.name for a in node.names]}")


# --- several ranks ---------------------------------------------------------------------------

def _rank_main(rank, world, port, fn, args):
    import datetime

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world, dist.group.WORLD, *args)
    finally:
        dist.destroy_process_group()
    end_rank()


def run_ranks(fn, world=2, *args):
    start_ranks(_rank_main, world, fn, args)


class Frozen(Net):
    """Net with a frozen parameter of `size` elements."""

    def __init__(self, size=5):
        super().__init__()
        self.extra = torch.nn.Parameter(torch.empty(size), requires_grad=False)


def _state(size=5):
    torch.manual_seed(0)
    ref = Frozen(size)
    return ref, {k: v for k, v in ref.state_dict().items() if k != "out.weight"}


def check_own_errors_reach_every_rank(rank, world, group, root):
    """Whatever one rank finds wrong before the ranks meet is raised on every rank at their
    first collective, promptly (the process group's timeout is 120 s): its path missing, one of
    its shards missing, an option only it passes, a frozen parameter of another shape."""
    import time

    def load(model_size=5, path=root / "full", **kwargs):
        with zeroflat.meta_parameters():
            model = Frozen(model_size)
        return zeroflat.load_param_groups(model, path, group, device="cpu", deepspeed=None,
                                          **kwargs)

    t0 = time.monotonic()
    other = "rank 1 refused"
    with pytest.raises(ValueError, match="no such file" if rank == 1 else other):
        load(path=root / ("full" if rank == 0 else "nowhere"))
    with pytest.raises(ValueError, match="shard|model-00002" if rank == 1 else other):
        load(path=root / ("sharded" if rank == 0 else "sharded_less"))
    with pytest.raises(ValueError, match="threads 0" if rank == 1 else other):
        load(threads=1 if rank == 0 else 0)
    with pytest.raises(TypeError if rank == 1 else ValueError,
                       match="round_robin" if rank == 1 else other):
        load(round_robin="no" if rank == 1 else False)
    # A frozen parameter whose shape only this rank's model has: its own error, on both.
    with pytest.raises(ValueError, match="'extra'.*shape" if rank == 1 else other):
        load(model_size=5 if rank == 0 else 6)
    # Both models fit their checkpoints, but the frozen parameters differ: compared.
    with pytest.raises(ValueError, match="different options"):
        load(model_size=5 if rank == 0 else 6, path=root / ("full" if rank == 0 else "full6"))
    # Everything frozen: no group has a buffer, and the ranks still meet once.
    with pytest.raises(ValueError, match="no such file" if rank == 1 else other):
        load(path=root / ("full" if rank == 0 else "nowhere"), param_groups=[])
    assert time.monotonic() - t0 < 60
    fgs = load()
    assert len(fgs) == 1 and fgs[0].dp == 2


def test_an_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    ref, state = _state()
    save(tmp_path / "full", state)
    (tmp_path / "full").rename(tmp_path / "full.safetensors")
    os.symlink(tmp_path / "full.safetensors", tmp_path / "full")
    save(tmp_path / "full6", _state(6)[1])
    for d in ("sharded", "sharded_less"):
        (tmp_path / d).mkdir()
        names = sorted(state)
        half = len(names) // 2
        weight_map = {}
        for k, part in enumerate((names[:half], names[half:])):
            file = f"model-0000{k + 1}-of-00002.safetensors"
            if d == "sharded" or k == 0:
                save(tmp_path / d / file, {n: state[n] for n in part})
            weight_map.update({n: file for n in part})
        (tmp_path / d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    run_ranks(check_own_errors_reach_every_rank, 2, tmp_path)


def check_read_plans(rank, world, group, path):
    """Both read plans give every rank the same buffer; on one host the cost model picks
    load-whole (every rank reads everything, no all-gather), and a bad plan is every rank's
    error."""
    buffers = {}
    for plan in (None, "load", "load-whole"):
        with zeroflat.meta_parameters():
            model = Net()
        fgs = zeroflat.load_param_groups(model, path, group, device="cpu", deepspeed=None,
                                         read_plan=plan, copies="full")
        want = "load-whole" if plan is None else plan
        assert [fg.tier for fg in fgs] == [want], (plan, [fg.tier for fg in fgs])
        buffers[plan] = [fg.flat.clone() for fg in fgs]
    assert all(torch.equal(a, b) for a, b in zip(buffers["load"], buffers["load-whole"]))
    assert all(torch.equal(a, b) for a, b in zip(buffers[None], buffers["load"]))
    with zeroflat.meta_parameters():
        model = Net()
    bad = "sideways" if rank == 1 else None
    with pytest.raises(ValueError, match="sideways" if rank == 1 else "rank 1"):
        zeroflat.load_param_groups(model, path, group, device="cpu", deepspeed=None,
                                   read_plan=bad)


def test_read_plans_fill_the_same_buffers(tmp_path):
    _, state = _state()
    state = {k: v for k, v in state.items() if k != "extra"}
    run_ranks(check_read_plans, 2, save(tmp_path / "net.safetensors", state))


class Wide(torch.nn.Module):
    """32 MiB of fp32: at 2 ranks a 16 MiB slice, which a rank reads in two parts, gathering
    the first while it reads the second."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2048, 2048, bias=False)
        self.b = torch.nn.Linear(2048, 2048)


def check_parts_gathered_while_reading(rank, world, group, path):
    """The `load` plan's read of a slice, in parts gathered as they arrive through the
    package's all-gather, gives the buffer every rank reading everything gives."""
    buffers = {}
    for plan in ("load", "load-whole"):
        with zeroflat.meta_parameters():
            model = Wide()
        fgs = zeroflat.load_param_groups(model, path, group, device="cpu", deepspeed=None,
                                         read_plan=plan)
        assert [fg.tier for fg in fgs] == [plan]
        report = fgs[0].report
        if plan == "load":
            assert report["gather_parts"] == 2, report["gather_parts"]
            assert 0 < report["allgather_overlapped_seconds"] <= report["allgather_seconds"]
            # The read's report covers the whole slice, not its last part.
            assert report["bytes_read"] == fgs[0].flat.numel() * 4 // world, report["bytes_read"]
        else:
            assert report["gather_parts"] == 1
        buffers[plan] = fgs[0].flat.clone()
    assert torch.equal(buffers["load"], buffers["load-whole"])


def test_a_slice_read_in_parts_is_gathered_as_they_arrive(tmp_path):
    torch.manual_seed(0)
    state = Wide().state_dict()
    run_ranks(check_parts_gathered_while_reading, 2, save(tmp_path / "wide.safetensors", state))


def check_parts_that_differ_are_refused(rank, world, group, path):
    """Ranks that pass the package's all-gather different parts of their slices: the package's
    communicator refuses them on every rank with an InvalidArgument, as the library's own
    communicators do, and the load fails as a step that failed everywhere (rolled back), not as
    a broken process group."""
    from zeroflat import _comm

    real = _comm.TorchComm.all_gather_part

    def skewed(self, ptr, slice_bytes, offset, nbytes):
        return real(self, ptr, slice_bytes, offset, max(0, nbytes - 64 * rank))

    _comm.TorchComm.all_gather_part = skewed
    with zeroflat.meta_parameters():
        model = Wide()
    with pytest.raises(zeroflat.Error, match="different parts") as e:
        zeroflat.load_param_groups(model, path, group, device="cpu", deepspeed=None,
                                   read_plan="load")
    # A step that failed on every rank alike, rolled back: not a broken process group.
    text = str(e.value)
    assert not isinstance(e.value, zeroflat.CommError), repr(e.value)
    assert "rolled back" in text and "could not agree" not in text, text


def test_parts_that_differ_between_ranks_are_an_invalid_argument(tmp_path):
    torch.manual_seed(0)
    state = Wide().state_dict()
    run_ranks(check_parts_that_differ_are_refused, 2, save(tmp_path / "wide.safetensors", state))


def check_a_gone_peer_is_named(rank, world, group, path):
    """A rank that dies in the middle of a load (at its first collective, the ranks'
    agreement): the others raise zeroflat.CommError saying which collective failed, for what,
    and which rank is presumably gone, the process group's own error chained."""
    from zeroflat import _comm

    if rank == 1:
        def die(self, *args):
            os._exit(0)
        _comm.TorchComm.all_reduce = die
    with zeroflat.meta_parameters():
        model = Net()
    with pytest.raises(zeroflat.CommError) as e:
        zeroflat.load_param_groups(model, path, group, device="cpu", deepspeed=None)
    text = str(e.value)
    assert "loading buffer 0" in text and "agreement" in text, text
    assert "failed on rank 0" in text and "rank 1 of the group is presumably gone" in text, text
    assert isinstance(e.value.__cause__, RuntimeError), repr(e.value.__cause__)
    assert not isinstance(e.value.__cause__, zeroflat.Error)


def test_a_rank_that_dies_is_named_by_the_others(tmp_path):
    _, state = _state()
    state = {k: v for k, v in state.items() if k != "extra"}
    run_ranks(check_a_gone_peer_is_named, 2, save(tmp_path / "net.safetensors", state))


def check_a_late_peer_is_named_with_its_progress(rank, world, group, path):
    """A rank still working when the others' wait for it runs out (the process group's timeout,
    3 s here): the others' CommError names it with the last progress it reported through the
    store (each rank leaves one when its load starts and every 10 s after)."""
    import datetime
    import time

    import torch.distributed as dist

    from zeroflat import _comm

    # Both ranks start from the world's barrier (its timeout is the default): the 3 s group's
    # own set-up and the timing below measure from the same moment on a loaded machine too.
    dist.barrier()
    short = dist.new_group(ranks=[0, 1], timeout=datetime.timedelta(seconds=3), backend="gloo")
    if rank == 1:
        agree = _comm.TorchComm.all_reduce

        def late(self, *args):
            time.sleep(15)  # well past the others' timeout and their 3 s look for marks
            return agree(self, *args)
        _comm.TorchComm.all_reduce = late
    with zeroflat.meta_parameters():
        model = Net()
    with pytest.raises(zeroflat.CommError) as e:
        zeroflat.load_param_groups(model, path, short, device="cpu", deepspeed=None)
    if rank == 0:
        text = str(e.value)
        assert "rank 1 of the group is presumably gone" in text, text
        assert "rank 1 last reported" in text and "net.safetensors: read 0 B" in text, text


def test_a_late_rank_is_named_with_its_progress(tmp_path):
    _, state = _state()
    state = {k: v for k, v in state.items() if k != "extra"}
    run_ranks(check_a_late_peer_is_named_with_its_progress, 2,
              save(tmp_path / "net.safetensors", state))


def _documented_fields(function):
    """The fields include/zeroflat/report.h lists for one of its result documents, and those of
    them it says are there "only when"."""
    import pathlib
    import re

    header = pathlib.Path(__file__).resolve().parents[2] / "include" / "zeroflat" / "report.h"
    lines = header.read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if f" {function}(" in line)
    start = end
    while lines[start - 1].startswith("//"):
        start -= 1
    fields, optional, only, continued = set(), set(), False, False
    for line in lines[start:end]:
        body = line[len("//   "):] if line.startswith("//   ") else ""
        names, _, text = body.partition("  ")
        found = [n.strip() for n in names.split(",") if re.fullmatch(r"[a-z_]+", n.strip())]
        if not found:
            continue
        if not continued:  # a new entry, not the second line of names of the one above
            only = text.strip().startswith("only")
        fields.update(found)
        if only:
            optional.update(found)
        continued = names.rstrip().endswith(",")
    return fields, optional


def test_reports_are_the_librarys_documents(tmp_path):
    """The reports of a flatten and a load are the library's documents of one rank's result
    (report.h: result_json), the same keys for the same facts whichever the source, with only
    what the binding knows added."""
    _, state = _state()
    state = {k: v for k, v in state.items() if k != "extra"}
    path = save(tmp_path / "net.safetensors", state)
    with zeroflat.meta_parameters():
        model = Net()
    (fg,) = zeroflat.load_param_groups(model, path, device="cpu", deepspeed=None)
    fields, optional = _documented_fields("result_json")
    assert {"predicted_host_bytes", "master_bytes"} <= fields - optional
    assert {"bytes_read", "read_gbps", "page_cache", "error"} <= optional
    assert fields - optional <= set(fg.report)
    assert set(fg.report) - fields == {"dp", "deepspeed"}
    (chosen,) = [c for c in fg.report["plan"]["candidates"] if c["tier"] == fg.report["tier"]]
    assert fg.report["predicted_host_bytes"] == chosen["host_bytes"]
    assert fg.report["reason"] == fg.report["plan"]["reason"]
    assert fg.report["tier"] == "load" and fg.report["plan"]["steps"]
    assert fg.report["bytes_read"] == sum(t.numel() * 4 for t in state.values()
                                          if t.dtype == torch.float32)
    fg = zeroflat.flatten_param_group(Net().parameters(), deepspeed=None)
    assert not {"bytes_read", "read_gbps"} & set(fg.report)  # only from files
    assert {"feasible", "partition_bytes", "master_bytes"} <= fields - optional
    assert {"error", "master_error"} <= optional
    assert fields - optional <= set(fg.report)
    assert set(fg.report) - fields == {"dp", "deepspeed", "release_deferred"}
    assert fg.report["plan"]["steps"] and fg.report["tier"] == "device"
