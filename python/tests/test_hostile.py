"""Checkpoints that try to make zeroflat run code. Each payload below would run `touch MARKER` if
anything executed it (torch.load with weights_only=False does); every entry point must either
give the plain value back or refuse the file naming what it names, and the marker must never
appear:

- the low-level reader (`_C.TorchFile(path).value()`),
- `zeroflat inspect` (a file and a checkpoint folder),
- `zeroflat load DIR --from deepspeed`,
- `engine.load_checkpoint` under `zeroflat.deepspeed.install()` (ZeRO-2 and ZeRO-3), where the
  engine must also be left as it was when the load is refused.

The payloads cover every way a pickle can name code: GLOBAL, STACK_GLOBAL, INST, OBJ, NEWOBJ,
NEWOBJ_EX, REDUCE of a global off the list, a name of the list asked for from another module,
a listed global used as a value, an extension code, a text persistent id, getattr on something
other than an allowed enum, and dicts carrying the keys an earlier binding read as instructions
(`__zeroflat_enum__`, `__zeroflat_global__`, `__zeroflat_object__`), which are only data. They
are placed at the top of a state, inside lists, tuples and dict keys, in an optimizer state, in
the client state and in `ds_config`."""

import json
import pathlib
import struct
import subprocess
import zipfile

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent
PLACEHOLDER = "zeroflat-hostile-payload-0x7f3a"


def _text(s):
    """A pickle fragment pushing the str `s` (BINUNICODE)."""
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def payloads(marker):
    """name -> (pickle fragment that pushes one value, text the refusal names). Each fragment,
    unpickled by Python, would create `marker`."""
    cmd = _text(f"touch {marker}")
    code = _text(f"open({str(marker)!r}, 'w').close()")
    return {
        "GLOBAL+REDUCE": (b"cos\nsystem\n" + cmd + b"\x85R", "os system"),
        "STACK_GLOBAL+REDUCE": (_text("os") + _text("system") + b"\x93" + cmd + b"\x85R",
                                "os system"),
        "INST": (b"(" + cmd + b"ios\nsystem\n", "INST"),
        "OBJ": (b"(cos\nsystem\n" + cmd + b"o", "os system"),
        "NEWOBJ": (b"cos\nsystem\n" + cmd + b"\x85\x81", "os system"),
        "NEWOBJ_EX": (b"cos\nsystem\n" + cmd + b"\x85}\x92", "os system"),
        "builtins exec": (b"cbuiltins\nexec\n" + code + b"\x85R", "builtins exec"),
        "__builtin__ eval": (b"c__builtin__\neval\n" + code + b"\x85R", "__builtin__ eval"),
        "listed name, other module": (b"cos\nLossScaler\n)R", "os LossScaler"),
        "listed module, other name": (b"cdeepspeed.runtime.fp16.loss_scaler\nsystem\n" + cmd +
                                      b"\x85R", "deepspeed.runtime.fp16.loss_scaler system"),
        "torch.load": (b"ctorch\nload\n" + _text(str(marker)) + b"\x85R", "torch load"),
        "listed global as a value": (b"cbuiltins\ngetattr\n", "builtins getattr"),
        "listed class as a value": (b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n",
                                    "LossScaler"),
        "getattr off an enum": (b"cbuiltins\ngetattr\nctorch\nTensor\n" + _text("__init__") +
                                b"\x86R", "getattr"),
        "getattr, no such member": (b"cbuiltins\ngetattr\n"
                                    b"cdeepspeed.runtime.zero.config\nZeroStageEnum\n" +
                                    _text("__class__") + b"\x86R", "__class__"),
        "EXT1": (b"\x82\x01", "EXT1"),
        "PERSID": (b"Pfoo\n", "PERSID"),
        "a tensor subclass": (b"ctorch._tensor\n_rebuild_from_type_v2\n(ctorch._utils\n"
                              b"_rebuild_tensor_v2\nctorch.nn\nParameter\n)}tR",
                              "torch.nn Parameter"),
    }


def tag_dicts(marker):
    """Dicts whose keys an earlier binding took as instructions: data, restored as they are."""
    return {
        "__zeroflat_enum__": {"__zeroflat_enum__": "os.system.x", "value": f"touch {marker}"},
        "__zeroflat_global__": {"__zeroflat_global__": "os.system"},
        "__zeroflat_object__": {"__zeroflat_object__": "os.system", "args": [f"touch {marker}"],
                                "state": {}},
    }


