"""zeroflat.fsdp.load against the references, on FSDP2 models (CPU, gloo): every rank's local
shards equal those of the full model loaded by Transformers and then sharded by fully_shard the
same way, and those of Transformers 5's own from_pretrained(distributed_config=...), bit for
bit, for a dense model with tied embeddings, an untied one, and a Qwen3-MoE
(stacked experts), bf16 and fp32 checkpoints into bf16 and fp32 models, at 1, 2, 3 and 4 ranks
on 1-D meshes and 2 x 2 HSDP; the next 3 training steps' losses identical; each rank reads its
shards' bytes and no more; bad input (a tensor missing or of another shape, a checkpoint cut
short, a model not sharded, ranks whose meshes differ) refused on every rank with every model as
it was; a rank that dies midway named by the others, their models as they were.

Run as a script, it is one rank's worker (the tests start them)."""

import json
import os
import shutil
import sys
import tempfile
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from reference import end_rank, start_ranks  # noqa: E402
from test_hf import write  # noqa: E402 - a checkpoint saved by Transformers, in small shards


def tiny_dense(tie=True):
    from transformers import Qwen3Config

    # A vocabulary far larger than the rest, as in real models (the embedding dominates).
    return Qwen3Config(vocab_size=3001, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                       tie_word_embeddings=tie)


def tiny_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=301, hidden_size=48, intermediate_size=96,
                          moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=12, num_experts=5,
                          num_experts_per_tok=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoints():
    root = tempfile.mkdtemp(prefix="zeroflat-fsdp-")
    out = {
        "dense_tied": write(tiny_dense(True), os.path.join(root, "dense_tied"), torch.bfloat16),
        "dense_fp32": write(tiny_dense(False), os.path.join(root, "dense_fp32"), torch.float32),
        "moe": write(tiny_moe(), os.path.join(root, "moe"), torch.bfloat16),
        # torch.save's pytorch_model.bin shards with their index, as Transformers saved them
        # before safetensors (the same model as dense_fp32's, in bf16).
        "dense_bin": _bin_of(tiny_dense(False), os.path.join(root, "dense_bin")),
        "root": root,
    }
    # A tied model's checkpoint that holds the tied head too, with other values or the same.
    for name, same in (("tied_twin_differs", False), ("tied_twin_equal", True)):
        out[name] = _with_head(out["dense_tied"], os.path.join(root, name), same)
    yield out
    shutil.rmtree(root, ignore_errors=True)


def _bin_of(config, path):
    from test_hf import _save_bin

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 1.3)
    _save_bin(model, path, shards=3)
    names = os.listdir(path)
    assert sum(n.endswith(".bin") for n in names) == 3, names
    assert not any(n.endswith(".safetensors") for n in names), names
    return path


