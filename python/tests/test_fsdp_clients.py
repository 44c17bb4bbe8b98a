"""FSDP2 where its users are: the Transformers Trainer and accelerate sharding the model with
FSDP2 themselves, zeroflat loading the pretrained weights and serving their DCP checkpoints
(2 CPU ranks over gloo). Each way of wiring zeroflat in is compared with the plain run: every
rank's local shards and AdamW state (digests) and the losses, bit for bit; the ways that cannot
work raise an error that says what to do instead; none is silently wrong.

accelerate turns FSDP on for GPUs only; ``_fsdp_on_cpu`` turns it on for the CPU ranks here, for
the plain runs and zeroflat's alike (FSDP2 itself runs on the CPU with gloo)."""

import hashlib
import json
import os
import shutil
import sys
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # scripts/setup.sh installs both: CI never skips

sys.path.insert(0, os.path.dirname(__file__))
from reference import end_rank, start_ranks  # noqa: E402
from test_fsdp import tiny_dense  # noqa: E402
from test_hf import write  # noqa: E402

WORLD = 2
STEPS = 4


@pytest.fixture(scope="module")
def checkpoint():
    root = tempfile.mkdtemp(prefix="zeroflat-fsdp-clients-")
    yield write(tiny_dense(False), os.path.join(root, "model"), torch.float32)
    shutil.rmtree(root, ignore_errors=True)


# ---- one rank ----------------------------------------------------------------------------------

def _fsdp_on_cpu():
    """accelerate's state with FSDP on for CPU ranks (it turns FSDP on for GPUs only)."""
    from accelerate import state as acc_state
    from accelerate.utils import DistributedType

    init = acc_state.AcceleratorState.__init__

    def init_with_fsdp(self, *args, **kwargs):
        init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin
            acc_state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    acc_state.AcceleratorState.__init__ = init_with_fsdp


def _digest(model, optimizer):
    """sha256 of this rank's local shards and AdamW state, by parameter name."""
    h = hashlib.sha256()
    names = {}
    for n, p in model.named_parameters():
        names[p] = n
        h.update(n.encode())
        h.update(p.detach().to_local().contiguous().view(torch.uint8).numpy().tobytes())
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    held = [p for g in opt.param_groups for p in g["params"]]
    assert all(p in names for p in held), "the optimizer holds parameters the model has not"
    # Each of the model's parameters once (accelerate re-points the optimizer at prepare).
    assert len({id(p) for p in held}) == len(held) == len(names), "the optimizer's parameters"
    for p in sorted(held, key=lambda q: names[q]):
        state = opt.state.get(p, {})
        for k in sorted(state):
            v = state[k]
            v = v.to_local() if hasattr(v, "to_local") else v
            h.update(f"{names[p]}.{k}".encode())
            h.update(torch.as_tensor(v).detach().reshape(-1).contiguous().view(torch.uint8)
                     .numpy().tobytes())
    return {"digest": h.hexdigest(), "states": sum(1 for p in held if opt.state.get(p))}


def _data():
    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 3001, (8,), generator=gen),
             "labels": torch.randint(0, 3001, (8,), generator=gen)} for _ in range(32)]


