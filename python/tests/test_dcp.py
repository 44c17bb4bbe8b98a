"""zeroflat.dcp.Reader on DCP's own checkpoints (``.metadata`` and ``.distcp``, what
``torch.distributed.checkpoint.save`` writes): a model and its AdamW state saved by FSDP2 at 4
ranks, loaded at 2 and at 3 (CPU, gloo) equal bit for bit to DCP's own FileSystemReader's
load, every rank's local shards and optimizer states alike, the next steps' losses identical,
each rank reading its share; and hostile indexes and items refused naming the global or the
field, before anything is written, nothing run (a marker file proves it).

Run as a script, it is one rank's worker (the tests start them).

Past 700 lines on purpose: the hostile cases edit the same saved checkpoint that the equality
cases load, with the same helpers."""

import json
import os
import pickle
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from reference import end_rank, start_ranks  # noqa: E402

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402


VOCAB = 3001


class Net(torch.nn.Module):
    """Sizes that 3 and 4 ranks do not divide (uneven and empty shards), a bf16 and an fp32
    part, and an int64 buffer (a dtype the reader copies as stored)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 40)  # most of the bytes, as in real models
        self.layers = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.GELU()) for _ in range(2)])
        self.head = torch.nn.Linear(40, 5, bias=False)
        self.tiny = torch.nn.Parameter(torch.randn(2))  # fewer rows than ranks
        self.register_buffer("counts", torch.arange(6, dtype=torch.int64))
        self.layers[1].to(torch.bfloat16)

    def forward(self, x):
        h = self.embed(x)
        h = self.layers[0](h)
        h = self.layers[1](h.to(torch.bfloat16)).float()
        return self.head(h).sum() + self.tiny.sum()


def _sharded(seed, mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model, opt, rank, k):
    gen = torch.Generator().manual_seed(1000 * k + rank)
    loss = model(torch.randint(0, VOCAB, (3, 4), generator=gen))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def _local(v):
    return v.to_local() if hasattr(v, "to_local") else v


def _flat(sd, prefix=""):
    """Every tensor and value of a nested state dict, by path."""
    out = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(_flat(v, f"{prefix}{k}/"))
    elif isinstance(sd, (list, tuple)) and not isinstance(sd, torch.Size):
        for i, v in enumerate(sd):
            out.update(_flat(v, f"{prefix}{i}/"))
    else:
        out[prefix] = sd
    return out


def _save(rank, mesh, job):
    model, opt = _sharded(0, mesh)
    for k in range(2):
        _step(model, opt, rank, k)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=job["path"],
             use_collectives=not job.get("no_collectives"))
    return {}


def _save_both(rank, mesh, job):
    """The same state saved by DCP's own writer (job["dcp_path"]) and by zeroflat.dcp.Writer,
    under dcp.save (job["path"]) and dcp.async_save (job["async_path"])."""
    import zeroflat.dcp

    model, opt = _sharded(0, mesh)
    for k in range(2):
        _step(model, opt, rank, k)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.save(sd, checkpoint_id=job["dcp_path"])
    dcp.save(sd, storage_writer=zeroflat.dcp.Writer(job["path"]))
    dcp.async_save(sd, storage_writer=zeroflat.dcp.Writer(job["async_path"])).result()
    with zeroflat.dcp.installed(writer=True):  # the FileSystemWriter async_save makes: zeroflat's
        dcp.async_save(sd, checkpoint_id=job["installed_path"]).result()
        served = zeroflat.dcp.stats["saves_served"]
    return {"served": served}


def _process_saves(rank, mesh, job):
    """Three async_saves through zeroflat.dcp.Writer under the process executor (the write in
    DCP's checkpoint process): whether each save was staged into the process's staging (not a
    copy of its own), and each folder as DCP's reader loads it."""
    import zeroflat.dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from zeroflat import _dcp_writer

    def state(v):
        return {"w": torch.full((256, 64), float(v)), "n": v}

    staged_at = []
    stage = _dcp_writer.stage

    def spy(sd):
        out = stage(sd)
        staged_at.append(out["w"] is _dcp_writer._staging["copy"]["w"])
        return out

    _dcp_writer.stage = spy
    loaded = []
    try:
        for v in range(3):
            path = os.path.join(job["path"], str(v))
            dcp.async_save(state(v), storage_writer=zeroflat.dcp.Writer(path),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
            got = state(-100)
            dcp.load(got, storage_reader=dcp.FileSystemReader(path))
            loaded.append(bool(torch.equal(got["w"], state(v)["w"])) and got["n"] == v)
    finally:
        _dcp_writer.stage = stage
    return {"staged_at": staged_at, "loaded": loaded}


def _load_both(rank, mesh, job):
    """The folders of _save_both, each read by DCP's reader and by zeroflat's: the same."""
    import zeroflat.dcp

    got = []
    for path in (job["dcp_path"], job["path"], job["async_path"], job["installed_path"]):
        for reader in (dcp.FileSystemReader(path), zeroflat.dcp.Reader(path)):
            model, opt = _sharded(1, mesh)
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, storage_reader=reader)
            got.append({k: _local(v).detach().clone() if torch.is_tensor(v) else v
                        for k, v in _flat(sd).items()})
    ref = got[0]
    for flat in got[1:]:
        assert ref.keys() == flat.keys()
        for k, v in ref.items():
            if torch.is_tensor(v):
                assert v.dtype == flat[k].dtype and torch.equal(v, flat[k]), k
            else:
                assert v == flat[k], (k, v, flat[k])
    return {"tensors": len(ref)}


def _load(rank, mesh, job):
    import zeroflat.dcp

    got = []
    for reader in (dcp.FileSystemReader(job["path"]), zeroflat.dcp.Reader(job["path"])):
        model, opt = _sharded(1, mesh)  # other values than the checkpoint's
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        flat = {k: _local(v).detach().clone() if torch.is_tensor(v) else v
                for k, v in _flat(state).items()}
        got.append((model, opt, reader, flat))
    (m0, o0, _, ref), (m1, o1, ours, flat) = got
    assert ref.keys() == flat.keys()
    share = 0
    for k, v in ref.items():
        if torch.is_tensor(v):
            assert v.dtype == flat[k].dtype and torch.equal(v, flat[k]), k
            share += v.numel() * v.element_size()
        else:
            assert v == flat[k], (k, v, flat[k])
    losses = [[_step(m, o, rank, 10 + k) for k in range(3)] for m, o in ((m0, o0), (m1, o1))]
    assert losses[0] == losses[1], losses
    return {"read": ours.bytes_read, "share": share, "tensors": len(ref)}


def _broken_load(rank, mesh, job):
    """A load that one rank's part of the checkpoint makes fail: every rank raises, and every
    rank's model and optimizer are as they were."""
    from torch.distributed.checkpoint.api import CheckpointException

    import zeroflat.dcp

    model, opt = _sharded(1, mesh)
    msd, osd = get_state_dict(model, opt)
    before = {k: _local(v).detach().clone() for k, v in _flat(msd).items() if torch.is_tensor(v)}
    group = mesh.get_group() if job.get("mesh_ranks") else None
    try:
        dcp.load({"model": msd, "optim": osd}, storage_reader=zeroflat.dcp.Reader(job["path"]),
                 process_group=group)
    except CheckpointException as e:
        error = str(e) + " " + " ".join(str(f) for f in e.failures.values())
    else:
        raise AssertionError("the load did not fail")
    after = {k: _local(v) for k, v in _flat(msd).items() if torch.is_tensor(v)}
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def _hf_full():
    """What the pieces tests save: rows that 2 and 3 ranks do not divide, a tensor with fewer
    rows than ranks (empty pieces), bf16, fp32 and an int64 tensor (read as stored)."""
    torch.manual_seed(0)
    return {"a.weight": torch.randn(7, 4).to(torch.bfloat16), "b.bias": torch.randn(5),
            "c.tiny": torch.randn(2, 3), "d.count": torch.arange(9, dtype=torch.int64)}


def _hf_save(rank, mesh, job):
    """Every tensor as Shard(0) DTensors saved by DCP's HuggingFaceStorageWriter with
    save_distributed=True and no consolidation: each rank a file of its pieces."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.tensor import Shard, distribute_tensor

    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _hf_full().items()}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(job["path"], save_distributed=True))
    return {}


def _hf_load(rank, mesh, job):
    """The folder of pieces read at this world by DCP's own HF reader (the reference) and by
    zeroflat.dcp.Reader, into Shard(0) DTensors: each rank's local shards compared; where the
    job says so, the folder is broken: every rank refuses, its shards untouched."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.tensor import Shard, distribute_tensor

    import zeroflat.dcp

    full = _hf_full()

    def fresh():
        return {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
                for k, v in full.items()}

    theirs, path, reader_class = None, job["path"], zeroflat.dcp.Reader
    if job.get("replaced"):
        # Each rank its own copy of the folder; the last rank's files are replaced (renamed
        # over, the same bytes) after its reader read their headers.
        path = f"{job['path']}.rank{rank}"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(job["path"], path)
        if rank == mesh.size() - 1:
            class Replacing(zeroflat.dcp.Reader):
                def read_metadata(self, *args, **kwargs):
                    md = super().read_metadata(*args, **kwargs)
                    for name in os.listdir(path):
                        shutil.copyfile(os.path.join(path, name), os.path.join(path, "new"))
                        os.replace(os.path.join(path, "new"), os.path.join(path, name))
                    return md
            reader_class = Replacing
    if not job.get("broken"):
        theirs = fresh()
        dcp.load(theirs, storage_reader=HuggingFaceStorageReader(path))
        assert all(torch.equal(theirs[k].full_tensor(), full[k]) for k in full)
    ours, reader, error = fresh(), reader_class(path), None
    try:
        dcp.load(ours, storage_reader=reader)
    except CheckpointException as e:  # DCP's, a BaseException, carrying each rank's error
        error = str(e) + " " + " ".join(str(f) for f in e.failures.values())
    if error or theirs is None:
        return {"error": error, "unchanged": all(not ours[k].to_local().any() for k in full)}
    return {"error": None,
            "equal": all(torch.equal(ours[k].to_local(), theirs[k].to_local()) and
                         torch.equal(ours[k].full_tensor(), full[k]) for k in full),
            "read": reader.bytes_read,
            "share": sum(ours[k].to_local().numel() * ours[k].to_local().element_size()
                         for k in full)}


def worker(rank, world, port, job):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world)
    if job.get("mesh_ranks"):  # a model on some of the job's ranks; the others load nothing
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh("cpu", job["mesh_ranks"])
        if rank not in job["mesh_ranks"]:
            job = {**job, "what": "nothing"}
    else:
        mesh = init_device_mesh("cpu", (world,))
    result = {"nothing": lambda *a: {}, "save": _save, "load": _load, "hf_save": _hf_save,
              "hf_load": _hf_load, "broken_load": _broken_load, "save_both": _save_both,
              "load_both": _load_both, "process_saves": _process_saves}[job["what"]](
                  rank, mesh, job)
    dist.barrier()
    with open(f"{job['out']}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    # end_rank's os._exit skips the process's own wait for the removal of a folder a save
    # replaced (done in the library's thread after the publication): waited for here.
    from zeroflat import _C

    _C.finish_removals()
    end_rank()


def run(world, job, tmp):
    out = os.path.join(tmp, f"result_{job['what']}_{world}")
    start_ranks(worker, world, {**job, "out": out}, preload=("torch.distributed.fsdp",))
    ranks = []
    for r in range(world):
        with open(f"{out}.{r}") as f:
            ranks.append(json.load(f))
    return ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    path = str(root / "ck")
    run(4, {"what": "save", "path": path}, str(root))
    return path


@pytest.mark.parametrize("world", [2, 3])
def test_saved_at_4_loads_at_2_and_3_as_dcps_own_reader_does(saved, world, tmp_path):
    ranks = run(world, {"what": "load", "path": saved}, str(tmp_path))
    for r in ranks:
        # Each rank reads the parts of the saved chunks its shards overlap: its share, and
        # the optimizer's hyperparameters (12 items of 1.3 kB) and the int64 buffer's chunk
        # (read whole: the reader copies that dtype as stored) besides.
        assert r["share"] > 0 and r["read"] <= 1.1 * r["share"] + 20 * 1024, r
    assert sum(r["read"] for r in ranks) >= sum(r["share"] for r in ranks) * 0.9


# ---- hostile indexes and items (one process) ---------------------------------------------------

def _last_embed_chunk_elsewhere(saved, tmp_path):
    """A copy of the saved checkpoint whose index points the embedding's last chunk (read by the
    last loading rank alone) at another tensor's archive; its path."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    path = str(tmp_path / "ck")
    shutil.copytree(saved, path)
    md = _metadata(path)
    chunks = md.state_dict_metadata["model.embed.weight"].chunks
    last = max(chunks, key=lambda c: c.offsets[0])
    entry = md.storage_data[MetadataIndex("model.embed.weight", last.offsets)]
    other = md.storage_data[MetadataIndex("model.head.weight", torch.Size([0, 0]))]
    entry.relative_path, entry.offset, entry.length = (other.relative_path, other.offset,
                                                       other.length)
    _rewrite(path, md)
    return path


def test_a_part_only_one_rank_reads_refuses_the_load_on_every_rank(saved, tmp_path):
    """The embedding's last saved chunk (only the last rank of 2 reads it) points at another
    tensor's archive: that rank's checks refuse it, and the agreement in read_data has the other
    rank refuse too, before either wrote anything."""
    path = _last_embed_chunk_elsewhere(saved, tmp_path)
    ranks = run(2, {"what": "broken_load", "path": path}, str(tmp_path))
    assert all(r["unchanged"] for r in ranks), ranks
    assert "the index says" in ranks[1]["error"], ranks[1]
    assert "rank 1 refused its part of the load" in ranks[0]["error"], ranks[0]


def test_a_refused_part_refuses_the_load_on_a_group_of_fewer_ranks_than_the_job(saved,
                                                                                tmp_path):
    """The same broken checkpoint loaded by 2 of 3 ranks (dcp.load given their group): the
    loading ranks agree among themselves (a group of their own, made by them alone), so the
    rank whose part is fine refuses too and neither wrote anything; the third rank is not
    involved."""
    path = _last_embed_chunk_elsewhere(saved, tmp_path)
    ranks = run(3, {"what": "broken_load", "path": path, "mesh_ranks": [1, 2]}, str(tmp_path))
    assert ranks[0] == {}, ranks
    assert all(r["unchanged"] for r in ranks[1:]), ranks
    assert "the index says" in ranks[2]["error"], ranks[2]
    assert "rank 2 refused its part of the load" in ranks[1]["error"], ranks[1]


def test_saved_without_collectives_loads_as_dcps_own_reader_does(tmp_path):
    """dcp.save(..., use_collectives=False): no global .metadata, each rank's own
    __<rank>.metadata listing what it saved; DCP's load falls back to it, with either reader."""
    path = str(tmp_path / "ck")
    run(2, {"what": "save", "path": path, "no_collectives": True}, str(tmp_path))
    names = sorted(os.listdir(path))
    assert ".metadata" not in names and "__0.metadata" in names and "__1.metadata" in names
    for r in run(2, {"what": "load", "path": path}, str(tmp_path)):
        assert r["share"] > 0 and r["read"] <= 1.1 * r["share"] + 20 * 1024, r
    from zeroflat import _C

    assert _C.DcpCheckpoint(path, "__1.metadata").items()
    for bad in ("../ck/__0.metadata", "__x.metadata", "__.metadata", "x.metadata"):
        with pytest.raises(ValueError, match="a DCP index is"):
            _C.DcpCheckpoint(path, bad)
    # inspect reads a global index: it says what the folder is and how to load it.
    r = _cli("inspect", path, "--json")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = json.loads(r.stdout)
    assert "saved without collectives" in err["error"] and "zeroflat.dcp.Reader" in err["error"]


@pytest.fixture()
def single(tmp_path):
    """A DCP checkpoint saved by one process, and a function that loads it through the Reader
    into a fresh model, checking the model is unchanged when the load fails."""
    import warnings

    torch.manual_seed(3)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, VOCAB, (2, 3))).backward()
    opt.step()
    path = str(tmp_path / "ck")
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    return path