def rewrite(path, fragment):
    """Replaces the first pickled PLACEHOLDER string in `path`'s data.pkl with `fragment` (which
    pushes one value, so that the memo and the stack stay as torch.save left them)."""
    with zipfile.ZipFile(path) as z:
        entries = [(i.filename, z.read(i)) for i in z.infolist()]
    out = []
    for name, data in entries:
        if name.endswith("/data.pkl"):
            needle = _text(PLACEHOLDER)
            assert data.count(needle) >= 1, "the placeholder was not pickled as BINUNICODE"
            data = data.replace(needle, fragment, 1)
        out.append((name, data))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in out:
            z.writestr(name, data)


def placed(where):
    """The placeholder at one of the places a payload may hide: name -> a function of a state."""
    def at(state):
        if where == "top":
            state["payload"] = PLACEHOLDER
        elif where == "list":
            state["payload"] = [1, [2, PLACEHOLDER]]
        elif where == "tuple":
            state["payload"] = (1, (PLACEHOLDER, 3))
        elif where == "dict key":
            state["payload"] = {PLACEHOLDER: 1}
        elif where == "client state":
            state["notes"] = {"epoch": [3, {"x": PLACEHOLDER}]}
        elif where == "ds_config":
            state.setdefault("ds_config", {})["payload"] = PLACEHOLDER
        elif where == "optimizer state":
            state["optimizer_state_dict"]["payload"] = {"exp_avg": [PLACEHOLDER]}
        else:
            raise AssertionError(where)
        return state
    return at


def hostile_file(src, dst, where, fragment):
    state = torch.load(src, weights_only=False)  # a file this test saved: trusted
    torch.save(placed(where)(state), dst)
    rewrite(dst, fragment)