def _random_model(path):
    """The model built from its config, its own random init: what a load must replace."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(123)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                            dtype=torch.float32)


def _trainer(case, path, out):
    """One Trainer run with FSDP2 (its own fsdp arguments, sharded DCP checkpoints every 2 steps):
    the model, the callbacks and the resume as ``case`` says."""
    from transformers import (AutoModelForCausalLM, Trainer, TrainerCallback,
                              TrainingArguments)

    import zeroflat.dcp
    import zeroflat.fsdp
    import zeroflat.hf

    from transformers import DistributedConfig

    model_kind = case["model"]
    try:
        if model_kind == "plain":
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        elif model_kind == "zeroflat":
            model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, fsdp2=True,
                                                dtype=torch.float32)
        elif model_kind == "sharded_at_load":  # Transformers' own distributed_config
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=WORLD))
        elif model_kind == "zeroflat_sharded_at_load":
            model = zeroflat.hf.from_pretrained(
                AutoModelForCausalLM, path, dtype=torch.float32,
                distributed_config=DistributedConfig(fsdp_size=WORLD))
        else:  # "random": the callback loads
            model = _random_model(path)
    except Exception as e:  # noqa: BLE001 - the words are the result
        return {"error": f"{type(e).__name__}: {e}"}
    callbacks = []
    if case.get("callback"):
        class LoadPretrained(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                zeroflat.fsdp.load(model, path)
        callbacks.append(LoadPretrained())
    fsdp = {} if case.get("no_fsdp") else {
        "fsdp": True, "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT",
                                      **case.get("fsdp_config", {})}}
    try:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, max_steps=STEPS, save_steps=2,
            save_strategy=case.get("save", "steps"), report_to=[], logging_steps=1, seed=0,
            data_seed=0, use_cpu=True, **fsdp)
        trainer = Trainer(model=model, args=args, train_dataset=_data(), callbacks=callbacks)
    except Exception as e:  # noqa: BLE001 - the words are the result
        return {"error": f"{type(e).__name__}: {e}"}
    if case.get("dcp"):
        zeroflat.dcp.install()
    before = dict(zeroflat.dcp.stats)
    try:
        trainer.train(resume_from_checkpoint=case.get("resume"))
    except Exception as e:  # noqa: BLE001 - the words are the result
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        zeroflat.dcp.uninstall()
    out = _digest(trainer.model, trainer.optimizer)
    out["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out["served"] = zeroflat.dcp.stats["served"] - before["served"]
    out["handed_back"] = zeroflat.dcp.stats["handed_back"] - before["handed_back"]
    report = getattr(model, "zeroflat_report", None)
    if report is not None:
        out["read"], out["share"] = report["bytes_read"], report["share"]
    return out


def _steps(model, optimizer, accelerator, data, losses):
    for batch in data:
        loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())


def _accelerate(case, path, out):
    """accelerate with its FSDP2 plugin: prepare(model, optimizer), 2 steps, save_state, a step;
    or a fresh run that load_state's that and steps once."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM

    import zeroflat.dcp
    import zeroflat.fsdp
    import zeroflat.hf

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    kind = case["model"]
    if kind == "plain":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    elif kind == "zeroflat":
        model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, path, fsdp2=True,
                                            dtype=torch.float32, **case.get("options", {}))
    else:
        model = _random_model(path)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = {}
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
        if case.get("load"):
            report = zeroflat.fsdp.load(model, path, **case.get("options", {}))
            result["read"], result["share"] = report["bytes_read"], report["share"]
        data, losses = _data(), []
        state = os.path.join(out, "state")
        if case.get("dcp"):
            zeroflat.dcp.install()
        before = dict(zeroflat.dcp.stats)
        if case.get("load_state"):
            accelerator.load_state(state)
            _steps(model, optimizer, accelerator, data[2:3], losses)
        else:
            _steps(model, optimizer, accelerator, data[:2], losses)
            if case.get("save"):
                accelerator.save_state(state)
            _steps(model, optimizer, accelerator, data[2:3], losses)
    except Exception as e:  # noqa: BLE001 - the words are the result
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        zeroflat.dcp.uninstall()
    result.update(_digest(model, optimizer))
    result["losses"] = losses
    result["served"] = zeroflat.dcp.stats["served"] - before["served"]
    report = getattr(model, "zeroflat_report", None)
    if report is not None:
        result["read"], result["share"] = report["bytes_read"], report["share"]
    return result


