"""zeroflat's torch.save reader against torch itself: states saved here with torch.save (nested
containers, views with storage offsets, non-contiguous and expanded tensors, every common dtype,
shared storages, torch.Size, empty tensors, Parameters, tensors with attributes) and real
DeepSpeed checkpoints (ZeRO-1, 2 and 3, 1 and 2 ranks, bf16 and fp16, this venv's DeepSpeed and
older releases from .venv/deepspeed-releases, and a universal checkpoint), listed by
`zeroflat inspect --json` and compared with torch.load of the same file: every tensor's path,
dtype, shape, stride and storage offset, and the bytes at its byte range. The reads `inspect
--dp N` plans for each rank of a new world rebuild exactly that rank's share of the fp32 master
and optimizer states (as DeepSpeed would lay them out at N ranks), frozen parameters and
buffers. Foreign globals, the legacy format and inconsistent checkpoint folders are exit 2, the
file and entry named.

Run as a script, it saves DeepSpeed checkpoints, one per STAGE:DTYPE, into OUT/zSTAGE_DTYPE, by
one set of WORLD ranks (the test runs it under each release):
    test_torch_file.py save OUT WORLD STAGE:DTYPE..."""

import collections
import enum
import importlib.util
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from reference import CheckpointModel as Model

HERE = pathlib.Path(__file__).resolve().parent
TAG = "step2"
# Releases besides the venv's own whose checkpoints the reader must list (an old and a middle
# one); each is installed by scripts/setup.sh under <venv>/deepspeed-releases/<release>.
OLDER_RELEASES = ["0.14.5", "0.16.9"]

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
           torch.float64: "float64", torch.int64: "int64", torch.int32: "int32",
           torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}


def cli_path():
    if os.environ.get("ZEROFLAT_CLI"):
        return pathlib.Path(os.environ["ZEROFLAT_CLI"])
    spec = importlib.util.find_spec("zeroflat")  # locates the build's package, imports nothing
    assert spec is not None and spec.submodule_search_locations, \
        "run with PYTHONPATH=<build>/python (ctest does), or set ZEROFLAT_CLI"
    package = pathlib.Path(list(spec.submodule_search_locations)[0]).resolve()
    cli = package.parents[1] / "zeroflat"  # <build>/python/zeroflat -> <build>/zeroflat
    assert cli.exists(), f"the build's zeroflat command is not at {cli}"
    return cli