def cli(*args):
    from test_torch_file import cli_path

    return subprocess.run([str(cli_path()), *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def error_document(r, command, expect):
    """A failure under --json is one JSON document on stdout, with the same keys every time."""
    doc = json.loads(r.stdout)
    assert set(doc) == {"command", "exit", "error_kind", "error"}, doc
    assert doc["command"] == command and doc["exit"] == r.returncode, doc
    assert doc["error_kind"] == "invalid input" and expect in doc["error"], doc


@pytest.fixture()
def marker(tmp_path):
    m = tmp_path / "MARKER"
    yield m
    assert not m.exists(), "a payload ran"


# ---- the low-level reader and inspect, on single files ---------------------------------------

@pytest.mark.parametrize("where", ["top", "list", "tuple", "dict key"])
def test_every_payload_is_refused_by_the_reader_and_inspect(tmp_path, marker, where):
    from zeroflat import _C, InvalidArgument

    base = tmp_path / "base.pt"
    torch.save({"w": torch.arange(4.0)}, base)
    for name, (fragment, named) in payloads(marker).items():
        path = tmp_path / f"{name.replace(' ', '_')}.pt"
        hostile_file(base, path, where, fragment)
        # What Python's own unpickler would do with it: the payload really is one.
        with pytest.raises(InvalidArgument) as e:
            _C.TorchFile(str(path)).value()
        assert named in str(e.value) and path.name in str(e.value), (name, str(e.value))
        r = cli("inspect", path, "--json")
        assert r.returncode == 2, (name, r.stdout[-500:], r.stderr[-500:])
        assert named in r.stderr, (name, r.stderr)
        assert not marker.exists(), name


def test_the_payloads_are_real(tmp_path):
    """Python's own unpickler runs them (so the tests above test something): the GLOBAL one,
    through torch.load with weights_only=False, creates the marker."""
    marker = tmp_path / "MARKER"
    base = tmp_path / "base.pt"
    torch.save({"w": torch.arange(4.0)}, base)
    path = tmp_path / "real.pt"
    hostile_file(base, path, "list", payloads(marker)["GLOBAL+REDUCE"][0])
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_tag_dicts_are_plain_dicts(tmp_path, marker):
    from zeroflat import _C

    path = tmp_path / "tags.pt"
    tags = tag_dicts(marker)
    state = {"w": torch.arange(4.0), "tags": tags, "nested": [tags, (tags,)]}
    torch.save(state, path)
    value = _C.TorchFile(str(path)).value()
    assert value["tags"] == tags and value["nested"] == [tags, (tags,)]
    assert type(value["tags"]["__zeroflat_global__"]) is dict
    r = cli("inspect", path, "--json")
    assert r.returncode == 0, r.stderr


def test_allowed_values_are_made_from_the_one_list(tmp_path, marker):
    """The values that name code are made by the binding as the reader's allow-list row says:
    a dtype as itself, an enum member, a device, an instance by __new__ (its __init__ not run)."""
    import deepspeed  # noqa: F401 - the classes the list names
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from zeroflat import _C

    rows = {(m, n): (make, does, reason) for m, n, make, does, reason, _ in _C.allowed_globals()}
    assert rows[("torch", "float16")][0] == "global"
    assert rows[("deepspeed.runtime.zero.config", "ZeroStageEnum")][0] == "member"
    assert rows[("deepspeed.runtime.fp16.loss_scaler", "LossScaler")][0] == "instance"
    assert rows[("torch._utils", "_rebuild_tensor_v2")][0] == "never"
    assert all(reason for _, _, reason in rows.values())

    scaler = DynamicLossScaler(init_scale=2.0 ** 4, scale_window=7, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    state = {"dtype": torch.bfloat16, "stage": ZeroStageEnum.gradients,
             "frag": fragment_address(numel=5, start=3), "scaler": scaler,
             "device": torch.device("cpu")}
    path = tmp_path / "allowed.pt"
    torch.save(state, path)
    value = _C.TorchFile(str(path)).value()
    assert value["dtype"] is torch.bfloat16
    assert value["stage"] is ZeroStageEnum.gradients
    assert value["frag"] == fragment_address(5, 3) and type(value["frag"]) is fragment_address
    assert type(value["scaler"]) is DynamicLossScaler
    assert vars(value["scaler"]) == vars(scaler)
    assert value["device"] == torch.device("cpu")


# ---- DeepSpeed checkpoints through inspect, load --from deepspeed and load_checkpoint ----------

ENGINE_CASES = [
    # (payload, where): every payload once, every place at least once.
    ("GLOBAL+REDUCE", "client state"),
    ("STACK_GLOBAL+REDUCE", "ds_config"),
    ("INST", "top"),
    ("OBJ", "optimizer state"),
    ("NEWOBJ", "list"),
    ("NEWOBJ_EX", "dict key"),
    ("builtins exec", "optimizer state"),
    ("__builtin__ eval", "client state"),
    ("listed name, other module", "tuple"),
    ("listed module, other name", "client state"),
    ("torch.load", "optimizer state"),
    ("listed global as a value", "client state"),
    ("listed class as a value", "optimizer state"),
    ("getattr off an enum", "ds_config"),
    ("getattr, no such member", "client state"),
    ("EXT1", "top"),
    ("PERSID", "optimizer state"),
    ("a tensor subclass", "client state"),
]


def _hostile_checkpoints(ckpt, marker):
    """Copies of a 1-rank checkpoint, one per ENGINE_CASES row and one with the tag dicts in its
    client state: variants for test_resume.resume."""
    from test_resume import TAG, _copy

    ckpt = pathlib.Path(ckpt)
    model = next(p.name for p in (ckpt / TAG).iterdir() if p.name.endswith("model_states.pt"))
    optim = next(p.name for p in (ckpt / TAG).iterdir() if p.name.endswith("optim_states.pt"))
    table = payloads(marker)
    variants = []
    for i, (name, where) in enumerate(ENGINE_CASES):
        d = _copy(ckpt, f"hostile{i}")
        target = optim if where == "optimizer state" else model
        hostile_file(ckpt / TAG / target, d / target, where, table[name][0])
        variants.append({"name": f"{name} in {where}", "dir": f"bad/hostile{i}",
                         "expect": table[name][1], "file": str(d / target)})
    d = _copy(ckpt, "tags")
    state = torch.load(d / model, weights_only=False)
    state["tags"] = tag_dicts(marker)
    state["nested"] = [tag_dicts(marker)]
    torch.save(state, d / model)
    variants.append({"name": "tag dicts", "dir": "bad/tags", "client_keys": ["tags", "nested"]})
    return variants


@pytest.mark.parametrize("stage", [2, 3])
def test_hostile_deepspeed_checkpoints(tmp_path_factory, tmp_path, marker, stage):
    from test_resume import TAG, resume, saved

    ckpt = saved(tmp_path_factory, stage, 1)
    variants = _hostile_checkpoints(ckpt, marker)
    # The CLI: inspect of the folder, and the resume through the command.
    for v in variants:
        folder = pathlib.Path(ckpt) / v["dir"] / TAG
        for args in (("inspect", folder, "--json"),
                     ("load", folder, "--from", "deepspeed", "--dp", 1, "--json", "--quiet")):
            r = cli(*args)
            if "expect" in v:
                assert r.returncode == 2, (v["name"], args[0], r.stdout[-800:], r.stderr[-800:])
                assert v["expect"] in r.stderr, (v["name"], args[0], r.stderr[-800:])
                assert pathlib.Path(v["file"]).name in r.stderr, (v["name"], r.stderr[-800:])
                error_document(r, args[0], v["expect"])
            else:
                assert r.returncode == 0, (v["name"], args[0], r.stderr[-800:])
            assert not marker.exists(), v["name"]
    # engine.load_checkpoint under the drop-in: refused with the engine unchanged, or the plain
    # values restored.
    reports = resume(ckpt, stage, 1, variants=[{k: x for k, x in v.items() if k != "file"}
                                               for v in variants])
    for v, (r,) in zip(variants, reports):
        if "expect" in v:
            assert r["error"] is not None and v["expect"] in r["error"], (v["name"], r["error"])
            assert r["unchanged"] and r["resumes"] == [] and r["fallbacks"] == [], r
        else:
            assert r["error"] is None, (v["name"], r["error"])
            assert r["client_values"] == {"tags": tag_dicts(marker),
                                          "nested": [tag_dicts(marker)]}, r["client_values"]
    assert not marker.exists()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_refusal_wins_over_a_rank_that_cannot_serve(tmp_path_factory, marker, stage):
    """Rank 0 refuses a model file naming code while rank 1 cannot serve the call at all (its
    load_dir not a folder, say): no rank hands the call to DeepSpeed's own load, which would
    unpickle the file; every rank raises, every engine as it was, and nothing ran."""
    from test_resume import TAG, _copy, resume, saved

    ckpt = saved(tmp_path_factory, stage, 2)
    model = "mp_rank_00_model_states.pt" if stage < 3 else \
        "zero_pp_rank_0_mp_rank_00_model_states.pt"
    d = _copy(ckpt, "refused_here")
    hostile_file(pathlib.Path(ckpt) / TAG / model, d / model, "top",
                 payloads(marker)["GLOBAL+REDUCE"][0])
    (ranks,) = resume(ckpt, stage, 2, variants=[{"name": "refused and unserved",
                                                 "dir": "bad/refused_here", "unserved": True}])
    for r in ranks:
        assert r["error"] is not None and r["unchanged"], r
        assert r["resumes"] == [] and r["fallbacks"] == [], r
        assert "os system" in r["error"] and model in r["error"], r["error"]
    assert "failed on rank 0" in ranks[1]["error"], ranks[1]["error"]
    assert not marker.exists()


# ---- files that crashed, hung or were read two ways --------------------------------------------

def _zip_with_second_end_record(src, dst, fake):
    """`src` with a comment on its end record that holds the end record of `fake` (an archive
    of the same entries at the same offsets but other bytes): torch's reader takes the last end
    record it finds, zeroflat's took the one whose comment reaches the end of the file."""
    data = bytearray(pathlib.Path(src).read_bytes())
    fake_end = bytearray(pathlib.Path(fake).read_bytes()[-22:])
    # Its own comment length reaches past the end of the file: a reader that checks it skips
    # this record, one that takes the last signature does not.
    fake_end[-2:] = struct.pack("<H", 7)
    comment = bytes(fake_end)
    data[-2:] = struct.pack("<H", len(comment))
    pathlib.Path(dst).write_bytes(bytes(data) + comment)


def test_files_that_crashed_or_were_ambiguous_are_refused(tmp_path, marker):
    from zeroflat import _C, InvalidArgument

    cases = {}
    # A tensor expanded past 64 bits of bytes: 4 bytes in the file, 2^64 + 4 when read.
    path = tmp_path / "expanded.pt"
    torch.save({"x": torch.zeros(1).expand(2 ** 62 + 1)}, path)
    cases[path] = "more bytes than 64 bits hold"
    # One expanded within 64 bits but past what a value may take in memory.
    path = tmp_path / "expanded_large.pt"
    torch.save({"x": torch.zeros(1).expand(2 ** 40)}, path)
    cases[path] = "read whole here"
    listed = {path}  # inspect lists it (its place in the file), reading none of its elements
    # The int key 0 and the string key '0' in one dict: a lookup by path cannot tell them apart.
    path = tmp_path / "keys.pt"
    torch.save({"state": {0: torch.ones(2), "0": torch.zeros(2)}}, path)
    cases[path] = "ambiguous"
    # A second end record inside the comment of the last one.
    path = tmp_path / "two_ends.pt"
    torch.save({"w": torch.tensor([1.0, 2.0])}, tmp_path / "a.pt")
    _zip_with_second_end_record(tmp_path / "a.pt", path, tmp_path / "a.pt")
    cases[path] = "second end-of-central-directory"
    # A negative view: its stored bytes are not its values (torch.load negates them).
    path = tmp_path / "negative.pt"
    torch.save({"x": torch._neg_view(torch.arange(1.0, 5.0))}, path)
    cases[path] = "sets 'neg'"
    # An attribute that torch.load sets over the tensor's values (another tensor's).
    path = tmp_path / "attribute.pt"
    t = torch.arange(1.0, 5.0)
    t.__dict__["data"] = torch.zeros(4)
    torch.save({"x": t}, path)
    cases[path] = "set 'data'"
    # A storage record listed twice in two cases: torch's reader takes them for one name.
    path = tmp_path / "cases.pt"
    torch.save({"w": torch.arange(1.0, 5.0)}, tmp_path / "b.pt")
    with zipfile.ZipFile(tmp_path / "b.pt") as z:
        entries = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries:
            if name.endswith("/data/0"):
                z.writestr(name[:-len("data/0")] + "DATA/0", bytes(len(data)))
            z.writestr(name, data)
    cases[path] = "differ only in case"
    # An attribute of the saver's own (DeepSpeed's ds_id) is beside the values: read.
    path = tmp_path / "ds_id.pt"
    t = torch.arange(1.0, 5.0)
    t.ds_id = 3
    torch.save({"x": t}, path)
    assert torch.equal(_C.TorchFile(str(path)).value()["x"], torch.arange(1.0, 5.0))
    for path, expect in cases.items():
        with pytest.raises(InvalidArgument) as e:
            _C.TorchFile(str(path)).value()
        assert expect in str(e.value) and path.name in str(e.value), (path.name, str(e.value))
        r = cli("inspect", path, "--json")
        if path in listed:
            assert r.returncode == 0, (path.name, r.stderr[-500:])
        else:
            assert r.returncode == 2 and expect in r.stderr, (path.name, r.stderr[-500:])


@pytest.mark.parametrize("world", [0, 2 ** 40])
def test_universal_folder_with_a_bad_world_size(tmp_path_factory, world):
    from test_resume import TAG, saved, universal

    ckpt = pathlib.Path(saved(tmp_path_factory, 2, 1))
    universal([ckpt])
    src = ckpt / f"{TAG}_universal"
    d = tmp_path_factory.mktemp(f"universal_world_{world}") / "u"
    import shutil

    shutil.copytree(src, d)
    model = d / "mp_rank_00_model_states.pt"
    state = torch.load(model, weights_only=False)
    state["dp_world_size"] = world
    state["ds_config"].setdefault("zero_optimization", {})["round_robin_gradients"] = True
    torch.save(state, model)
    for args in (("inspect", d, "--json"), ("inspect", d, "--json", "--dp", 2),
                 ("load", d, "--from", "deepspeed", "--dp", 1, "--json", "--quiet")):
        r = cli(*args)
        assert r.returncode == 2, (args, r.returncode, r.stderr[-500:])
        assert "dp_world_size" in r.stderr and model.name in r.stderr, r.stderr[-500:]
        error_document(r, args[0], "dp_world_size")


# ---- a checkpoint the engine cannot take: refused before anything is written ------------------

def _base_state(optim_state):
    inner = optim_state["optimizer_state_dict"]
    return inner["base_optimizer_state"] if "base_optimizer_state" in inner else \
        inner["optimizer_state_dict"]


def _sgd(state):
    for entry in _base_state(state)["state"].values():
        entry["momentum_buffer"] = entry.pop("exp_avg")
        entry.pop("exp_avg_sq")


def _step_text(state):
    for entry in _base_state(state)["state"].values():
        entry["step"] = "3"


def _one_more_group(state):
    groups = _base_state(state)["param_groups"]
    groups.append(dict(groups[-1], params=[]))


def _buffer(state):
    state["module"]["scale"] = torch.arange(5.0)


EDITS = {
    # name: (file, edit, what the refusal names)
    "an SGD checkpoint into AdamW": ("optim", _sgd, "another optimizer"),
    "step saved as a string": ("optim", _step_text, "step"),
    "one more parameter group": ("optim", _one_more_group, "param_groups"),
    "no global_steps": ("model", lambda s: s.pop("global_steps"), "global_steps"),
    "no mp_world_size": ("model", lambda s: s.pop("mp_world_size"), "mp_world_size"),
    "lr_scheduler None": ("model", lambda s: s.update(lr_scheduler=None), "lr_scheduler"),
    "lr_scheduler a list": ("model", lambda s: s.update(lr_scheduler=[1, 2]), "lr_scheduler"),
    "a buffer of another size": ("model", _buffer, "scale"),
}


@pytest.mark.parametrize("stage", [2, 3])
def test_what_the_engine_cannot_take_is_refused_before_any_write(tmp_path_factory, stage):
    from test_resume import TAG, _copy, resume, saved

    ckpt = pathlib.Path(saved(tmp_path_factory, stage, 1))
    files = {"model": next(p.name for p in (ckpt / TAG).iterdir()
                           if p.name.endswith("model_states.pt")),
             "optim": next(p.name for p in (ckpt / TAG).iterdir()
                           if p.name.endswith("optim_states.pt"))}
    variants = []
    for i, (name, (which, edit, expect)) in enumerate(EDITS.items()):
        d = _copy(ckpt, f"edit{i}")
        state = torch.load(d / files[which], weights_only=False)
        edit(state)
        torch.save(state, d / files[which])
        variants.append({"name": name, "dir": f"bad/edit{i}", "expect": expect,
                         "file": files[which]})
    # Rank 0's optimizer file replaced by another of the same size after the checkpoint was
    # opened: its headers describe another file, which is refused, not read.
    _copy(ckpt, "replaced")
    variants.append({"name": "replaced after opening", "dir": "bad/replaced", "fault": "replace",
                     "expect": "replaced since it was opened", "file": files["optim"]})
    reports = resume(ckpt, stage, 1, variants=[{k: x for k, x in v.items() if k != "file"}
                                               for v in variants])
    for v, (r,) in zip(variants, reports):
        assert r["error"] is not None, (v["name"], r)
        assert v["expect"] in r["error"] and v["file"] in r["error"], (v["name"], r["error"])
        assert r["unchanged"] and r["resumes"] == [], (v["name"], r)


def test_a_universal_folder_missing_one_state_file_is_refused(tmp_path_factory):
    import shutil

    from test_resume import TAG, saved, universal

    ckpt = pathlib.Path(saved(tmp_path_factory, 2, 1))
    universal([ckpt])
    d = tmp_path_factory.mktemp("universal_missing") / "u"
    shutil.copytree(ckpt / f"{TAG}_universal", d)
    victim = [p for p in sorted((d / "zero").iterdir()) if (p / "exp_avg.pt").exists()][-1]
    (victim / "exp_avg.pt").unlink()
    for args in (("inspect", d, "--json"), ("inspect", d, "--json", "--dp", 2),
                 ("load", d, "--from", "deepspeed", "--dp", 1, "--json", "--quiet")):
        r = cli(*args)
        assert r.returncode == 2, (args, r.stdout[-500:], r.stderr[-500:])
        assert "exp_avg.pt" in r.stderr and victim.name in r.stderr, r.stderr[-500:]


def test_a_universal_state_of_a_dtype_not_read_is_refused_by_every_command(tmp_path_factory):
    """One parameter's exp_avg.pt saved as float64: the listing (inspect without --dp) refuses it
    as the plan (--dp) and the load do, naming the file, entry and dtype (the listing once
    showed it with exit 0); a load that reads no exp_avg takes the folder."""
    import shutil

    from test_resume import TAG, saved, universal

    ckpt = pathlib.Path(saved(tmp_path_factory, 2, 1))
    universal([ckpt])
    d = tmp_path_factory.mktemp("universal_float64") / "u"
    shutil.copytree(ckpt / f"{TAG}_universal", d)
    victim = [p for p in sorted((d / "zero").iterdir()) if (p / "exp_avg.pt").exists()][0]
    state = torch.load(victim / "exp_avg.pt", weights_only=False)
    if isinstance(state, dict):
        state["param"] = state["param"].double()
    else:
        state = state.double()
    torch.save(state, victim / "exp_avg.pt")
    for args in (("inspect", d), ("inspect", d, "--json"), ("inspect", d, "--dp", 2),
                 ("load", d, "--from", "deepspeed", "--dp", 1, "--quiet")):
        r = cli(*args)
        assert r.returncode == 2, (args, r.stdout[-500:], r.stderr[-500:])
        assert "float64" in r.stderr and f"{victim.name}/exp_avg.pt" in r.stderr, r.stderr[-500:]
    # A resume that does not read the state is not refused for it.
    for states in ("none", "exp_avg_sq"):
        r = cli("load", d, "--from", "deepspeed", "--dp", 1, "--states", states, "--quiet")
        assert r.returncode == 0, (states, r.stderr[-500:])


def test_universal_step_as_a_number_loads_and_a_missing_fp32_is_named(tmp_path_factory):
    """ds_to_universal writes step.pt as the optimizer kept the step: a tensor or, for
    BF16_Optimizer and ZeRO-1, a Python int; both are a universal checkpoint. A trained
    parameter's folder without fp32.pt is named as such."""
    import shutil

    from test_resume import TAG, saved, universal

    ckpt = pathlib.Path(saved(tmp_path_factory, 2, 1))
    universal([ckpt])
    d = tmp_path_factory.mktemp("universal_step") / "u"
    shutil.copytree(ckpt / f"{TAG}_universal", d)
    steps = sorted((d / "zero").glob("*/step.pt"))
    assert steps, "ds_to_universal wrote no step.pt"
    for i, s in enumerate(steps):
        torch.save(2 if i % 2 == 0 else {"param": 2}, s)
    r = cli("inspect", d, "--json", "--dp", 2)
    assert r.returncode == 0, r.stderr[-800:]
    r = cli("load", d, "--from", "deepspeed", "--dp", 2, "--json", "--quiet")
    assert r.returncode == 0, r.stderr[-800:]
    victim = steps[0].parent
    (victim / "fp32.pt").unlink()
    r = cli("inspect", d, "--json")
    assert r.returncode == 2 and "fp32.pt: missing" in r.stderr and victim.name in r.stderr, \
        r.stderr[-800:]


def test_an_index_that_leaves_out_a_tensor_its_shard_holds_is_named(tmp_path):
    """A Hugging Face index that does not list a tensor its shard holds, or places it in another
    shard: refused naming the shard that holds it, the tensor and the index, for every reader."""
    import json

    from safetensors.torch import save_file

    from zeroflat import _C

    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"a": torch.zeros(4), "b": torch.ones(3)}, str(tmp_path / first),
              metadata={"format": "pt"})
    save_file({"c": torch.zeros(2), "d": torch.ones(5)}, str(tmp_path / second),
              metadata={"format": "pt"})
    weight_map = {"a": first, "b": first, "c": second}
    for extra, words in ((None, "which its index model.safetensors.index.json does not list"),
                         (first, f"which its index model.safetensors.index.json places in "
                                 f"{first}")):
        if extra is not None:
            weight_map["d"] = extra
        with open(tmp_path / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        for pieces in (False, True):
            with pytest.raises(ValueError) as e:
                _C.Checkpoint(str(tmp_path), pieces=pieces)
            assert f"{second} holds tensor 'd', {words}" in str(e.value), str(e.value)