def _by_hand(case, path, out):
    """torchtitan's way: the model built on the meta device (or materialized by to_empty),
    fully_shard per layer and the root, an optimizer made, then fsdp.load; 3 steps. The
    reference: the whole model as Transformers loads it, then sharded the same way."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    import zeroflat
    import zeroflat.fsdp

    mesh = init_device_mesh("cpu", (WORLD,))
    config = AutoConfig.from_pretrained(path)
    if case["model"] == "plain":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    elif case["model"] == "meta_parameters":
        with zeroflat.meta_parameters():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    result = {}
    if case["model"] != "plain":
        try:
            report = zeroflat.fsdp.load(model, path)
        except Exception as e:  # noqa: BLE001 - the words are the result
            return {"error": f"{type(e).__name__}: {e}"}
        result.update(read=report["bytes_read"], share=report["share"],
                      materialized=report["materialized"])
    result["same_objects"] = all(a is b for a, b in zip(params, model.parameters()))
    result["buffers"] = {n: hashlib.sha256(b.contiguous().view(torch.uint8).numpy().tobytes())
                         .hexdigest() for n, b in model.named_buffers()}
    result["devices"] = sorted({str(p.device) for p in model.parameters()}
                               | {str(b.device) for b in model.buffers()})
    model.train()
    losses = []
    for batch in _data()[:3]:
        loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result.update(_digest(model, optimizer))
    result["losses"] = losses
    return result


def worker(rank, world, port, job):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    _fsdp_on_cpu()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    for case in job["cases"]:
        run = {"trainer": _trainer, "accelerate": _accelerate, "by_hand": _by_hand}[case["kind"]]
        out = os.path.join(job["tmp"], case["out"])
        results.append(run(case, job["path"], out))
        dist.barrier()
    with open(f"{job['result']}.{rank}", "w") as f:
        json.dump(results, f)
    end_rank()


def run(cases, path, tmp):
    result = os.path.join(tmp, "result")
    start_ranks(worker, WORLD, {"cases": cases, "path": path, "tmp": tmp, "result": result},
                preload=("transformers", "accelerate", "torch.distributed.fsdp"))
    ranks = []
    for r in range(WORLD):
        with open(f"{result}.{r}") as f:
            ranks.append(json.load(f))
    return [[ranks[r][k] for r in range(WORLD)] for k in range(len(cases))]


def _equal(got, want, what):
    for r, (g, w) in enumerate(zip(got, want)):
        assert "error" not in g, (what, r, g["error"])
        assert g["digest"] == w["digest"], (what, r)
        assert g["losses"] == w["losses"], (what, r, g["losses"], w["losses"])
        assert g["states"] == w["states"] and g["states"] > 0, (what, r)


def _refused(got, words, what):
    for r, g in enumerate(got):
        assert "error" in g, (what, r, "not refused")
        assert all(w in g["error"] for w in words), (what, r, g["error"])


# ---- the tests ---------------------------------------------------------------------------------

def test_the_trainer_with_its_fsdp_arguments(checkpoint, tmp_path):
    """The Trainer shards with FSDP2 (fsdp=True, fsdp_config version 2, sharded DCP checkpoints).
    zeroflat.hf.from_pretrained(..., fsdp2=True) loads the pretrained weights when the Trainer
    shards the model, and zeroflat.dcp.install() serves resume_from_checkpoint: the same shards,
    AdamW state and losses as the plain Trainer, over the steps and after the resume, which the
    load never overwrites. A callback that loads in on_train_begin trains the loaded weights (the
    optimizer keeps its parameters), and when resuming it is refused, saying why."""
    ckpt = os.path.join(str(tmp_path), "plain", "checkpoint-2")
    cases = [
        {"kind": "trainer", "model": "plain", "out": "plain"},
        {"kind": "trainer", "model": "zeroflat", "out": "zeroflat", "dcp": True},
        {"kind": "trainer", "model": "random", "callback": True, "out": "callback"},
        {"kind": "trainer", "model": "plain", "out": "resume_plain", "resume": ckpt},
        {"kind": "trainer", "model": "zeroflat", "out": "resume_zeroflat", "resume": ckpt,
         "dcp": True},
        {"kind": "trainer", "model": "random", "callback": True, "out": "resume_callback",
         "resume": ckpt},
    ]
    plain, ours, callback, resumed, ours_resumed, callback_resumed = run(cases, checkpoint,
                                                                        str(tmp_path))
    assert len(plain[0]["losses"]) == STEPS
    _equal(ours, plain, "fsdp2=True")
    assert all(r["read"] == r["share"] > 0 for r in ours), ours  # each rank its shards' bytes
    _equal(callback, plain, "the callback's load")
    _equal(ours_resumed, resumed, "the resume through zeroflat")
    # The resume loaded the model and the optimizer through zeroflat's reader, nothing handed
    # back; and it was a resume: the losses of the steps after it only.
    assert all(r["served"] == 2 and r["handed_back"] == 0 for r in ours_resumed), ours_resumed
    assert len(resumed[0]["losses"]) == STEPS  # 2 from the saved state, 2 trained
    _refused(callback_resumed, ["optimizer", "state", "fsdp2=True", "overwrite=True"],
             "a callback's load over a resume")


def test_accelerate_prepare_load_and_state(checkpoint, tmp_path):
    """accelerate with its FSDP2 plugin: fsdp.load after prepare(model, optimizer) (the default
    keeps every parameter object, the optimizer attached), and a model of fsdp2=True filled in
    prepare, each equal to the plain run; save_state then load_state through
    zeroflat.dcp.install(), equal to accelerate's own load_state."""
    cases = [
        {"kind": "accelerate", "model": "plain", "out": "plain", "save": True},
        {"kind": "accelerate", "model": "random", "out": "load", "load": True},
        {"kind": "accelerate", "model": "random", "out": "load_kept", "load": True,
         "options": {"keep_tensors": True, "storage": "read"}},
        {"kind": "accelerate", "model": "zeroflat", "out": "zeroflat"},
        {"kind": "accelerate", "model": "random", "out": "plain", "load_state": True},
        {"kind": "accelerate", "model": "zeroflat", "out": "plain", "load_state": True,
         "dcp": True},
    ]
    plain, loaded, kept, ours, state, ours_state = run(cases, checkpoint, str(tmp_path))
    _equal(loaded, plain, "fsdp.load after prepare")
    _equal(kept, plain, "fsdp.load(keep_tensors=True) after prepare")
    _equal(ours, plain, "fsdp2=True through prepare")
    assert all(r["read"] == r["share"] > 0 for r in loaded + ours)
    _equal(ours_state, state, "load_state through zeroflat")
    assert all(r["served"] == 2 for r in ours_state), ours_state  # model, optimizer
    assert all(r["served"] == 0 for r in state)