def _load_single(path):
    import warnings

    import zeroflat.dcp

    torch.manual_seed(4)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    msd, osd = get_state_dict(model, opt)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({"model": msd, "optim": osd}, storage_reader=zeroflat.dcp.Reader(path),
                     no_dist=True)
    except BaseException:  # DCP's CheckpointException is one
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
        raise
    return model


def _metadata(path):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own file: trusted here


def _rewrite(path, md):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


class Payload:
    """Unpickled, runs `touch MARKER` (what a hostile checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_single_process_checkpoint_loads_as_saved(single):
    from zeroflat import _C

    model = _load_single(single)
    ref = Net()
    ck = _C.DcpCheckpoint(single)
    assert ck.version and len(ck.files) == 1
    torch.manual_seed(3)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref(torch.randint(0, VOCAB, (2, 3))).backward()
    opt.step()
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.parametrize("where", ["storage_meta", "planner_data", "a chunk's sizes"])
def test_an_index_naming_code_is_refused_and_nothing_runs(single, tmp_path, where):
    from zeroflat import _C

    marker = tmp_path / "ran"
    md = _metadata(single)
    payload = Payload(marker)
    if where == "storage_meta":
        md.storage_meta.modules = [payload]
    elif where == "planner_data":
        md.planner_data["model.embed.weight"] = ("model", payload)
    else:
        md.state_dict_metadata["model.embed.weight"].chunks[0].sizes = payload
    _rewrite(single, md)
    for attempt in (lambda: _C.DcpCheckpoint(single), lambda: _load_single(single)):
        with pytest.raises(BaseException, match=r"posix system.*not on the allow-list"):
            attempt()
    assert not marker.exists()


def test_a_global_of_torch_save_files_is_refused_in_an_index(single):
    from collections import OrderedDict

    from zeroflat import _C

    md = _metadata(single)
    md.storage_meta.modules = [OrderedDict(a=1)]
    _rewrite(single, md)
    with pytest.raises(BaseException, match=r"collections OrderedDict' is allowed in torch.save files "
                                        r"and DCP values only, not in DCP .metadata"):
        _C.DcpCheckpoint(single)


def _value_is(path, value):
    """The checkpoint's optimizer lr item re-pointed to a torch.save of ``{"lr": value}`` in a
    file of its own."""
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex

    buf = io.BytesIO()
    torch.save({"lr": value}, buf)
    with open(os.path.join(path, "extra.distcp"), "wb") as f:
        f.write(buf.getvalue())
    md = _metadata(path)
    info = md.storage_data[MetadataIndex("optim.param_groups.0.lr")]
    info.relative_path, info.offset, info.length = "extra.distcp", 0, len(buf.getvalue())
    _rewrite(path, md)


def test_a_value_naming_code_is_refused_before_anything_is_written(single, tmp_path):
    marker = tmp_path / "ran"
    _value_is(single, Payload(marker))
    with pytest.raises(BaseException, match=r"posix system.*not on the allow-list"):
        _load_single(single)
    assert not marker.exists()


def test_a_value_naming_deepspeeds_classes_is_refused_in_a_dcp_file(single, tmp_path):
    """DeepSpeed's rows of the allow-list are its checkpoints' only: a DCP bytes item holding a
    LossScaler is refused, nothing of DeepSpeed imported or made, the model unchanged; an
    object's saved attributes may not name Python's own machinery (__getattr__, __reduce_ex__,
    ...), in any file."""
    import subprocess

    from zeroflat import _C

    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    _value_is(single, loss_scaler.LossScaler(1.0))
    with pytest.raises(BaseException, match=r"LossScaler' is allowed in torch\.save files only, "
                                            r"not in DCP values"):
        _load_single(single)
    # In a fresh process: the refusal imports nothing of DeepSpeed.
    code = ("import sys, zeroflat._C as C\n"
            f"ck = C.DcpCheckpoint({single!r})\n"
            "try:\n    ck.value('optim.param_groups.0.lr')\nexcept Exception as e:\n"
            "    print('refused', 'LossScaler' in str(e))\n"
            "print('deepspeed' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["refused", "True", "False"], (r.stdout, r.stderr[-2000:])
    scaler = loss_scaler.LossScaler(1.0)
    scaler.__dict__["__getattr__"] = 5
    path = tmp_path / "scaler.pt"
    torch.save({"loss_scaler": scaler}, path)
    with pytest.raises(BaseException, match=r"sets '__getattr__', a name of Python's own"):
        _C.TorchFile(str(path))


@pytest.mark.parametrize("case", ["outside", "past_end", "dtype", "shape", "missing_entry",
                                  "compressed", "layout", "gap", "overlap"])
def test_a_lying_index_is_refused_naming_the_item(single, case):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = _metadata(single)
    key = MetadataIndex("model.head.weight", torch.Size([0, 0]))
    info = md.storage_data[key]
    want = {
        "outside": r"'\.\./ck/x' is not a plain file name",
        "past_end": r"past the end of the file",
        "dtype": r"is fp32; the index says bfloat16",
        "shape": r"has shape \[40, 40\]; the index says \[5, 40\]",
        "missing_entry": r"no entry for 'model.head.weight' at \[0, 0\]",
        "compressed": r"stream transforms",
        "layout": r"_get_layout\('torch.sparse_coo'\): only 'torch.strided' is read",
        "gap": r"'model.head.weight': its chunks hold 60 of its 200 elements: a chunk is missing",
        "overlap": r"'model.head.weight': its chunks at offsets \[0, 0\] and \[2, 0\] overlap",
    }[case]
    item = md.state_dict_metadata["model.head.weight"]
    if case == "outside":
        info.relative_path = "../ck/x"
    elif case == "past_end":
        info.length += 10 ** 9
    elif case == "dtype":
        md.state_dict_metadata["model.head.weight"].properties.dtype = torch.bfloat16
    elif case == "shape":  # the chunk's entry names another tensor's archive
        other = md.storage_data[MetadataIndex("model.layers.0.0.weight", torch.Size([0, 0]))]
        info.relative_path, info.offset, info.length = (other.relative_path, other.offset,
                                                        other.length)
    elif case == "gap":  # rows the index leaves to no chunk would keep the values they had
        item.chunks[0].sizes = torch.Size([5, 12])
    elif case == "overlap":  # a chunk placed over another's rows
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        item.chunks.append(ChunkStorageMetadata(offsets=torch.Size([2, 0]),
                                                sizes=torch.Size([1, 40])))
    elif case == "missing_entry":
        del md.storage_data[key]
    elif case == "layout":
        md.state_dict_metadata["model.head.weight"].properties.layout = torch.sparse_coo
    else:
        info.transform_descriptors = ["zstd"]
    _rewrite(single, md)
    with pytest.raises(BaseException, match=want):
        _load_single(single)


def test_a_truncated_data_file_is_refused(single):
    data = [n for n in os.listdir(single) if n.endswith(".distcp")][0]
    p = os.path.join(single, data)
    os.truncate(p, os.path.getsize(p) // 2)
    with pytest.raises(BaseException, match=r"past the end of the file"):
        _load_single(single)


def test_an_index_that_is_not_a_regular_file_is_refused_by_name(single):
    """A FIFO in place of .metadata: refused naming it, never read (nor waited on), not taken
    for a folder of safetensors files."""
    index = os.path.join(single, ".metadata")
    os.remove(index)
    os.mkfifo(index)
    with pytest.raises(BaseException, match=r"\.metadata") as e:
        _load_single(single)
    assert "no .safetensors files" not in str(e.value)


def test_a_row_of_dcps_index_is_refused_in_a_torch_save_file(tmp_path):
    """The allow-list's rows say where they may be named: DCP's classes in a torch.save file
    (a DeepSpeed checkpoint, a DCP item) are refused as off the list there."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from zeroflat import _C

    path = tmp_path / "x.pt"
    torch.save({"chunk": ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))},
               path)
    with pytest.raises(BaseException, match=r"ChunkStorageMetadata' is allowed in DCP "
                                            r"\.metadata only, not in torch\.save files"):
        _C.TorchFile(str(path))
    rows = {(m, n): where for m, n, _, _, _, where in _C.allowed_globals()}
    assert rows[("torch.distributed.checkpoint.metadata", "Metadata")] == "DCP .metadata"
    assert rows[("torch._utils", "_rebuild_tensor_v2")] == "torch.save files and DCP values"
    assert rows[("torch", "Size")] == "torch.save files, DCP .metadata and DCP values"
    # DeepSpeed's classes: its checkpoints only (one allow-list per format).
    assert rows[("deepspeed.runtime.fp16.loss_scaler", "LossScaler")] == "torch.save files"