def inspect(*args, expect_rc=0):
    r = subprocess.run([str(cli_path()), "inspect", *map(str, args)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == expect_rc, (args, r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return json.loads(r.stdout) if expect_rc == 0 and "--json" in args else r


def segment(key):
    """The path segment of a dict key (torch_file.h: torch_path_segment)."""
    if isinstance(key, str):
        return key.replace("%", "%25").replace("/", "%2F")
    if isinstance(key, bool) or key is None:
        return str(key)
    if isinstance(key, int):
        return str(key)
    if isinstance(key, float):
        return repr(key)
    if isinstance(key, tuple):
        return "(" + ", ".join(segment(k) for k in key) + ")"
    raise AssertionError(f"no segment rule for {key!r}")


def walk(value, path="", out=None):
    """Every tensor and scalar of a loaded state by path, in the order torch.save wrote them."""
    out = [] if out is None else out
    join = (lambda s: s) if path == "" else (lambda s: path + "/" + s)
    if isinstance(value, torch.Tensor):
        out.append((path, value))
    elif isinstance(value, enum.Enum) or isinstance(value, torch.dtype):
        pass  # {"enum": ...} and {"global": ...} in the document
    elif isinstance(value, bytes):
        out.append((path, value.hex()))
    elif isinstance(value, dict):
        for k, v in value.items():
            walk(v, join(segment(k)), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            walk(v, join(str(i)), out)
    elif isinstance(value, (set, frozenset)):
        pass  # order is Python's own: compared separately
    elif isinstance(value, (bool, int, float, str, type(None))):
        out.append((path, value))
    elif hasattr(value, "__dict__"):  # DeepSpeed's objects: their state
        for k, v in vars(value).items():
            if not k.startswith("_"):
                walk(v, join(segment(k)), out)
    return out


def json_walk(value, tensors, path="", out=None):
    """The same from `inspect --json`'s state."""
    out = [] if out is None else out
    join = (lambda s: s) if path == "" else (lambda s: path + "/" + s)
    if isinstance(value, dict) and set(value) == {"tensor"}:
        out.append((path, tensors[value["tensor"]]))
    elif isinstance(value, dict) and set(value) == {"bytes"}:
        out.append((path, value["bytes"]))
    elif isinstance(value, dict) and set(value) in ({"set"}, {"frozenset"}):
        pass
    elif isinstance(value, dict) and "object" in value:
        for k, v in value["state"].items():
            if not k.startswith("_"):
                json_walk(v, tensors, join(k), out)
    elif isinstance(value, dict) and "enum" in value:
        pass
    elif isinstance(value, dict) and "global" in value:
        pass
    elif isinstance(value, dict):
        for k, v in value.items():
            json_walk(v, tensors, join(k), out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            json_walk(v, tensors, join(str(i)), out)
    else:
        out.append((path, value))
    return out


def read_range(path, offset, n):
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(n)
    assert len(data) == n, (path, offset, n)
    return data


def tensor_from(path, t, dtype):
    """The tensor at `inspect`'s byte range of the file, as torch would view it."""
    if t["numel"] == 0:
        return torch.empty(t["shape"], dtype=dtype)
    raw = read_range(path, t["offset"], t["extent_bytes"])
    flat = torch.frombuffer(bytearray(raw), dtype=dtype)
    return flat.as_strided(t["shape"], t["stride"], 0)


def same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_file(path):
    """`inspect FILE --json` against torch.load(FILE): the same tensors at the same paths,
    their geometry, and their bytes at the ranges it gives; the same scalars. Returns the
    document."""
    doc = inspect(path, "--json")
    assert doc["source"] == "torch"
    loaded = torch.load(path, map_location="cpu", weights_only=False)
    want = walk(loaded)
    got = json_walk(doc["state"], doc["tensors"])
    assert [p for p, _ in got] == [p for p, _ in want], path
    want_tensors = [(p, v) for p, v in want if isinstance(v, torch.Tensor)]
    assert [t["path"] for t in doc["tensors"]] == [p for p, _ in want_tensors], path
    for t, (p, v) in zip(doc["tensors"], want_tensors):
        where = f"{path}: {p}"
        assert t["dtype"] == _DTYPES[v.dtype], where
        assert t["shape"] == list(v.shape), where
        assert t["stride"] == list(v.stride()), where
        assert t["storage_offset"] == v.storage_offset(), where
        assert t["numel"] == v.numel(), where
        assert t["contiguous"] == v.is_contiguous(), where
        assert t["requires_grad"] == v.requires_grad, where
        assert same_bits(tensor_from(path, t, v.dtype), v.detach()), where
        if t["contiguous"]:
            assert t["bytes"] == v.numel() * v.element_size(), where
            data = read_range(path, t["offset"], t["bytes"])
            assert data == v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    for (p, a), (_, b) in zip(got, want):
        if not isinstance(b, torch.Tensor):
            assert a == b or (isinstance(b, float) and not math.isfinite(b) and a is None), (path, p)
    return doc


def test_states_saved_by_torch_are_listed_as_torch_loads_them(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    shared = torch.arange(20, dtype=torch.float32)
    param = torch.nn.Parameter(torch.randn(3, generator=g))
    tagged = torch.ones(2, dtype=torch.float16)
    tagged.ds_id = "1_3"  # a Python attribute: torch writes _rebuild_from_type_v2
    states = {
        "nested": {
            "a": base,
            "row": base[2],                # a view: storage offset 16
            "cols": base[:, 3],            # not contiguous
            "t": base.t(),                 # transposed
            "every_other": shared[1::2],   # stride 2, offset 1
            "again": base,                 # the same tensor twice
            "list": [shared[:5], (shared[5:9], {"deep": [shared.view(4, 5)[1:, 2:]]})],
            "od": collections.OrderedDict([("x", torch.zeros(3, dtype=torch.bfloat16)),
                                           ("y", 1)]),
            "size": torch.Size([4, 5, 6]),
            "scalars": [1, -2**62, 2.5, float("inf"), "text", None, True, b"\x00\xffbytes"],
            7: "int key",
            (1, "a"): "tuple key",
            "a/b%": "escaped key",
        },
        "dtypes": {str(d): (torch.arange(12) % 7).to(d).reshape(3, 4)
                   for d in [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                             torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                             torch.bool]},
        "empty": [torch.empty(0), torch.empty(3, 0, dtype=torch.bfloat16), torch.zeros(0)[0:0]],
        "scalar": torch.tensor(3.25),
        "expanded": torch.ones(3).expand(4, 3),
        "parameter": param,
        "tagged": tagged,
        "a set": {1, 2},
    }
    for name, state in [("mixed", states), ("root_tensor", base[1:, ::2]),
                        ("root_list", [shared, shared[3:]]), ("int", 5)]:
        path = tmp_path / f"{name}.pt"
        torch.save(state, path)
        doc = check_file(path)
        assert doc["archive"] == name  # the archive folder is the file's stem
    doc = check_file(tmp_path / "mixed.pt")
    by_path = {t["path"]: t for t in doc["tensors"]}
    assert by_path["nested/row"]["storage_offset"] == 16
    assert by_path["nested/row"]["storage"] == by_path["nested/a"]["storage"]
    assert not by_path["nested/cols"]["contiguous"]
    assert by_path["expanded"]["stride"] == [0, 1]
    assert by_path["parameter"]["requires_grad"]
    assert by_path["dtypes/torch.bfloat16"]["dtype"] == "bf16"
    assert doc["state"]["nested"]["size"] == [4, 5, 6]
    assert "torch._utils _rebuild_parameter" in doc["globals"]
    assert "torch._tensor _rebuild_from_type_v2" in doc["globals"]
    assert sorted(doc["state"]["a set"]["set"]) == [1, 2]
    # Storages are aligned as torch wrote them, and each lies inside the file.
    size = (tmp_path / "mixed.pt").stat().st_size
    for s in doc["storages"]:
        assert s["offset"] % 64 == 0 and s["offset"] + s["bytes"] <= size


def test_foreign_globals_and_the_legacy_format_are_refused(tmp_path):
    import datetime
    path = tmp_path / "foreign.pt"
    torch.save({"w": torch.ones(2), "when": datetime.date(2024, 1, 2)}, path)
    r = inspect(path, expect_rc=2)
    assert "'datetime date'" in r.stderr and "foreign.pt" in r.stderr and "allow-list" in r.stderr
    torch.save({"f": os.system}, path)
    r = inspect(path, expect_rc=2)
    assert "'posix system'" in r.stderr or "'nt system'" in r.stderr, r.stderr
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    r = inspect(legacy, expect_rc=2)
    assert "legacy format" in r.stderr and "legacy.pt" in r.stderr
    # A compressed archive (a zip tool's doing, never torch.save's).
    import zipfile
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as z:
        entries = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in entries:
            z.writestr(name, data)
    r = inspect(path, expect_rc=2)
    assert "compressed (method 8)" in r.stderr and "data.pkl" in r.stderr, r.stderr


# ---- DeepSpeed checkpoints -----------------------------------------------------------------------

def _save_worker(rank, world, port, out, kinds):
    from reference import end_rank, init_deepspeed_rank

    os.environ["LOCAL_SIZE"] = str(world)  # 0.14 and 0.15's CPU accelerator asks
    init_deepspeed_rank(rank, world, port)
    import deepspeed

    deepspeed.accelerator.get_accelerator().is_fp16_supported = lambda: True
    for stage, dtype in kinds:
        model = Model()
        optimizer = torch.optim.AdamW(model.groups(), lr=1e-3)
        # fp16: a small first loss scale, so that the two steps do not both overflow (and skip).
        precision = {"enabled": True, **({"initial_scale_power": 4} if dtype == "fp16" else {})}
        config = {"train_micro_batch_size_per_gpu": 2, dtype: precision,
                  "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(2):
            x = torch.randint(0, 37, (2, 5), generator=gen)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(os.path.join(out, f"z{stage}_{dtype}"), tag=TAG)
        torch.distributed.barrier()
        del engine, optimizer, model
    torch.distributed.destroy_process_group()
    end_rank()


_SAVED = {}


def release_path(release):
    if release is None:
        return None
    path = pathlib.Path(sys.prefix) / "deepspeed-releases" / release
    if not path.is_dir():
        pytest.skip(f"DeepSpeed {release} is not installed at {path} (scripts/setup.sh installs it)")
    return path


def _kinds(release, world):
    """What one save run writes for a release at a world size: every (stage, dtype) the tests
    below read (one set of ranks, started once, saves them all)."""
    if release is not None:
        return [(2, "bf16"), (3, "bf16")]
    return [(1, "bf16"), (2, "bf16"), (3, "bf16")] + ([(2, "fp16")] if world == 2 else [])


def saved(tmp_path_factory, release, stage, world, dtype="bf16"):
    """A checkpoint saved by `release` (None: the venv's own), cached for the session."""
    key = (release, world)
    kinds = _kinds(release, world)
    assert (stage, dtype) in kinds, (stage, dtype, kinds)
    if key not in _SAVED:
        out = tmp_path_factory.mktemp(f"ds_{release or 'own'}_w{world}")
        if release is None:  # ranks forked by this process's fork server: nothing to import
            from reference import start_ranks

            start_ranks(_save_worker, world, str(out), kinds)
            _SAVED[key] = out
            return out / f"z{stage}_{dtype}"
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        rel = release_path(release)
        env["PYTHONPATH"] = os.pathsep.join(
            ([str(rel)] if rel else []) + [str(HERE)] + env.get("PYTHONPATH", "").split(os.pathsep))
        r = subprocess.run([sys.executable, str(HERE / "test_torch_file.py"), "save", str(out),
                            str(world), *(f"{s}:{d}" for s, d in kinds)], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        _SAVED[key] = out
    return _SAVED[key] / f"z{stage}_{dtype}"


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def expected_groups(stage):
    """The model's trained parameters per optimizer group, by name, with their values."""
    m = Model()
    names = {id(p): n for n, p in m.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in m.groups()]


def saved_values(ckpt, doc):
    """Every trained parameter's fp32 master values and exp_avg, and each group's step, as
    torch.load of the saved files gives them: {name: (fp32, exp_avg)}, [step per group]."""
    files = [f["path"] for f in doc["files"]]
    world = doc["world"]
    values, steps = {}, []
    if doc["zero_stage"] == 3:
        models = [load(f) for f in files if f.endswith("_model_states.pt")]
        optims = [load(f)["optimizer_state_dict"] for f in files if "optim_states" in f]
        for s, shapes in enumerate(models[0]["param_shapes"]):
            at = 0
            for name, shape in shapes.items():
                n = math.prod(shape)
                p = -(-n // world)
                fp32 = torch.cat([o["fp32_flat_groups"][s][at:at + p] for o in optims])[:n]
                avg = torch.cat([o["optimizer_state_dict"]["state"][s]["exp_avg"][at:at + p]
                                 for o in optims])[:n]
                values[name] = (fp32, avg)
                at += p
            steps.append(optims[0]["optimizer_state_dict"]["state"][s]["step"])
        return values, steps
    model = load(next(f for f in files if f.endswith("mp_rank_00_model_states.pt")))
    optims = [load(f)["optimizer_state_dict"] for f in files if "optim_states" in f]
    for g, shapes in enumerate(model["param_shapes"]):
        lean = [o["single_partition_of_fp32_groups"][g] for o in optims]
        part = max(x.numel() + o["group_paddings"][g] for x, o in zip(lean, optims))
        flat = torch.cat([torch.cat([x, torch.zeros(part - x.numel())]) for x in lean])
        avg = torch.cat([o["base_optimizer_state"]["state"][g]["exp_avg"] for o in optims])
        at = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            values[name] = (flat[at:at + n], avg[at:at + n])
            at += n
        steps.append(optims[0]["base_optimizer_state"]["state"][g]["step"])
    return values, steps


def new_partitions(doc, values, world, rank):
    """Rank `rank`'s share at `world` ranks as DeepSpeed lays it out: per group (ZeRO-1/2: the
    flat buffer padded to 2 x world, cut in world parts; ZeRO-3: each parameter padded to a
    multiple of world, its rank-th part), fp32 and exp_avg."""
    out = []
    for group in doc["groups"]:
        names = [p["name"] for p in group["params"]]
        if doc["zero_stage"] == 3:
            parts = []
            for which in (0, 1):
                pieces = []
                for n in names:
                    v = values[n][which]
                    p = -(-v.numel() // world)
                    v = torch.cat([v, torch.zeros(p * world - v.numel())])
                    pieces.append(v[rank * p:(rank + 1) * p])
                parts.append(torch.cat(pieces))
            out.append(parts)
        else:
            parts = []
            for which in (0, 1):
                flat = torch.cat([values[n][which] for n in names])
                flat = torch.cat([flat, torch.zeros((-flat.numel()) % (2 * world))])
                p = flat.numel() // world
                parts.append(flat[rank * p:(rank + 1) * p])
            out.append(parts)
    return out


def check_resume(ckpt, doc, world):
    """`inspect --dp world`: every rank's reads (the loader's own, buffer by buffer) rebuild its
    share exactly, and the small tensors it reads whole are the steps, frozen parameters and
    buffers."""
    plan = inspect(ckpt, "--json", "--dp", world, *(["--tag", doc["tag"]]))["resume"]
    assert plan["world"] == world and len(plan["ranks"]) == world
    zero3 = doc["zero_stage"] == 3
    if doc["format"] == "universal":
        values = {}
        for u in doc["universal"]:
            t = {x["name"]: x["tensor"] for x in u["tensors"]}
            if "exp_avg" in t:
                values[u["name"]] = tuple(
                    torch.frombuffer(bytearray(read_range(doc["files"][t[k]["file"]]["path"],
                                                          t[k]["offset"], t[k]["bytes"])),
                                     dtype=torch.float32) for k in ("fp32", "exp_avg"))
        steps = None
    else:
        values, steps = saved_values(ckpt, doc)
    files = [f["path"] for f in doc["files"]]
    # The steps and the module file's tensors: read whole, the same for every rank.
    small = {(s["target"], s["group"], s["name"]): read_range(files[s["file"]], s["offset"],
                                                              s["bytes"])
             for s in plan["small"]}
    if steps is not None:
        for g, step in enumerate(steps):
            got = torch.frombuffer(bytearray(small[("step", g, "")]), dtype=torch.float32)
            assert same_bits(got, step.reshape(1)), (ckpt, g)
    module = {name for target, _, name in small if target == "module"}
    if zero3:
        assert any(b["target"] == "frozen" for b in plan["buffers"])
        module.add("frozen")
    assert module == {"frozen", "scale"}, module
    total = 0
    for r, rank in enumerate(plan["ranks"]):
        want = new_partitions(doc, values, world, r)
        if zero3:  # one buffer per target: every group's partitions back to back
            want = [[torch.cat([w[0] for w in want]), torch.cat([w[1] for w in want])]]
        keys = [(b["target"], b["group"]) for b in rank["buffers"]]
        numel = {k: b["partition_numel"] for k, b in zip(keys, rank["buffers"])}
        got = {k: torch.zeros(n) for k, n in numel.items() if k[0] in ("fp32", "exp_avg")}
        for x in rank["reads"]:
            key = (x["target"], x["group"])
            if key not in got:
                continue
            data = read_range(files[x["file"]], x["offset"], x["bytes"])
            v = torch.frombuffer(bytearray(data), dtype=torch.float32)
            assert v.numel() == x["numel"]
            got[key][x["dest"]:x["dest"] + x["numel"]] = v
            if x["target"] == "fp32":
                total += x["numel"]
        groups = [None] if zero3 else [g for g in range(len(want))]
        for g, w in zip(groups, want):
            assert numel[("fp32", g)] == w[0].numel(), (r, g)
            assert same_bits(w[0], got[("fp32", g)]), (ckpt, world, r, g, "fp32")
            assert same_bits(w[1], got[("exp_avg", g)]), (ckpt, world, r, g, "exp_avg")
        # The bytes each rank reads are its buffers' reads and the small tensors'.
        assert rank["read_bytes"] == sum(x["bytes"] for x in rank["reads"])
        assert rank["bytes"] == rank["read_bytes"] + sum(s["bytes"] for s in plan["small"])
    assert total == sum(g["numel"] for g in doc["groups"])  # each element once, over all ranks


def check_checkpoint(ckpt, stage, world, release, dtype="bf16"):
    doc = inspect(ckpt, "--json")
    assert doc["source"] == "deepspeed" and doc["tag"] == TAG
    assert doc["format"] == ("zero-3" if stage == 3 else "zero-1/2")
    assert doc["zero_stage"] == stage and doc["world"] == world and doc["mp_world"] == 1
    assert doc["dtype"] == dtype
    if release:
        assert doc["ds_version"] == release
    assert [[p["name"] for p in g["params"]] for g in doc["groups"]] == expected_groups(stage)
    m = Model()
    shapes = {n: list(p.shape) for n, p in m.named_parameters()}
    for g in doc["groups"]:
        for p in g["params"]:
            assert p["shape"] == shapes[p["name"]]
    assert [f["name"] for f in doc["frozen"]] == ["frozen"]
    assert doc["buffers"] == ["scale"]
    assert doc["bookkeeping"]["global_steps"] == 2
    # Every file lists as torch.load reads it; the fp32 partitions' ranges hold their values.
    for f in doc["files"]:
        check_file(f["path"])
    for sg in doc["sub_groups"]:
        assert len(sg["ranks"]) == world
        for r, part in enumerate(sg["ranks"]):
            t = part["fp32"]
            path = doc["files"][t["file"]]["path"]
            assert doc["files"][t["file"]]["rank"] == r
            saved_t = load(path)
            for k in t["path"].split("/"):
                saved_t = saved_t[int(k) if isinstance(saved_t, list) else k]
            assert same_bits(tensor_from(path, dict(t, stride=[1], extent_bytes=t["bytes"]),
                                         torch.float32), saved_t)
            assert {s["name"] for s in part["states"]} == {"exp_avg", "exp_avg_sq", "step"}
    # The text form names what the JSON holds.
    text = inspect(ckpt, "--dp", 3).stdout
    assert f"ZeRO stage {stage}, saved by {world} rank" in text and "rank 2 reads" in text
    for new_world in (1, 2, 3):
        check_resume(ckpt, doc, new_world)
    return doc


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_deepspeed_checkpoints_of_this_release(tmp_path_factory, stage, world):
    import importlib.metadata
    release = importlib.metadata.version("deepspeed").split("+")[0]
    check_checkpoint(saved(tmp_path_factory, None, stage, world), stage, world, release)


@pytest.mark.parametrize("release", OLDER_RELEASES)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_checkpoints_of_older_releases(tmp_path_factory, release, stage):
    check_checkpoint(saved(tmp_path_factory, release, stage, 2), stage, 2, release)


def test_fp16_checkpoint_with_a_dynamic_loss_scaler(tmp_path_factory):
    ckpt = saved(tmp_path_factory, None, 2, 2, "fp16")
    doc = check_checkpoint(ckpt, 2, 2, None, "fp16")
    assert doc["bookkeeping"]["dynamic_loss_scale"]
    names = {pathlib.Path(f["path"]).name for f in doc["files"]}
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in names  # no bf16_ prefix


def universal_of(tmp_path_factory):
    """The ZeRO-2 checkpoint saved at 2 ranks, converted by ds_to_universal (once): its tag
    folder."""
    ckpt = saved(tmp_path_factory, None, 2, 2)
    out = ckpt / f"{TAG}_universal"
    if not out.exists():
        r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                            "--input_folder", str(ckpt / TAG), "--output_folder", str(out),
                            "--inject_missing_state"],
                           env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
    return out


def test_universal_checkpoint(tmp_path_factory):
    ckpt = saved(tmp_path_factory, None, 2, 2)
    universal_of(tmp_path_factory)
    doc = inspect(ckpt, "--json", "--tag", f"{TAG}_universal")
    assert doc["format"] == "universal" and doc["world"] == 2
    names = {u["name"] for u in doc["universal"]}
    assert {"embed.weight", "fc2.bias", "frozen"} <= names
    values, _ = saved_values(ckpt, inspect(ckpt, "--json"))
    for u in doc["universal"]:
        t = {x["name"]: x["tensor"] for x in u["tensors"]}
        if u["name"] in values:
            fp32 = torch.frombuffer(bytearray(read_range(doc["files"][t["fp32"]["file"]]["path"],
                                                         t["fp32"]["offset"], t["fp32"]["bytes"])),
                                    dtype=torch.float32)
            assert torch.equal(fp32, values[u["name"]][0])
    for world in (1, 3):
        check_resume(ckpt, doc, world)


def test_inconsistent_checkpoint_folders_are_refused(tmp_path_factory, tmp_path):
    src = saved(tmp_path_factory, None, 2, 2)

    def copy(name):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst, dst / TAG

    d, tag = copy("missing")
    (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    r = inspect(d, expect_rc=2)
    assert "partition_count" in r.stderr and "missing" in r.stderr, r.stderr

    d, tag = copy("extra")
    shutil.copy(tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    r = inspect(d, expect_rc=2)
    assert "more ranks" in r.stderr, r.stderr

    d, tag = copy("gap")
    (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").rename(
        tag / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt")
    r = inspect(d, expect_rc=2)
    assert "no optimizer file of rank 1" in r.stderr, r.stderr

    d, tag = copy("twice")
    shutil.copy(tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                tag / "bf16_zero_pp_rank_1_mp_rank_00optim_states.pt")
    r = inspect(d, expect_rc=2)
    assert "two optimizer files of rank 1" in r.stderr, r.stderr

    d, tag = copy("release")
    f = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = load(f)
    state["ds_version"] = "0.15.0"
    torch.save(state, f)
    r = inspect(d, expect_rc=2)
    assert "disagree on 'ds_version'" in r.stderr and "rank_1" in r.stderr, r.stderr

    d, tag = copy("world")
    f = tag / "mp_rank_00_model_states.pt"
    state = load(f)
    state["dp_world_size"] = 4
    torch.save(state, f)
    r = inspect(d, expect_rc=2)
    assert "dp_world_size" in r.stderr and "mp_rank_00_model_states.pt" in r.stderr, r.stderr

    d, tag = copy("mapping")
    f = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = load(f)
    state["optimizer_state_dict"]["param_slice_mappings"][0]["norm.bias"].start += 1
    torch.save(state, f)
    r = inspect(d, expect_rc=2)
    assert "param_slice_mappings/0/norm.bias" in r.stderr, r.stderr

    d, tag = copy("mp")
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    r = inspect(d, expect_rc=2)
    assert "not supported" in r.stderr and "mp_rank_01" in r.stderr, r.stderr

    d, tag = copy("latest")
    (d / "latest").write_text("no_such_tag")
    r = inspect(d, expect_rc=2)
    assert "no_such_tag" in r.stderr, r.stderr

    d, tag = copy("foreign")
    f = tag / "mp_rank_00_model_states.pt"
    state = load(f)
    state["lr_scheduler"] = collections.Counter(a=1)
    torch.save(state, f)
    r = inspect(d, expect_rc=2)
    assert "'collections Counter'" in r.stderr and "mp_rank_00_model_states.pt" in r.stderr


if __name__ == "__main__" and len(sys.argv) >= 5 and sys.argv[1] == "save":
    from reference import fork_deepspeed_ranks

    fork_deepspeed_ranks(_save_worker, int(sys.argv[3]), sys.argv[2],
                         [(int(k.split(":")[0]), k.split(":")[1]) for k in sys.argv[4:]])


# ---- config.json as the installed Transformers writes it ---------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3", "qwen2", "llama", "mistral"])
def test_a_config_written_by_transformers_has_its_models_parameters(tmp_path, arch):
    """`zeroflat inspect config.json` of a config the installed Transformers saved (its own
    defaults: no head_dim for Qwen3-MoE, the expert count under Transformers 5's name) counts
    exactly the parameters of the model Transformers builds from it."""
    import transformers

    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        shape.update(moe_intermediate_size=16, num_experts_per_tok=2)
        shape["num_local_experts" if "num_local_experts" in
              transformers.Qwen3MoeConfig().to_dict() else "num_experts"] = 3
    config = transformers.AutoConfig.for_model(arch, **shape)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    want = sum(p.numel() for p in model.parameters())
    got = inspect(tmp_path / "config.json", "--json")
    assert got["source"] == "config" and got["numel"] == want, (arch, got["numel"], want)