def test_a_model_built_on_meta_is_filled_in_place(checkpoint, tmp_path):
    """torchtitan's way: built on the meta device, fully_shard, an optimizer, then fsdp.load: the
    shards and the rotary tables computed as the model computes them (no to_empty), the same
    parameter objects (the optimizer attached), the next steps those of the plain model; a
    model built with zeroflat.meta_parameters() the same."""
    cases = [{"kind": "by_hand", "model": "plain", "out": "plain"},
             {"kind": "by_hand", "model": "meta", "out": "meta"},
             {"kind": "by_hand", "model": "meta_parameters", "out": "meta_parameters"}]
    plain, meta, meta_parameters = run(cases, checkpoint, str(tmp_path))
    for what, got in (("meta", meta), ("meta_parameters", meta_parameters)):
        _equal(got, plain, what)
        for r, (g, w) in enumerate(zip(got, plain)):
            assert g["buffers"] == w["buffers"], (what, r)  # rotary inv_freq among them
            assert g["same_objects"] and g["devices"] == ["cpu"], (what, r, g["devices"])
            assert g["read"] == g["share"] > 0, (what, r)
    assert all(r["materialized"] for r in meta)


def test_dcp_install_serves_and_hands_back_what_it_does_not(tmp_path, caplog):
    """zeroflat.dcp.install(): the FileSystemReader that dcp.load makes from a checkpoint_id
    reads through zeroflat (counted as served, the values DCP's own reader gives); a checkpoint
    saved through DCP's ZStandard stream transform is handed back to DCP's own reader, with one
    warning and counted; uninstall() puts DCP's class back."""
    import logging

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint._extension import ZStandard

    import zeroflat.dcp

    torch.manual_seed(0)
    state = {"w": torch.randn(64, 8), "b": torch.randn(8).bfloat16(), "step": 3}
    plain, packed = str(tmp_path / "plain"), str(tmp_path / "packed")
    dcp.save(state, checkpoint_id=plain)
    dcp.save(state, storage_writer=filesystem.FileSystemWriter(packed, _extensions=[ZStandard()]))
    original = dcp.FileSystemReader

    def load(path):
        out = {"w": torch.zeros(64, 8), "b": torch.zeros(8).bfloat16(), "step": 0}
        dcp.load(out, checkpoint_id=path)
        return out

    before = dict(zeroflat.dcp.stats)
    with caplog.at_level(logging.WARNING, logger="zeroflat.dcp"):
        with zeroflat.dcp.installed():
            assert dcp.FileSystemReader is not original
            assert issubclass(dcp.FileSystemReader, original)
            served = load(plain)
            handed = [load(packed), load(packed)]
    assert dcp.FileSystemReader is original and filesystem.FileSystemReader is original
    for got in [served] + handed:
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
        assert got["step"] == 3
    assert zeroflat.dcp.stats["served"] - before["served"] == 1
    assert zeroflat.dcp.stats["handed_back"] - before["handed_back"] == 2
    warned = [r for r in caplog.records if "handed back" in r.getMessage()]
    assert len(warned) == 1 and "stream transforms" in warned[0].getMessage(), warned