def _with_head(src, dst, same):
    """A copy of the tied checkpoint ``src`` whose last file also holds lm_head.weight: the
    embedding's values (``same``) or others."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    index_path = os.path.join(dst, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    embed = load_file(os.path.join(dst, index["weight_map"]["model.embed_tokens.weight"]))[
        "model.embed_tokens.weight"]
    last = sorted(set(index["weight_map"].values()))[-1]
    tensors = load_file(os.path.join(dst, last))
    tensors["lm_head.weight"] = embed.clone() if same else (embed * 2 + 1).contiguous()
    save_file(tensors, os.path.join(dst, last), metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = last
    with open(index_path, "w") as f:
        json.dump(index, f)
    return dst


# ---- one rank ----------------------------------------------------------------------------------

def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard")[-len(shape):]
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


def _sharded(model, mesh):
    """FSDP2 as Transformers and torchtitan apply it: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _empty_sharded(path, dtype, mesh):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _sharded(model, mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():  # whatever to_empty left, a value no checkpoint holds
        for p in model.parameters():
            p.to_local().fill_(7.0)
        # Buffers no checkpoint holds (rotary inv_freq) made as the model makes them, as a
        # user's init_weights after to_empty would.
        fresh = dict(AutoModelForCausalLM.from_config(config, dtype=dtype).named_buffers())
        for n, b in model.named_buffers():
            b.copy_(fresh[n])
    return model


def _locals(model):
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _digest(model):
    import hashlib

    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.to_local().detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _steps(model, rank, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    vocab = model.config.vocab_size
    for _ in range(steps):
        x = torch.randint(0, vocab, (2, 6), generator=gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class _PerNode:
    """The binding, but for the ranks per node it reports."""

    def __init__(self, inner, per_node):
        self.inner, self.per_node = inner, per_node

    def local_ranks(self):
        return self.per_node

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _file_mappings():
    """[(start, end)] of this process's mappings of checkpoint files, safetensors or
    pytorch_model.bin (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith((".safetensors", ".bin")):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi))
    return out


def _files_digest(path):
    import hashlib

    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _equal_case(rank, mesh, case):
    import zeroflat.fsdp

    dtype = getattr(torch, case["dtype"])
    storage = case.get("storage", "read")
    files_before = _files_digest(case["path"]) if storage == "map" else None
    ours = _empty_sharded(case["path"], dtype, mesh)
    kept = {n: p.to_local() for n, p in ours.named_parameters()}
    if case.get("per_node"):  # the launcher's ranks per node, as LOCAL_WORLD_SIZE gives them
        zeroflat.fsdp._C = _PerNode(zeroflat.fsdp._C, case["per_node"])
    try:
        report = zeroflat.fsdp.load(ours, case["path"], keep_tensors=case.get("keep", False),
                                    replicas=case.get("replicas", "split"), storage=storage,
                                    cold=case.get("cold", False))
    finally:
        zeroflat.fsdp._C = getattr(zeroflat.fsdp._C, "inner", zeroflat.fsdp._C)
    for n, p in ours.named_parameters():
        if p.to_local().numel() == 0:
            continue  # an empty shard (a last rank of uneven rows) has no memory to compare
        # keep_tensors: the values copied into the local tensors the model had; else each
        # parameter a new one (the loaded shard), which FSDP2 keeps as it is when it is even.
        assert (p.to_local().data_ptr() == kept[n].data_ptr()) == case.get("keep", False), n
    # The reference: the full model as Transformers loads it, then sharded the same way.
    ref = AutoModelForCausalLM.from_pretrained(case["path"], dtype=dtype)
    _sharded(ref, mesh)
    want, got = _locals(ref), _locals(ours)
    assert want.keys() == got.keys()
    for n in want:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
        assert torch.equal(got[n], want[n]), (case, n)
    # Tied weights stay tied.
    if getattr(ours.config, "tie_word_embeddings", False):
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert report["bytes_read"] == report["share"], report
    # The copies check (sampled, the default) read other ranks' windows, counted beside
    # bytes_read: at most 16 windows of 64 KiB per other rank, of the library's loads and of the
    # shards used in place or buffers read whole.
    checked = report["copy_check_read_bytes"]
    assert (checked > 0) == (report["world"] > 1), report
    out = {"read": report["bytes_read"], "mapped": report["bytes_mapped"]}
    if storage == "map":
        # The shards of the file's dtype are the file's bytes, mapped (FSDP2 keeps an even
        # shard as it is); a conversion, and the MoE's stacked experts, are read.
        maps = _file_mappings()
        in_files = [n for n, p in ours.named_parameters() if p.to_local().numel()
                    and any(lo <= p.to_local().data_ptr() < hi for lo, hi in maps)]
        file_dtype = torch.float32 if "fp32" in case["path"] else torch.bfloat16
        assert (report["bytes_mapped"] > 0) == (file_dtype == dtype), report
        assert bool(in_files) == (file_dtype == dtype), in_files
        if "moe" in case["path"]:
            assert not any("experts" in n for n in in_files), in_files
        out["in_files"] = len(in_files)
    else:
        assert report["bytes_mapped"] == 0
    if case.get("steps"):
        even = {n: p.to_local().data_ptr() for n, p in ours.named_parameters()
                if p.dim() > 0 and p.shape[0] % mesh.size() == 0}
        assert _steps(ours, rank) == _steps(ref, rank), case
        out["steps"] = True
        if not case.get("keep"):
            # FSDP2 trained the loaded shards themselves where they were even (no re-padding).
            for n, p in ours.named_parameters():
                if n in even and mesh.ndim == 1:
                    assert p.to_local().data_ptr() == even[n], n
    if files_before is not None:  # training wrote the mapped shards: copies, not the files
        del ours
        assert _files_digest(case["path"]) == files_before
    return out


def _bad_case(rank, mesh, case):
    """A load that must fail on every rank with the model as it was."""
    import zeroflat.fsdp

    model = _empty_sharded(case["model_path"], torch.bfloat16, mesh)
    if case.get("counts"):  # a persistent buffer of the model's own
        model.register_buffer("counts", torch.zeros(6, dtype=torch.int64))
    before = _digest(model), model.counts.clone() if case.get("counts") else None
    path = case["path"]
    if case.get("rank_only") is not None and rank != case["rank_only"]:
        path = case["model_path"]  # only this rank's checkpoint is bad
    if case.get("disagree") and rank == 1:
        # This rank sees ranks 0 and 2 (the two replicas of shard 0 of a 2 x 2 mesh) the other
        # way round; its own shards are the same, so its own checks pass: the meshes differ.
        init = zeroflat.fsdp._Mesh.__init__

        def swapped(self, *args):
            init(self, *args)
            self.coords[0], self.coords[2] = self.coords[2], self.coords[0]
        zeroflat.fsdp._Mesh.__init__ = swapped
    try:
        zeroflat.fsdp.load(model, path, storage=case.get("storage", "read"))
    except Exception as e:  # noqa: BLE001 - the words are checked
        words = f"{type(e).__name__}: {e}"
    else:
        raise AssertionError(f"{case['name']}: the load did not fail")
    assert _digest(model) == before[0], case["name"]
    assert before[1] is None or torch.equal(model.counts, before[1]), case["name"]
    words_wanted = case["words"]
    if case.get("rank_only") is not None and rank != case["rank_only"] and \
            not case.get("both_find"):
        words_wanted = [f"rank {case['rank_only']} refused"]  # the others name the rank
    for w in words_wanted:
        assert w in words, (case["name"], words)
    return {"error": words}


def _transformers_case(rank, mesh, case):
    """zeroflat.hf.from_pretrained(distributed_config=) against Transformers' own FSDP2 load."""
    from transformers import DistributedConfig

    import zeroflat.hf

    dtype = getattr(torch, case["dtype"])
    replicate, shard = (case["mesh"] if len(case["mesh"]) == 2 else [1, case["mesh"][0]])
    config = DistributedConfig(fsdp_size=shard, dp_replicate_size=replicate)
    if case.get("absent_on") is not None:
        # This rank's copy has no config: it cannot build the model, and every rank says so
        # at once (not the others waiting in the load until the process group's timeout).
        path = case["path"] + ("-absent" if rank == case["absent_on"] else "")
        t0 = time.monotonic()
        try:
            zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, distributed_config=config,
                                        dtype=dtype)
        except Exception as e:  # noqa: BLE001 - the words are checked
            return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
        raise AssertionError("from_pretrained did not fail")
    ref = AutoModelForCausalLM.from_pretrained(case["path"], distributed_config=config,
                                               dtype=dtype)
    ours = zeroflat.hf.from_pretrained(AutoModelForCausalLM, case["path"],
                                       distributed_config=config, dtype=dtype,
                                       **({"storage": case["storage"]} if "storage" in case
                                          else {}))
    want = dict(ref.named_parameters(remove_duplicate=False))
    got = dict(ours.named_parameters(remove_duplicate=False))
    assert want.keys() == got.keys()
    for n, p in want.items():
        q = got[n]
        assert type(q) is type(p) and q.dtype == p.dtype and q.shape == p.shape, n
        assert list(q.placements) == list(p.placements), n
        assert torch.equal(q.to_local(), p.to_local()), (case, n)
    for (n, a), (m, b) in zip(ref.named_buffers(), ours.named_buffers()):
        assert n == m and torch.equal(a, b), n
    # Tied as Transformers ties them: where the checkpoint holds the head too with other
    # values, both leave them untied.
    tied = ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
    assert (ours.get_output_embeddings().weight is ours.get_input_embeddings().weight) == tied
    if case.get("tied") is not None:
        assert tied == case["tied"], case
    assert ours.zeroflat_report["bytes_read"] == ours.zeroflat_report["share"]
    # By default (storage="auto") the host shards of the file's dtype are mapped, as
    # Transformers maps its files; storage="read" reads them all.
    file_dtype = torch.float32 if "fp32" in case["path"] else torch.bfloat16
    assert ((ours.zeroflat_report["bytes_mapped"] > 0)
            == (case.get("storage") != "read" and file_dtype == dtype)), ours.zeroflat_report
    if case.get("steps"):
        ref.train()
        ours.train()
        assert _steps(ours, rank) == _steps(ref, rank), case
    return {"read": ours.zeroflat_report["bytes_read"]}


def _dcp_case(rank, mesh, case):
    """torch.distributed.checkpoint.load with zeroflat.dcp.Reader against the same load with
    DCP's own HuggingFaceStorageReader, into the same sharded model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import zeroflat.dcp

    dtype = getattr(torch, case["dtype"])
    models = []
    for reader in (HuggingFaceStorageReader(case["path"]), zeroflat.dcp.Reader(case["path"])):
        model = _empty_sharded(case["path"], dtype, mesh)
        # A tied lm_head is not in the file: a partial load, as with DCP's own reader.
        dcp.load(get_model_state_dict(model), storage_reader=reader,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
        models.append((model, reader))
    (ref, _), (ours, reader) = models
    want, got = _locals(ref), _locals(ours)
    for n in want:
        assert torch.equal(got[n], want[n]), (case, n)
    # Each rank read its shards' bytes and no more.
    return {"read": reader.bytes_read}


def worker(rank, world, port, job):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    for case in job["cases"]:
        mesh = _mesh(case["mesh"])
        run = (_bad_case if case.get("bad") else
               _transformers_case if case.get("transformers") else
               _dcp_case if case.get("dcp") else _equal_case)
        results.append(run(rank, mesh, case))
        dist.barrier()
    with open(f"{job['out']}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    end_rank()


def run(world, cases, tmp):
    out = os.path.join(tmp, f"result_{world}")
    start_ranks(worker, world, {"cases": cases, "out": out},
                preload=("transformers", "torch.distributed.fsdp"))
    ranks = []
    for r in range(world):
        with open(f"{out}.{r}") as f:
            ranks.append(json.load(f))
    return ranks


# ---- the tests ---------------------------------------------------------------------------------

def _data_bytes(path):
    """The bytes of every tensor of the checkpoint (its headers aside)."""
    from zeroflat import _C

    return sum(t.bytes for t in _C.Checkpoint(path).tensors())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_rank_holds_what_a_full_load_then_fully_shard_gives(checkpoints, world, tmp_path):
    meshes = [[world]] + ([[2, 2]] if world == 4 else [])
    cases = []
    for mesh in meshes:
        for name, dtype in (("dense_tied", "bfloat16"), ("dense_fp32", "bfloat16"),
                            ("moe", "bfloat16"), ("dense_tied", "float32")):
            cases.append({"mesh": mesh, "path": checkpoints[name], "dtype": dtype,
                          "steps": name == "dense_tied" and dtype == "bfloat16",
                          "keep": name == "dense_fp32"})
    # Shards used in place (storage="map"): bf16 and fp32 files into their own dtype, trained
    # on; a conversion (fp32 file, bf16 model) and the MoE's stacked experts read.
    cases += [{"mesh": [world], "path": checkpoints["dense_tied"], "dtype": "bfloat16",
               "storage": "map", "steps": True, "cold": world == 2},
              {"mesh": [world], "path": checkpoints["dense_fp32"], "dtype": "float32",
               "storage": "map", "steps": world == 3},
              {"mesh": [world], "path": checkpoints["dense_fp32"], "dtype": "bfloat16",
               "storage": "map"},
              {"mesh": [world], "path": checkpoints["moe"], "dtype": "bfloat16",
               "storage": "map"}]
    if world == 2:  # pytorch_model.bin shards, read and used in place, trained on
        cases += [{"mesh": [2], "path": checkpoints["dense_bin"], "dtype": "bfloat16",
                   "storage": storage, "steps": True} for storage in ("read", "map")]
    if world == 4:  # HSDP with each replica reading its whole shard; replicas="auto" on 2
        # nodes of 2 ranks (a replica group across nodes: split), and on one node of 4 (read)
        cases.append({"mesh": [2, 2], "path": checkpoints["moe"], "dtype": "bfloat16",
                      "replicas": "read"})
        for per_node in (2, 4):
            cases.append({"mesh": [2, 2], "path": checkpoints["dense_tied"], "dtype": "bfloat16",
                          "replicas": "auto", "per_node": per_node})
    ranks = run(world, cases, str(tmp_path))
    for k, case in enumerate(cases):
        read = [r[k]["read"] for r in ranks]
        # Together the ranks read each tensor's bytes once, and no more: HSDP's replicas
        # split each shard's reading (replicas="split") and complete one another; with
        # replicas="read", once per replica.
        replicas = 2 if (case.get("replicas") == "read" or case.get("per_node") == 4) else 1
        assert sum(read) == _data_bytes(case["path"]) * replicas, (case, read)
        if case.get("steps"):
            assert all(r[k]["steps"] for r in ranks)
        if case.get("storage") == "map" and "fp32" not in case["path"]:
            # Every rank used some shards in place (each holds rows of every tensor).
            assert all(r[k]["in_files"] > 0 for r in ranks), (case, ranks)


@pytest.mark.parametrize("world", [2, 4])
def test_from_pretrained_is_transformers_fsdp2_load(checkpoints, world, tmp_path):
    """The same model as Transformers 5's from_pretrained(distributed_config=...): placements,
    local shards, buffers, tied weights, and the next 3 steps; 1-D at 2 ranks, 2 x 2 HSDP."""
    mesh = [world] if world == 2 else [2, 2]
    cases = [{"transformers": True, "mesh": mesh, "path": checkpoints[name], "dtype": dtype,
              "steps": name == "dense_tied"}
             for name, dtype in (("dense_tied", "bfloat16"), ("moe", "bfloat16"),
                                 ("dense_fp32", "float32"))]
    # Every shard read into memory of its own.
    cases.append({"transformers": True, "mesh": mesh, "path": checkpoints["dense_tied"],
                  "dtype": "bfloat16", "steps": True, "storage": "read"})
    # A tied model's checkpoint holding the head too: untied where its values differ.
    for name, tied in (("tied_twin_differs", False), ("tied_twin_equal", True)):
        cases.append({"transformers": True, "mesh": mesh, "path": checkpoints[name],
                      "dtype": "bfloat16", "tied": tied})
    ranks = run(world, cases, str(tmp_path))
    for k, case in enumerate(cases):
        # replicas="auto" on one node: each replica reads its shard (the page cache serves
        # the second read)
        replicas = 2 if mesh == [2, 2] else 1
        assert sum(r[k]["read"] for r in ranks) == _data_bytes(case["path"]) * replicas


def test_from_pretrained_refuses_on_every_rank_when_one_cannot_build_the_model(checkpoints,
                                                                              tmp_path):
    ranks = run(2, [{"transformers": True, "mesh": [2], "path": checkpoints["dense_tied"],
                     "dtype": "bfloat16", "absent_on": 1}], str(tmp_path))
    (zero,), (one,) = ranks
    assert "rank 1 could not build the model" in zero["error"], zero
    assert "-absent" in one["error"], one
    # Well inside the process group's timeout (the failing rank does not leave the other
    # waiting in the load's collectives until then).
    assert zero["seconds"] < 60 and one["seconds"] < 60, ranks


def other_architectures():
    """Small models of other families, as their configs build them: Llama (untied), GPT-2 (tied,
    its Conv1D weights stored [in, out]; no dropout, so that the next steps compare), Mixtral
    (its experts stored one tensor each, stacked by Transformers' renaming rules) and GPT-NeoX
    (its head stored as embed_out, a rule Transformers keeps under the class's name, which
    fully_shard changes to FSDPGPTNeoXForCausalLM)."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, MixtralConfig

    common = dict(vocab_size=1001, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    return {"llama": LlamaConfig(**common, tie_word_embeddings=False),
            "gpt2": GPT2Config(vocab_size=1001, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            "mixtral": MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
            "gpt_neox": GPTNeoXConfig(vocab_size=1001, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      hidden_dropout=0.0, attention_dropout=0.0)}


def test_other_architectures_load_as_transformers_fsdp2_load_does(tmp_path):
    """The name mapping is Transformers' own, not the Qwen3 family's: other families' models,
    read and mapped, equal Transformers' FSDP2 load at 2 ranks, the next 3 steps too."""
    cases = []
    for name, config in other_architectures().items():
        path = write(config, str(tmp_path / name), torch.bfloat16)
        cases += [{"transformers": True, "mesh": [2], "path": path, "dtype": "bfloat16",
                   "steps": True, "storage": storage} for storage in ("read", "map")]
    ranks = run(2, cases, str(tmp_path))
    for k, case in enumerate(cases):
        assert sum(r[k]["read"] for r in ranks) == _data_bytes(case["path"]), case


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_reader_loads_what_dcps_own_hugging_face_reader_loads(checkpoints, world, tmp_path):
    cases = [{"dcp": True, "mesh": [world], "path": checkpoints[name], "dtype": dtype}
             for name, dtype in (("dense_tied", "bfloat16"), ("dense_fp32", "bfloat16"),
                                 ("dense_tied", "float32"))]
    ranks = run(world, cases, str(tmp_path))
    for k, case in enumerate(cases):
        assert sum(r[k]["read"] for r in ranks) == _data_bytes(case["path"])


def test_bad_input_is_refused_on_every_rank_with_every_model_as_it_was(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    good = checkpoints["dense_tied"]
    root = tmp_path / "bad"
    cases = []

    def variant(name, change, words, rank_only=None):
        path = root / name
        shutil.copytree(good, path)
        change(path)
        cases.append({"bad": True, "name": name, "mesh": [2], "path": str(path),
                      "model_path": good, "words": words, "rank_only": rank_only})

    def files(path):
        return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))

    def edit(key, fn):
        def change(path):
            index = json.load(open(path / "model.safetensors.index.json"))
            f = path / index["weight_map"][key]
            tensors = load_file(str(f))
            fn(tensors)
            save_file(tensors, str(f), metadata={"format": "pt"})
            if key not in tensors:
                del index["weight_map"][key]
                json.dump(index, open(path / "model.safetensors.index.json", "w"))
        return change

    key = "model.layers.1.mlp.down_proj.weight"
    variant("missing", edit(key, lambda t: t.pop(key)), ["holds no tensor", "down_proj"])
    variant("shape", edit(key, lambda t: t.update({key: t[key][:, :-1].contiguous()})),
            ["down_proj", "shape"])

    def cut(path):  # a file cut short: its header says more than it holds
        f = path / files(path)[-1]
        data = f.read_bytes()
        f.write_bytes(data[: len(data) - 100])
    variant("truncated", cut, ["InvalidArgument"])
    variant("one_rank_missing", edit(key, lambda t: t.pop(key)), ["down_proj"], rank_only=1)
    # The model ties the head to the embedding, the checkpoint holds both with other values: a
    # tied parameter cannot take both (with the same values, it loads).
    cases.append({"bad": True, "name": "tied_twin_differs", "mesh": [2],
                  "path": checkpoints["tied_twin_differs"], "model_path": good,
                  "words": ["ties", "'lm_head.weight'", "different values"]})
    cases.append({"mesh": [2], "path": checkpoints["tied_twin_equal"], "dtype": "bfloat16"})
    # Copies that differ only in their values (the same headers), on rank 1: every way a
    # value reaches the model is compared (what the loads read, the shards used in place, a
    # buffer read whole); each rank finds the other's bytes different in its own copy.
    embed = "model.embed_tokens.weight"
    resaved = root / "resaved"  # the file re-saved as the edits save it: the same header
    shutil.copytree(good, resaved)
    edit(embed, lambda t: None)(resaved)
    for storage in ("read", "map"):
        variant(f"other_values_{storage}", edit(embed, lambda t: t[embed].add_(1.0)),
                ["hold different bytes"], rank_only=1)
        cases[-1].update(storage=storage, both_find=True, model_path=str(resaved))

    def add_counts(scale):
        def change(path):
            index = json.load(open(path / "model.safetensors.index.json"))
            index["weight_map"]["counts"] = index["weight_map"][embed]
            json.dump(index, open(path / "model.safetensors.index.json", "w"))
            edit(embed, lambda t: t.update(counts=torch.arange(6) * scale))(path)
        return change
    counted = root / "counts"
    shutil.copytree(good, counted)
    add_counts(1)(counted)
    variant("buffer_differs", add_counts(100), ["hold different bytes", "'counts'"], rank_only=1)
    cases[-1].update(model_path=str(counted), counts=True, storage="map", both_find=True)
    # strict=True (the default): a buffer of the model that the checkpoint does not hold.
    cases.append({"bad": True, "name": "buffer_missing", "mesh": [2], "path": good,
                  "model_path": good, "counts": True,
                  "words": ["holds no tensor for the model's buffer 'counts'"]})
    ranks = run(2, cases, str(tmp_path))
    for r in ranks:
        assert len(r) == len(cases)


def test_ranks_whose_meshes_differ_are_refused_before_anything_is_read(checkpoints, tmp_path):
    good = checkpoints["dense_tied"]
    run(4, [{"bad": True, "name": "meshes_differ", "mesh": [2, 2], "path": good,
             "model_path": good, "words": ["shards rank 0 at"], "disagree": True}],
        str(tmp_path))


def dying_worker(rank, world, port, job):
    """Rank 1 dies at the load's first collective (the ranks' agreement on the model and the
    checkpoint); rank 0 must raise CommError naming it, its model as it was."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import zeroflat
    import zeroflat.fsdp
    from zeroflat import _comm

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _empty_sharded(job["path"], torch.bfloat16, _mesh([world]))
    before = _digest(model)
    if rank == 1:
        def die(self, *args):
            os._exit(0)
        _comm.TorchComm.all_reduce = die
    with pytest.raises(zeroflat.CommError) as e:
        zeroflat.fsdp.load(model, job["path"])
    assert _digest(model) == before
    with open(f"{job['out']}.{rank}", "w") as f:
        json.dump({"error": str(e.value)}, f)
    end_rank()  # the peer is gone: no collective ends this process group


def test_a_rank_that_dies_midway_is_named_and_no_model_changes(checkpoints, tmp_path):
    out = os.path.join(str(tmp_path), "dying")
    start_ranks(dying_worker, 2, {"path": checkpoints["dense_tied"], "out": out},
                preload=("transformers", "torch.distributed.fsdp"))
    assert not os.path.exists(f"{out}.1")
    with open(f"{out}.0") as f:
        text = json.load(f)["error"]
    assert "rank 1 of the group is presumably gone" in text, text


def test_a_model_not_sharded_is_refused(checkpoints):
    import zeroflat.fsdp

    config = transformers.AutoConfig.from_pretrained(checkpoints["dense_tied"])
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="no DTensor parameter"):
        zeroflat.fsdp.load(model, checkpoints["dense_tied"])


def test_a_storage_other_than_read_or_map_is_refused(checkpoints):
    import zeroflat.fsdp
    import zeroflat.hf

    config = transformers.AutoConfig.from_pretrained(checkpoints["dense_tied"])
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="storage='mmap'"):
        zeroflat.fsdp.load(model, checkpoints["dense_tied"], storage="mmap")
    # ZeRO's buffers are read: mapping is for FSDP2's shards only.
    with pytest.raises(ValueError, match="distributed_config"):
        zeroflat.hf.from_pretrained(AutoModelForCausalLM, checkpoints["dense_tied"],
                                    storage="map", deepspeed=None)