def _cli(*args):
    import subprocess

    from test_torch_file import cli_path

    return subprocess.run([str(cli_path()), *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_zeroflat_inspect_lists_a_dcp_folder_and_refuses_a_hostile_one(single, tmp_path):
    from zeroflat import _C

    r = _cli("inspect", single, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    items = _C.DcpCheckpoint(single).items()
    assert doc["source"] == "dcp" and doc["tensors"] + doc["values"] == len(items)
    assert doc["values"] == sum(1 for it in items if it[1])
    assert doc["largest"][0]["name"] == "model.embed.weight"  # the vocabulary's rows
    assert doc["bytes"] == sum(v.numel() * v.element_size() for v in _flat_tensors(single))
    marker = tmp_path / "ran"
    md = _metadata(single)
    md.storage_meta.modules = [Payload(marker)]
    _rewrite(single, md)
    r = _cli("inspect", single, "--json")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = json.loads(r.stdout)
    assert err["error_kind"] == "invalid input" and "posix system" in err["error"], err
    assert not marker.exists()


def _flat_tensors(path):
    """Every tensor DCP's own reader loads from the folder (this test's own file: trusted)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(path).read_metadata()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = []
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            out.append(torch.empty(m.size, dtype=m.properties.dtype))
    return out


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_pieces")
    path = root / "hf"
    run(3, {"what": "hf_save", "path": str(path)}, str(root))
    files = sorted(os.listdir(path))
    assert len(files) == 3 and "model.safetensors.index.json" not in files, files
    return path


def test_hf_folders_dcp_saved_in_pieces_load_at_another_world(pieces, tmp_path):
    """DCP's HuggingFaceStorageWriter(save_distributed=True) without consolidation, at 3
    ranks, read at 2: equal to DCP's own HF reader on every rank, each reading its share (the
    int64 tensor's pieces are read whole, as stored: at most its 9 elements more)."""
    for r in run(2, {"what": "hf_load", "path": str(pieces)}, str(tmp_path)):
        assert r["error"] is None and r["equal"], r
        assert 0 < r["read"] <= r["share"] + 9 * 8, r


def test_a_file_replaced_after_its_header_was_read_refuses_the_load_on_every_rank(pieces,
                                                                                  tmp_path):
    """Each rank reads its own copy of the folder; the last rank's files are replaced after its
    reader read their headers: that rank refuses before the ranks agree, so the other refuses
    too, and neither wrote anything."""
    ranks = run(2, {"what": "hf_load", "path": str(pieces), "broken": True, "replaced": True},
                str(tmp_path))
    assert all(r["error"] and r["unchanged"] for r in ranks), ranks
    assert "replaced since it was opened" in ranks[1]["error"], ranks[1]
    assert "rank 1 refused its part of the load" in ranks[0]["error"], ranks[0]


def test_hf_folders_dcp_saved_in_pieces_one_rank_and_a_missing_part(pieces, tmp_path):
    """Read at one rank (every piece of every tensor), equal to DCP's own reader; then with one
    rank's file gone: refused naming the tensor whose pieces no longer tile it, nothing
    written (DCP's own reader would leave those rows as they were)."""
    from zeroflat import _C

    (r,) = run(1, {"what": "hf_load", "path": str(pieces)}, str(tmp_path))
    assert r["error"] is None and r["equal"], r
    assert r["read"] == r["share"], r
    broken = tmp_path / "broken"
    shutil.copytree(pieces, broken)
    os.remove(broken / sorted(os.listdir(broken))[1])
    (r,) = run(1, {"what": "hf_load", "path": str(broken), "broken": True}, str(tmp_path))
    assert r["error"] and "a rank's part of the folder missing?" in r["error"], r
    assert r["unchanged"], r
    # A whole-tensor reader (the FSDP2, ZeRO and inspect loads) refuses the folder, naming
    # both ways to read it.
    with pytest.raises(ValueError, match="consolidate the folder first.*zeroflat.dcp.Reader"):
        _C.Checkpoint(str(pieces))


def test_read_metadata_is_dcps_own_but_for_what_nothing_runs_for(tmp_path):
    """read_metadata gives what FileSystemReader gives: every item, every storage record (the
    file, offset and length of each saved item, keyed as the save keyed it, the chunk's index
    too), the save's storage_meta (save_id, modules) with this reader's own load_id, made at
    construction and again at each reset; checkpoint_id is the path. The one difference on
    purpose: a checkpoint_id saved as a path comes back as its text."""
    from torch.distributed.checkpoint import FileSystemReader

    import zeroflat.dcp

    path = str(tmp_path / "ck")
    dcp.save({"w": torch.randn(8, 4), "b": torch.randn(3).bfloat16(), "step": 3},
             checkpoint_id=path)
    theirs = FileSystemReader(path).read_metadata()
    reader = zeroflat.dcp.Reader(path)
    first = reader.load_id
    ours = reader.read_metadata()

    def keyed(md):
        return {(k.fqn, None if k.offset is None else tuple(k.offset), k.index): v
                for k, v in md.storage_data.items()}
    assert keyed(ours) == keyed(theirs)
    assert ours.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    assert ours.storage_meta.save_id == theirs.storage_meta.save_id is not None
    assert ours.storage_meta.modules == theirs.storage_meta.modules
    assert str(ours.storage_meta.checkpoint_id) == str(theirs.storage_meta.checkpoint_id)
    assert ours.storage_meta.load_id == first and first
    reader.reset()
    assert reader.load_id != first and reader.read_metadata().storage_meta.load_id == reader.load_id
    assert reader.checkpoint_id == path
    # The reader DCP constructs under install() shows one load id: the metadata zeroflat read
    # carries it (PyTorch's test_compatibility checks this of FileSystemReader), after a reset
    # too.
    with zeroflat.dcp.installed():
        from torch.distributed.checkpoint import FileSystemReader as Installed

        installed = Installed(path)
        assert installed.read_metadata().storage_meta.load_id == installed.load_id
        before = installed.load_id
        installed.reset()
        assert installed.load_id != before
        assert installed.read_metadata().storage_meta.load_id == installed.load_id


def test_an_index_of_older_torch_naming_sharded_tensors_tensor_properties_loads(single):
    """Indexes saved by torch releases before DCP had its own TensorProperties name the one of
    torch.distributed._shard.sharded_tensor.metadata (and its MEM_FORMAT_ENCODING): read as
    DCP's own reader reads them (its compatibility test loads such a checkpoint)."""
    from torch.distributed._shard.sharded_tensor import metadata as old
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _metadata(single)
    for item in md.state_dict_metadata.values():
        if isinstance(item, TensorStorageMetadata):
            p = item.properties
            item.properties = old.TensorProperties(dtype=p.dtype, layout=p.layout,
                                                   requires_grad=p.requires_grad,
                                                   memory_format=p.memory_format,
                                                   pin_memory=p.pin_memory)
    _rewrite(single, md)
    with open(os.path.join(single, ".metadata"), "rb") as f:
        assert b"sharded_tensor.metadata" in f.read()
    ours = _load_single(single)
    torch.manual_seed(4)
    theirs = Net()
    msd, osd = get_state_dict(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2))
    dcp.load({"model": msd, "optim": osd}, storage_reader=dcp.FileSystemReader(single),
             no_dist=True)
    for (n, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), n


def test_a_large_index_as_dcp_writes_it_reads_as_dcps_own(tmp_path):
    """An index of 230,000 chunks, made of the dataclasses dcp.save writes and pickled as it
    pickles them (above the 218,545 chunks a reader of 4 million pickle values refused; a 405B
    model saved with AdamW at 1,024 ranks makes 3.5 million): read_metadata gives what DCP's
    own unpickling gives, chunk for chunk."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)
    from zeroflat.dcp import Reader

    tensors, per, storage = 2, 115_000, {}
    items = {}
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        chunks = []
        for r in range(per):
            off, size = torch.Size([r, 0]), torch.Size([1, 8])
            chunks.append(ChunkStorageMetadata(offsets=off, sizes=size))
            storage[MetadataIndex(fqn=fqn, offset=off, index=r)] = _StorageInfo(
                relative_path=f"__{r % 64}_0.distcp", offset=(t * per + r) * 4096, length=4096)
        items[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32),
                                           size=torch.Size([per, 8]), chunks=chunks)
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=items, storage_data=storage), f)
    for r in range(64):
        with open(tmp_path / f"__{r}_0.distcp", "wb") as f:
            f.truncate(tensors * per * 4096)
    ours = Reader(tmp_path).read_metadata()
    with open(tmp_path / ".metadata", "rb") as f:
        theirs = pickle.load(f)
    assert sum(len(v.chunks) for v in ours.state_dict_metadata.values()) == tensors * per
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ([k.index for k in ours.storage_data][-3:] ==
            [k.index for k in theirs.storage_data][-3:] == [per - 3, per - 2, per - 1])


def test_zeroflats_writer_saves_what_dcps_writer_saves_and_both_readers_read_it_at_another_world(
        tmp_path):
    """FSDP2 model and AdamW state saved at 4 ranks by DCP's FileSystemWriter and by
    zeroflat.dcp.Writer under dcp.save (over an older checkpoint of that name) and
    dcp.async_save, read at 2 ranks by DCP's reader and zeroflat's: the same values. One file
    per rank, no partial folder left, and .metadata read by zeroflat's restricted reader
    (nothing in it runs)."""
    import zeroflat.dcp

    path, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    async_path = str(tmp_path / "ours_async")
    installed_path = str(tmp_path / "installed")
    os.makedirs(path)
    with open(os.path.join(path, "stale.distcp"), "wb") as f:  # an older checkpoint's file
        f.write(b"old")
    saved = run(4, {"what": "save_both", "path": path, "dcp_path": theirs,
                    "async_path": async_path, "installed_path": installed_path},
                str(tmp_path))
    assert [r["served"] for r in saved] == [1] * 4
    for p in (path, async_path, installed_path):
        assert sorted(os.listdir(p)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
        md = zeroflat.dcp.Reader(p).read_metadata()
        assert md.storage_meta.checkpoint_id == p
        assert {type(v).__name__ for v in md.storage_data.values()} == {"_StorageInfo"}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".zeroflat-")]
    ranks = run(2, {"what": "load_both", "path": path, "dcp_path": theirs,
                    "async_path": async_path, "installed_path": installed_path},
                str(tmp_path))
    assert ranks[0]["tensors"] > 10


def test_a_failed_publication_of_zeroflats_writer_leaves_the_checkpoint_before(tmp_path):
    """A save over an existing checkpoint that fails as it makes the new one visible (an I/O
    error injected at the exchange): the old folder is there, whole, and loads."""
    import zeroflat.dcp
    from zeroflat import _C

    path = str(tmp_path / "ck")
    first = {"w": torch.arange(12.0).reshape(3, 4), "n": 7}
    dcp.save(first, storage_writer=zeroflat.dcp.Writer(path))  # one process: no process group
    before = sorted(os.listdir(path))
    for step in ("sync_tree", "publish.exchange", "publish.fsync"):
        _C.set_save_fault_for_testing(f"{step}:eio")
        try:
            with pytest.raises(dcp.api.CheckpointException, match="injected"):  # DCP wraps it
                dcp.save({"w": torch.zeros(3, 4), "n": 8}, storage_writer=zeroflat.dcp.Writer(path))
        finally:
            _C.set_save_fault_for_testing(None)
        got = {"w": torch.empty(3, 4), "n": 0}
        dcp.load(got, storage_reader=dcp.FileSystemReader(path))
        if step == "publish.fsync":  # the exchange happened: the new one, whole
            assert torch.equal(got["w"], torch.zeros(3, 4)) and got["n"] == 8, step
            dcp.save(first, storage_writer=zeroflat.dcp.Writer(path))
        else:
            assert torch.equal(got["w"], first["w"]) and got["n"] == 7, step
        assert sorted(os.listdir(path)) == before, step


def test_the_installed_writer_publishes_keeps_the_folders_other_files_and_hands_back(tmp_path):
    """install(writer=True): the FileSystemWriter that dcp.save makes (and one made by hand) is
    zeroflat's: the checkpoint published from a partial folder, the folder's other files (a
    config, a subfolder, an older save's shard) kept as DCP's writer keeps them, a failed
    publication leaving the checkpoint before; what Writer does not serve (several files per
    rank, overwrite=False) is DCP's own, counted; uninstall() puts DCP's writer back."""
    import zeroflat.dcp
    from torch.distributed.checkpoint import filesystem
    from zeroflat import _C

    own = filesystem.FileSystemWriter
    path = tmp_path / "ck"
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "sub" / "notes.txt").write_text("kept")
    (path / "__7_0.distcp").write_bytes(b"an older save's shard")
    first = {"w": torch.arange(12.0).reshape(3, 4), "n": 7}
    before = dict(zeroflat.dcp.stats)
    with zeroflat.dcp.installed(writer=True):
        assert dcp.FileSystemWriter is not own and issubclass(dcp.FileSystemWriter, own)
        dcp.save(first, checkpoint_id=str(path))
        assert zeroflat.dcp.stats["saves_served"] == before["saves_served"] + 1
        assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__7_0.distcp",
                                            "config.json", "sub"]
        assert (path / "sub" / "notes.txt").read_text() == "kept"
        _C.finish_removals()  # the folder it replaced goes in the library's thread
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".zeroflat-")]
        got = {"w": torch.empty(3, 4), "n": 0}
        dcp.load(got, storage_reader=zeroflat.dcp.Reader(str(path)))
        assert torch.equal(got["w"], first["w"]) and got["n"] == 7

        _C.set_save_fault_for_testing("publish.exchange:eio")
        try:
            with pytest.raises(dcp.api.CheckpointException, match="injected"):
                dcp.save({"w": torch.zeros(3, 4), "n": 8}, checkpoint_id=str(path))
        finally:
            _C.set_save_fault_for_testing(None)
        got = {"w": torch.empty(3, 4), "n": 0}
        dcp.load(got, storage_reader=dcp.FileSystemReader(str(path)))
        assert torch.equal(got["w"], first["w"]) and got["n"] == 7
        assert (path / "config.json").exists()

        many = dcp.FileSystemWriter(str(tmp_path / "many"), single_file_per_rank=False)
        dcp.save(first, storage_writer=many)
        assert zeroflat.dcp.stats["saves_handed_back"] == before["saves_handed_back"] + 1
        assert "single_file_per_rank=False" in zeroflat.dcp.stats["saves_handed_back_reasons"][-1]
        with pytest.raises(dcp.api.CheckpointException, match="already exists"):
            dcp.save(first, storage_writer=dcp.FileSystemWriter(str(path), overwrite=False))
        assert zeroflat.dcp.stats["saves_handed_back"] == before["saves_handed_back"] + 2
    assert dcp.FileSystemWriter is own and filesystem.FileSystemWriter is own
    got = {"w": torch.empty(3, 4), "n": 0}
    dcp.load(got, checkpoint_id=str(tmp_path / "many"))
    assert torch.equal(got["w"], first["w"]) and got["n"] == 7


def test_async_saves_staging_is_reused_never_while_a_save_writes_from_it_and_is_a_true_copy(
        tmp_path):
    """Writer.stage (async_save's stager): the copy holds the state as it was at the call (later
    changes to the state do not reach it), nested values included; the next save of a state of
    the same shapes reuses its memory once the save written from it is done, never before; a
    state of other shapes gets new memory. Two async_saves in a row load back as each was."""
    import zeroflat.dcp
    from zeroflat import _dcp_writer

    def state(v):
        return {"a": torch.full((64, 33), float(v)), "nest": {"b": torch.arange(7) + v,
                                                              "lr": [0.1 * v, "x"]}, "n": v}

    first = state(1)
    staged = _dcp_writer.stage(first)
    first["a"].fill_(-1)
    first["nest"]["lr"][1] = "changed"
    assert torch.equal(staged["a"], torch.full((64, 33), 1.0)) and staged["nest"]["lr"] == [0.1, "x"]
    again = _dcp_writer.stage(state(2))  # the first is still being written from: new memory
    assert again["a"].data_ptr() != staged["a"].data_ptr()
    _dcp_writer._staging_free(staged)
    third = _dcp_writer.stage(state(3))
    assert third["a"].data_ptr() == staged["a"].data_ptr() and torch.equal(
        third["nest"]["b"], torch.arange(7) + 3)
    _dcp_writer._staging_free(third)
    other = _dcp_writer.stage({"a": torch.zeros(5)})
    assert other["a"].data_ptr() != staged["a"].data_ptr()
    _dcp_writer._staging_free(other)

    for v in (4, 5):
        path = str(tmp_path / f"ck{v}")
        dcp.async_save(state(v), storage_writer=zeroflat.dcp.Writer(path)).result()
        got = state(0)
        dcp.load(got, storage_reader=dcp.FileSystemReader(path))
        assert torch.equal(got["a"], torch.full((64, 33), float(v))) and got["n"] == v
        assert not _dcp_writer._staging["busy"]  # freed by the save's write


def test_async_saves_staging_is_one_mapping_outside_the_heap_each_tensor_its_own_storage():
    """Writer.stage's host copy: every tensor carved out of one anonymous mapping (not the C
    library's heap, where the staging would sit among the training's short-lived allocations),
    each with a storage of exactly its own bytes (as torch.save writes it), none overlapping,
    the values those of the state, 0-dim, empty, bool and bfloat16 tensors included."""
    from zeroflat import _dcp_writer

    state = {f"w{i}": torch.randn(64 + i, 1024 + 3 * i) for i in range(5)}
    state.update(half=torch.randn(333, 7).to(torch.bfloat16), flags=torch.rand(17) > 0.5,
                 scalar=torch.tensor(2.5), empty=torch.empty(0, 4), step=3)
    staged = _dcp_writer.stage(state)
    try:
        assert staged["step"] == 3
        spans = []
        for key, t in state.items():
            if not isinstance(t, torch.Tensor):
                continue
            got = staged[key]
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), key
            if t.numel():
                n = t.numel() * t.element_size()
                assert got.untyped_storage().nbytes() == n, key
                spans.append((got.data_ptr(), got.data_ptr() + n))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "staged tensors overlap"
        maps = []
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                maps.append((lo, hi, line.split()[-1] if len(line.split()) > 5 else ""))
        holding = {next((m for m in maps if m[0] <= a and b <= m[1]), None) for a, b in spans}
        assert len(holding) == 1 and None not in holding, holding
        assert next(iter(holding))[2] != "[heap]"
    finally:
        _dcp_writer._staging_free(staged)


def test_zeroflats_writer_writes_a_views_bytes_not_its_whole_storage(tmp_path):
    """A tensor that is a view into a larger storage (a slice of a flat buffer) is written as its
    own bytes, as DCP's writer writes it: the rank's file holds about the view's size, and it
    loads back equal."""
    import zeroflat.dcp

    flat = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    view = flat[1000:1256].view(16, 16)
    path = str(tmp_path / "ck")
    dcp.save({"v": view}, storage_writer=zeroflat.dcp.Writer(path))
    assert os.path.getsize(os.path.join(path, "__0_0.distcp")) < 64 << 10
    got = {"v": torch.empty(16, 16)}
    dcp.load(got, storage_reader=zeroflat.dcp.Reader(path))
    assert torch.equal(got["v"], view)


def test_zeroflats_writer_starts_large_items_at_a_page_and_both_readers_load_them(tmp_path):
    """Under dcp.save and async_save (staged), an item holding a tensor of 1 MiB and more starts
    at a page of the rank's file (its storage's pages written with O_DIRECT where the file system
    takes it), the gaps before such items outside every item; DCP's own reader and zeroflat's
    load every tensor equal, small ones between large ones included."""
    import zeroflat.dcp
    from zeroflat import _dcp_writer

    def state(v):
        return {"big": torch.randn(700, 1024, generator=torch.Generator().manual_seed(v)),
                "odd": torch.arange(300001, dtype=torch.float64) + v,
                "small": torch.full((5, 3), float(v)),
                "half": torch.randn(1024, 600, generator=torch.Generator().manual_seed(v)).half(),
                "n": v}

    for v, save in ((1, dcp.save), (2, dcp.async_save)):
        path = str(tmp_path / f"ck{v}")
        out = save(state(v), storage_writer=zeroflat.dcp.Writer(path))
        if save is dcp.async_save:
            out.result()
            assert not _dcp_writer._staging["busy"]
        meta = dcp.FileSystemReader(path).read_metadata()
        large = {k for k, t in state(v).items() if isinstance(t, torch.Tensor)
                 and t.numel() * t.element_size() >= 1 << 20}
        spans = sorted((info.offset, info.offset + info.length, index.fqn)
                       for index, info in meta.storage_data.items())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert {fqn for begin, _, fqn in spans if begin % 4096 == 0} >= large
        for reader in (dcp.FileSystemReader(path), zeroflat.dcp.Reader(path)):
            got = state(0)
            dcp.load(got, storage_reader=reader)
            want = state(v)
            assert all(torch.equal(got[k], want[k]) for k in ("big", "odd", "small", "half"))
            assert got["n"] == v


def test_each_item_of_zeroflats_writer_is_an_archive_torch_load_reads_safely(tmp_path):
    """The library writes the rank's file (not torch.save): every tensor item's slice of it, as
    .metadata places it, is an archive that torch.load(weights_only=True) reads back equal,
    whatever the tensor (bf16, a transposed one, 0-d, empty, bool, int64, one past 64 KiB that is
    written from where it is), and a bytes item is its bytes; DCP's own reader loads the whole
    folder equal too."""
    import io as _io
    import zeroflat.dcp
    from torch.distributed.checkpoint import FileSystemReader

    big = torch.randn(300, 257)  # 308 KiB: written from the tensor, not through the buffer
    state = {
        "bf16": torch.randn(33, 7).to(torch.bfloat16),
        "t": torch.arange(60, dtype=torch.float32).view(6, 10).t(),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "mask": torch.rand(17) > 0.5,
        "step": torch.tensor([2 ** 40 + 3], dtype=torch.int64),
        "big": big,
        "lr": 0.25,  # bytes items: torch.save's of the values, as DCP's planner makes them
        "name": "x",
    }
    path = str(tmp_path / "ck")
    dcp.save(state, storage_writer=zeroflat.dcp.Writer(path))
    md = zeroflat.dcp.Reader(path).read_metadata()
    with open(os.path.join(path, "__0_0.distcp"), "rb") as f:
        blob = f.read()
    seen = set()
    ends = []
    for index, info in md.storage_data.items():
        piece = blob[info.offset:info.offset + info.length]
        ends.append((info.offset, info.offset + info.length))
        if not torch.is_tensor(state[index.fqn]):
            assert torch.load(_io.BytesIO(piece), weights_only=True) == state[index.fqn]
        else:
            got = torch.load(_io.BytesIO(piece), weights_only=True)
            want = state[index.fqn]
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want), index.fqn
        seen.add(index.fqn)
    assert seen == set(state)
    ends.sort()
    assert ends[0][0] == 0 and ends[-1][1] == len(blob)  # the items fill the file, in a row
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    got = {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in state.items()}
    dcp.load(got, storage_reader=FileSystemReader(path))
    for k, v in state.items():
        assert torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v, k


def test_async_saves_staging_is_reused_under_the_process_executor(tmp_path):
    """Under async_save's process executor the write runs in DCP's checkpoint process, where
    write_data cannot free this process's staging: the staging is free again once DCP lets the
    staged state go, so that three saves in a row at 2 ranks make it once and reuse it, and each
    folder loads as saved."""
    ranks = run(2, {"what": "process_saves", "path": str(tmp_path / "ck")}, str(tmp_path))
    for r in ranks:
        assert r["loaded"] == [True, True, True]
        assert r["staged_at"] == [True, True, True]


def test_the_writers_priority_is_one_of_three_and_each_writes_the_same_folder(tmp_path):
    """Writer(priority=...): "idle", "low" and "normal" each write a folder that loads as saved;
    anything else is refused before anything is written, naming the choices; so is
    zeroflat.deepspeed.install(save_priority=...)'s, and a save_staging_bytes that is not a
    number of bytes."""
    import zeroflat.dcp
    import zeroflat.deepspeed

    state = {"w": torch.randn(64, 64), "n": 3}
    for p in ("idle", "low", "normal"):
        path = str(tmp_path / p)
        dcp.save(state, storage_writer=zeroflat.dcp.Writer(path, priority=p))
        got = {"w": torch.zeros(64, 64), "n": 0}
        dcp.load(got, storage_reader=dcp.FileSystemReader(path))
        assert torch.equal(got["w"], state["w"]) and got["n"] == 3
    for bad in ("high", 10, None):
        with pytest.raises(ValueError, match="idle, low, normal"):
            zeroflat.dcp.Writer(str(tmp_path / "bad"), priority=bad)
        with pytest.raises(ValueError, match="idle, low, normal"):
            zeroflat.deepspeed.install(save_priority=bad)
    for bad in (-1, 1.5, "1G", True):
        with pytest.raises(ValueError, match="save_staging_bytes"):
            zeroflat.deepspeed.install(save_staging_bytes=bad)
    assert not os.path.exists(tmp_path / "bad")


def test_importing_the_reader_leaves_the_save_and_the_patches_out():
    """``import zeroflat.dcp`` is what a load's first call pays: the reader alone. The writer
    and the patch table come in where they are first used (``zeroflat.dcp.Writer``,
    ``install()``), and ``Writer`` is still the module's name for the writer."""
    import subprocess

    code = ("import sys, zeroflat.dcp as d\n"
            "print(sorted(m for m in ('zeroflat._dcp_writer', 'zeroflat._patches', "
            "'zeroflat._snapshot') if m in sys.modules))\n"
            "print(d.Writer.__module__, 'Writer' in dir(d), 'Writer' in d.__all__)\n"
            "d.install(); print('zeroflat._patches' in sys.modules); d.uninstall()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split("\n")[:3] == ["[]", "zeroflat._dcp_writer True True", "True"], \
        (r.stdout, r.stderr[-2000:])