def test_a_model_waiting_for_fsdp2_says_so(checkpoint):
    """fsdp2=True returns the model on the meta device at once; a forward before FSDP2 shards it
    raises, saying where its weights come from, instead of computing on nothing; fsdp2=True
    with distributed_config is refused."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    import zeroflat.hf
    from zeroflat import _fsdp_pretrained

    model = zeroflat.hf.from_pretrained(AutoModelForCausalLM, checkpoint, fsdp2=True)
    assert all(p.is_meta for p in model.parameters())
    assert _fsdp_pretrained.waiting(model)
    with pytest.raises(RuntimeError, match="no weights yet.*fully_shard"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="pass one of them"):
        zeroflat.hf.from_pretrained(AutoModelForCausalLM, checkpoint, fsdp2=True,
                                    distributed_config=DistributedConfig(fsdp_size=2))
    del model


def test_the_trainer_and_models_sharded_at_load_time_or_on_broadcast(checkpoint, tmp_path):
    """The ways that do not combine, each as Transformers' own: a model sharded at load time
    (distributed_config) trains under a Trainer without fsdp arguments, equal to Transformers'
    own such model, and both are refused checkpoints with optimizer state in the same words
    (which say what to do); with the Trainer's fsdp arguments accelerate refuses Transformers'
    own, and zeroflat's is refused before, saying to load with fsdp2=True or to drop the fsdp
    arguments. fsdp2=True with cpu_ram_efficient_loading is refused, saying
    to leave it off."""
    cases = [
        {"kind": "trainer", "model": "sharded_at_load", "out": "own", "no_fsdp": True,
         "save": "no"},
        {"kind": "trainer", "model": "zeroflat_sharded_at_load", "out": "ours", "no_fsdp": True,
         "save": "no"},
        {"kind": "trainer", "model": "sharded_at_load", "out": "own_saves", "no_fsdp": True},
        {"kind": "trainer", "model": "zeroflat_sharded_at_load", "out": "ours_saves",
         "no_fsdp": True},
        {"kind": "trainer", "model": "sharded_at_load", "out": "own_fsdp", "save": "no"},
        {"kind": "trainer", "model": "zeroflat_sharded_at_load", "out": "ours_fsdp",
         "save": "no"},
        {"kind": "trainer", "model": "zeroflat", "out": "broadcast", "save": "no",
         "fsdp_config": {"cpu_ram_efficient_loading": True}},
    ]
    own, ours, own_saves, ours_saves, own_fsdp, ours_fsdp, broadcast = run(
        cases, checkpoint, str(tmp_path))
    _equal(ours, own, "distributed_config without the Trainer's fsdp arguments")
    for r, (t, m) in enumerate(zip(own_saves, ours_saves)):
        assert "error" in t and "error" in m, ("checkpoints", r, t, m)
        assert t["error"] == m["error"], ("checkpoints", r, t["error"], m["error"])
        assert "save_only_model=True" in m["error"], m["error"]  # it says what to do
    # With the Trainer's fsdp arguments, accelerate refuses Transformers' own such model in words
    # that do not say what to do; zeroflat's is refused first, saying it.
    _refused(own_fsdp, ["model and optimizer must be passed together"], "Transformers' own")
    _refused(ours_fsdp, ["sharded when it was loaded", "fsdp2=True", "drop the fsdp arguments"],
             "the Trainer's fsdp arguments")
    _refused(broadcast, ["cpu_ram_efficient_loading", "leave"], "cpu_ram_efficient_loading")
