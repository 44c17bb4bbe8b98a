"""engine.load_checkpoint under zeroflat.deepspeed.install() against DeepSpeed's own, on real
DeepSpeed checkpoints saved here (gloo, the CPU accelerator):

- the same world size, ZeRO-1, 2 and 3 (round-robin gradients, sub-groups, two optimizer
  groups, a frozen parameter, a buffer, an lr scheduler, client state): bit for bit DeepSpeed's
  own load (fp32 partitions, optimizer states, 16-bit weights, buffers, counters, scheduler,
  client state), and the next 3 steps' losses and weights;
- another world size (2 -> 3, 3 -> 2, 4 -> 2, 1 -> 2), straight from the saved per-rank files:
  bit for bit DeepSpeed's universal path (ds_to_universal, then load_universal) on the same
  checkpoint, and the next 3 steps' losses; universal folders load too;
- load_module_only, load_optimizer_states=False, tags, a missing 'latest';
- bad input (a truncated file, a compressed entry, an unknown global, a missing rank file,
  shapes that differ) refused on every rank before anything is written, and a read that fails
  midway (a file cut short after it was opened) leaving every rank's engine as it was.

Run as a script, it saves a checkpoint or runs one resume on its ranks (the tests run it under
each release):
    test_resume.py save OUT STAGE WORLD OPTIONS_JSON
    test_resume.py resume CKPT STAGE WORLD OPTIONS_JSON RESULT_JSON

Past 700 lines on purpose: every case resumes checkpoints saved by the same helpers, in
ranks started by the same worker, against DeepSpeed's own load of the same files."""

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from reference import CheckpointModel as Model, fork_deepspeed_ranks, start_ranks
from reference import train_steps

HERE = pathlib.Path(__file__).resolve().parent
TAG = "step2"


def _config(stage, opts):
    zero = {"stage": stage}
    if opts.get("round_robin"):
        zero["round_robin_gradients"] = True
    if opts.get("sub_group_size"):
        zero["sub_group_size"] = opts["sub_group_size"]
    if opts.get("from_fp32") is False:
        zero["load_from_fp32_weights"] = False
    if "persistence" in opts:  # ZeRO-3: parameters below this many elements are kept whole
        zero["stage3_param_persistence_threshold"] = opts["persistence"]
    if opts.get("offload_param"):
        zero["offload_param"] = {"device": "cpu"}
    if opts.get("offload"):  # the optimizer's states and step on the host (DeepSpeed's CPU Adam
        # is not built here: torch's AdamW steps the host partitions)
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "zero_force_ds_cpu_optimizer": False,
              "gradient_clipping": 1.0,
              "scheduler": {"type": "WarmupLR",
                            "params": {"warmup_min_lr": 5e-3, "warmup_max_lr": 1e-2,
                                       "warmup_num_steps": 10}}}
    if opts.get("no_grad_norm"):  # an engine that computes no gradient norm, so no clipping
        zero["compute_grad_norm"] = False
        config["gradient_clipping"] = 0.0
    if opts.get("universal"):
        config["checkpoint"] = {"load_universal": True}
    if opts.get("bf16_optimizer"):
        # bf16 ZeRO-1 with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def _engine(stage, opts):
    import deepspeed

    import zeroflat.deepspeed as zd

    model = Model(opts.get("hidden", 17))
    optimizer = torch.optim.AdamW(model.groups(), lr=1e-3)
    accel = deepspeed.accelerator.get_accelerator()
    if deepspeed.__version__ == "0.18.9" and not zd.is_installed():
        # 0.18.9's own accelerator path leaves autograd history on the buffer, and its step()
        # then fails with more than one rank on gloo; its host path builds the same bytes.
        accel.available_memory = lambda *a, **k: 0
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=_config(stage, opts))
    finally:
        vars(accel).pop("available_memory", None)
    return engine


# ---- saving ------------------------------------------------------------------------------------

def _save_worker(rank, world, port, out, stage, opts):
    from reference import end_rank, init_deepspeed_rank

    os.environ["LOCAL_SIZE"] = str(world)  # 0.14 and 0.15's CPU accelerator asks
    init_deepspeed_rank(rank, world, port)
    if "stages" in opts:  # one checkpoint per stage, in OUT/z{stage}
        for s in opts["stages"]:
            _save_one(rank, os.path.join(out, f"z{s}"), s, opts)
    else:
        _save_one(rank, out, stage, opts)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    end_rank()


def _save_one(rank, out, stage, opts):
    import deepspeed

    engine = _engine(stage, opts)
    train_steps(engine, rank, 2, seed=100)
    if opts.get("touch"):
        # Frozen values and buffers the fresh model does not have: a load must restore them.
        engine.module.scale.add_(1)
        if opts["touch"] == "all" or (opts["touch"] == "all-zero12" and stage < 3):
            with deepspeed.zero.GatheredParameters([engine.module.frozen], modifier_rank=0,
                                                   enabled=stage == 3):
                with torch.no_grad():
                    engine.module.frozen.add_(1)
    engine.save_checkpoint(out, tag=TAG, client_state={"epoch": 3, "note": "resume me",
                                                       "best": [0.5, 0.25]},
                           **({"exclude_frozen_parameters": True}
                              if opts.get("exclude_frozen") else {}))
    torch.distributed.barrier()


# ---- what an engine holds ----------------------------------------------------------------------

def _fp32(engine):
    opt = engine.optimizer
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        return list(opt.fp32_partitioned_groups_flat)
    if hasattr(opt, "fp32_groups_flat_partition"):  # BF16_Optimizer
        return list(opt.fp32_groups_flat_partition)
    return list(opt.single_partition_of_fp32_groups)


def _padding(engine):
    """Per fp32 partition, a mask of the elements that hold no parameter's data (their values
    are whatever the saving run's memory held: DeepSpeed saves and restores them as they are,
    zeroflat reads zeros)."""
    opt = engine.optimizer
    rank = torch.distributed.get_rank(opt.dp_process_group)
    masks = []
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        for k, t in enumerate(opt.fp32_partitioned_groups_flat):
            mask, at = torch.zeros(t.numel(), dtype=torch.bool), 0
            for p in opt.fp16_groups[k]:
                n = p.ds_tensor.numel()
                data = max(0, min(n, p.ds_numel - rank * n))
                mask[at + data:at + n] = True
                at += n
            masks.append(mask)
    else:
        paddings = opt.group_paddings if hasattr(opt, "group_paddings") else opt.groups_padding
        for i, t in enumerate(_fp32(engine)):
            mask = torch.zeros(t.numel(), dtype=torch.bool)
            pad = paddings[i]
            if pad:
                mask[t.numel() - pad:] = True
            masks.append(mask)
    return masks


def _data(t, mask):
    t = t.detach().clone()
    if t.dim() == 1 and t.numel() == mask.numel():
        t[mask] = 0
    return t


def snapshot(engine, by_name=False):
    """Everything a resume restores, cloned to the host (padding as zeros); ``by_name``: also
    each trained parameter's whole fp32 master and Adam states, by its name, as DeepSpeed's own
    accessors gather them (collective): the same values whatever the partitions' layout."""
    opt = engine.optimizer
    stage3 = hasattr(opt, "fp32_partitioned_groups_flat")
    masks = _padding(engine)
    out = {"fp32": [_data(t, m) for t, m in zip(_fp32(engine), masks)]}
    out["states"] = [{k: (_data(v, m) if torch.is_tensor(v) else v)
                      for k, v in opt.optimizer.state[t].items()}
                     for t, m in zip(_fp32(engine), masks)]
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                           for g in opt.optimizer.param_groups]
    if stage3:
        rank = torch.distributed.get_rank(opt.dp_process_group)
        out["lp"] = {}
        for n, p in engine.module.named_parameters():
            t = p.ds_tensor.detach().clone()
            t[max(0, min(t.numel(), p.ds_numel - rank * t.numel())):] = 0
            out["lp"][n] = t
        # What the checkpoint epilogue gathered: each parameter's status, and the whole data of
        # those it made available (the persistent ones).
        params = dict(engine.module.named_parameters())
        out["status"] = {n: p.ds_status.name for n, p in params.items()}
        out["whole"] = {n: p.data.detach().clone() for n, p in params.items()
                        if p.ds_status.name == "AVAILABLE"}
    else:
        out["lp"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out["buffers"] = {n: b.detach().clone() for n, b in engine.module.named_buffers()}
    out["counters"] = (engine.global_steps, engine.global_samples, engine.skipped_steps)
    out["scheduler"] = engine.lr_scheduler.state_dict() if engine.lr_scheduler else None
    out["loss_scale"] = float(getattr(opt, "loss_scale", 0) or 0)
    if by_name:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        # The states' fragments are linked lazily (at the first step): linked here, as a step
        # would, to read them.
        opt._lazy_init_hp_params_optimizer_state()
        out["by_name"] = {
            n: [safe_get_full_fp32_param(p)] + [safe_get_full_optimizer_state(p, k)
                                                for k in ("exp_avg", "exp_avg_sq")]
            for n, p in engine.module.named_parameters() if p.requires_grad}
    return out


def _release(version):
    return tuple(int(x) for x in version.split("+")[0].split(".")[:2])


def _check_whole(engine):
    """ZeRO-3: every parameter the engine holds whole (the persistent ones) holds its ranks'
    16-bit partitions end to end, gathered here independently of the load."""
    opt = engine.optimizer
    group = opt.dp_process_group
    world = torch.distributed.get_world_size(group)
    for name, p in engine.module.named_parameters():
        if p.ds_status.name != "AVAILABLE":
            continue
        parts = [torch.empty_like(p.ds_tensor) for _ in range(world)]
        torch.distributed.all_gather(parts, p.ds_tensor.detach().contiguous(), group=group)
        want = torch.cat(parts)[:p.ds_numel].view(p.ds_shape)
        same(want, p.data, f"/whole/{name}")


def _finite(state):
    return all(bool(torch.isfinite(t).all()) for t in state["fp32"])


def same(a, b, path="", skip=()):
    """Asserts a == b, bit for bit for tensors; names the first difference."""
    if path in skip:
        return
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), f"{path}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)} vs " \
            f"{b.dtype}{list(b.shape)}"
        bits = (lambda t: t.reshape(-1).view(torch.uint8)) if a.numel() else (lambda t: t)
        assert torch.equal(bits(a), bits(b)), f"{path}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {set(a)} vs {set(b)}"
        for k in a:
            same(a[k], b[k], f"{path}/{k}", skip)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}/{i}", skip)
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


# ---- resuming ----------------------------------------------------------------------------------

def _resume_worker(rank, world, port, ckpt, stage, opts, result):
    from reference import end_rank, init_deepspeed_rank

    os.environ["LOCAL_SIZE"] = str(world)
    init_deepspeed_rank(rank, world, port)
    reports = []
    for v, variant in enumerate(opts.get("variants", [{}])):
        one = dict(opts, **variant)
        saved_ref = f"{result}.ref{v}.{rank}"
        if opts.get("role") == "reference":
            if one.get("reference"):
                torch.save(_reference(rank, ckpt, stage, one), saved_ref)
            continue
        ref = torch.load(saved_ref, weights_only=False) if os.path.exists(saved_ref) else None
        reports.append(_resume_one(rank, world, ckpt, stage, one, ref))
    if opts.get("role") != "reference":
        with open(f"{result}.{rank}", "w") as f:
            json.dump(reports, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    end_rank()


def _load_args(ckpt, stage, opts):
    stage = opts.get("stage", stage)
    ckpt = os.path.join(ckpt, opts["dir"]) if opts.get("dir") else ckpt
    kwargs = dict(opts.get("load", {}))
    tag = opts.get("tag", TAG)
    if tag is not None:
        kwargs["tag"] = tag
    return ckpt, stage, kwargs


def _reference(rank, ckpt, stage, opts):
    """The reference's load (DeepSpeed's own, or its universal path), what it restored, and
    its next 3 steps."""
    ckpt, stage, kwargs = _load_args(ckpt, stage, opts)
    opts = dict(opts, **opts.get("reference_opts", {}))  # the reference engine's own options
    ref_path, ref_client = "", None
    if opts.get("reference") == "deepspeed":
        ref_engine = _engine(stage, opts)
        ref_path, ref_client = ref_engine.load_checkpoint(ckpt, **kwargs)
        ref = snapshot(ref_engine)
    elif opts.get("reference") == "universal":
        ref_engine = _engine(stage, dict(opts, universal=True))
        ref_engine.load_checkpoint(ckpt, **dict(kwargs, tag=f"{TAG}_universal"))
        # DeepSpeed's universal ZeRO-3 load (0.19.8) gives every sub-group one shared step
        # tensor, which its Adam then advances once per sub-group each step: the reference gets
        # one copy per sub-group, as a rigid load gives, so that the next steps compare.
        seen = set()
        for t in _fp32(ref_engine):
            st = ref_engine.optimizer.optimizer.state[t]
            if torch.is_tensor(st.get("step")):
                if id(st["step"]) in seen:
                    st["step"] = st["step"].clone()
                seen.add(id(st["step"]))
        ref = snapshot(ref_engine)
    losses = None
    if ref_path is not None and not opts.get("steps_unchecked"):
        losses = train_steps(ref_engine, rank, 3, seed=200)
    return {"loaded": ref, "path": ref_path, "client": ref_client, "losses": losses,
            "after": snapshot(ref_engine)}


def _resume_one(rank, world, ckpt, stage, opts, ref):
    """One load_checkpoint under zeroflat, compared with the reference's (`ref`, from
    _reference: run in this process before, or, where ZeRO-3 engines are involved, in a process
    of its own: two ZeRO-3 engines in one process, even one after the other, disturb each
    other's steps under some releases)."""
    import zeroflat
    import zeroflat.deepspeed as zd

    if ref is None and opts.get("reference"):
        ref = _reference(rank, ckpt, stage, opts)
        import gc

        gc.collect()
    ckpt, stage, kwargs = _load_args(ckpt, stage, opts)
    report = {"rank": rank, "name": opts.get("name")}
    ref_path = ref["path"] if ref is not None else ""
    resumes = len(zd.stats["resumes"])
    fallbacks = len(zd.stats["resume_fallbacks"])
    real = zeroflat._C.DeepSpeedCheckpoint
    progress = []
    with zd.installed(progress=progress.append):
        engine = _engine(stage, dict(opts, universal=opts.get("our_universal", False)))
        before = snapshot(engine)
        error = None
        if opts.get("fault") in ("truncate", "replace") and rank == world - 1:
            # A read that fails midway: saved rank 0's optimizer file is cut short after this
            # rank opened the checkpoint, or replaced by a file of the same size and other bytes
            # (another run's), renamed over it.
            fault = opts["fault"]

            class Cut(real):
                def __init__(self, *a, **k):
                    super().__init__(*a, **k)
                    for path, role, r in self.files:
                        if role == "optim" and r == 0:
                            if fault == "truncate":
                                os.truncate(path, os.path.getsize(path) // 2)
                                continue
                            data = bytearray(pathlib.Path(path).read_bytes())
                            data[-4096:-1024] = bytes(3072)
                            pathlib.Path(path + ".other").write_bytes(bytes(data))
                            os.replace(path + ".other", path)

            zeroflat._C.DeepSpeedCheckpoint = Cut
        if opts.get("fault") == "signature":
            # A release whose optimizer's load_state_dict takes other arguments (0.14's
            # BF16_Optimizer requires checkpoint_folder): refused before anything is written.
            engine.optimizer.load_state_dict = lambda state_dict_list, required, **kw: None
        if opts.get("other_copy") and rank == world - 1:
            # This rank's copy of the checkpoint differs from the others' under the same path,
            # as on hosts that each hold a copy: it opens another folder and shows the path the
            # others opened.
            other = os.path.join(ckpt, opts["other_copy"])

            class Other(real):
                def __init__(self, d, tag=None):
                    super().__init__(other, tag)
                    self.shown = os.path.join(os.fsdecode(d),
                                              os.path.relpath(real.dir.__get__(self), other))

                dir = property(lambda self: self.shown)

            zeroflat._C.DeepSpeedCheckpoint = Other
        import zeroflat._resume as zr

        real_why = zr.why_not
        if opts.get("unserved") and rank == world - 1:
            # This rank alone cannot serve the call (as when its load_dir is not a folder):
            # every rank refuses it, the others after reading into their optimizers' tensors,
            # which they put back first.
            zr.why_not = lambda *a: "this rank cannot (test)"
        if opts.get("fault") == "late":
            # A load that fails after the ones before it read straight into the optimizer's
            # own tensors (the fp32 master comes first): every rank fails at its last buffer.
            import zeroflat._load as zl

            real_call, planned = zl.call_loader, {}
            real_read = zr._Resume.read

            def read(self, threads, agreed=True):
                planned["count"] = len(self._plan.buffers)
                return real_read(self, threads, agreed)

            def failing(*a, **k):
                planned["done"] = planned.get("done", 0) + 1
                if planned["done"] == planned["count"]:
                    raise zeroflat.Error("injected failure of the last load (test)")
                return real_call(*a, **k)

            zl.call_loader = failing
            zr._Resume.read = read
        import zeroflat._resume_write as zw

        zw.FAIL_AT = opts.get("fail_at")  # the write fails at that step (testing aid)
        try:
            path, client = engine.load_checkpoint(
                ckpt, **(dict(kwargs, tag=opts["our_tag"]) if opts.get("our_tag") else kwargs))
        except Exception as e:  # noqa: BLE001 - the test says which errors it expects
            error = f"{type(e).__name__}: {e}"
        finally:
            zw.FAIL_AT = None
            report["write_steps"] = zw.STEPS
            zeroflat._C.DeepSpeedCheckpoint = real
            zr.why_not = real_why
            if opts.get("fault") == "late":
                zl.call_loader = real_call
                zr._Resume.read = real_read
    report["error"] = error
    report["optimizer"] = type(engine.optimizer).__name__
    report["resumes"] = zd.stats["resumes"][resumes:]
    report["fallbacks"] = zd.stats["resume_fallbacks"][fallbacks:]
    report["progress"] = [[p.rank, p.done, p.total, p.finished] for p in progress]
    if error is not None:
        # Nothing of the engine changed.
        same(before, snapshot(engine))
        report["unchanged"] = True
        return report
    report["path"] = path
    if opts.get("client_keys"):
        report["client_values"] = {k: client.get(k) for k in opts["client_keys"]}
    ours = snapshot(engine, opts.get("by_name", False))
    by_name = ours.pop("by_name", None)  # reported, not compared: the test checks it
    if "whole" in ours:
        _check_whole(engine)
        report["whole"], report["params"] = len(ours["whole"]), len(ours["status"])
    if ref is not None:
        skip = set(opts.get("skip", []))
        import deepspeed

        if opts.get("reference") == "deepspeed" and _release(deepspeed.__version__) < (0, 19):
            # Before 0.19, DeepSpeed's gather of the persistent parameters waits on its last
            # gloo handle only: its own load's whole values may still be arriving when the
            # reference is taken. Ours are checked against the partitions above (the statuses
            # are compared).
            skip.add("/whole")
        if opts.get("master_from_16bit"):
            # BF16_Optimizer without load_from_fp32_weights: DeepSpeed's own load keeps the
            # fresh engine's fp32 master (it never restores it from the 16-bit weights it
            # loaded, as the ZeRO-1/2 optimizer does), and its steps then start from that;
            # zeroflat's master is the up-cast of the 16-bit weights loaded (docs/python.md).
            # Everything else is compared.
            opt = engine.optimizer
            dp_rank = torch.distributed.get_rank(opt.dp_process_group)
            for g, t in enumerate(_fp32(engine)):
                same(opt.bf16_partitioned_groups[g][dp_rank].float(), t.detach(), f"/master/{g}")
            skip.add("/fp32")
        same(ref["loaded"], ours, skip=skip)
        if opts.get("reference") == "deepspeed":
            same(ref["client"], client)
            assert (path is None) == (ref_path is None), (path, ref_path)
            if path is not None:
                assert os.path.normpath(path) == os.path.normpath(ref_path), (path, ref_path)
            report["client"] = sorted(client or {})
        if path is not None and opts.get("steps_unchecked"):
            # Older releases' ZeRO-3 steps are no reference: NaN with DeepSpeed's own load on
            # both sides (0.14.5), and finite differences after a bit-identical loaded state,
            # only under CI's load (0.17.6, 0.18.9); see below. Not run, then: the reference's
            # load ran in this process just before (its steps are what two ZeRO-3 engines in
            # one process disturb). Nor where the loads differ on purpose (master_from_16bit).
            report["steps_not_compared"] = True
        elif path is not None:
            report["ref_losses"] = ref["losses"]
            report["losses"] = train_steps(engine, rank, 3, seed=200)
            after = snapshot(engine)
            if stage == 3 and not (_finite(ref["after"]) and _finite(after)):
                # DeepSpeed's own ZeRO-3 steps after its own load now and then make the fp32
                # master NaN on the CPU (seen from 0.14 to 0.17, 1 run in 3 of 0.14.5 with both
                # sides DeepSpeed's own load, zeroflat never installed): memory it reads without
                # writing. What was loaded is compared above, bit for bit.
                report["steps_not_compared"] = True
            else:
                same(ref["after"], after, skip=skip)
    if by_name is not None:
        report["by_name"] = {n: [t.float().reshape(-1).tolist() for t in v]
                             for n, v in by_name.items()}
    report["counters"] = list(ours["counters"])
    report["buffers"] = {k: v.tolist() for k, v in ours["buffers"].items()}
    report["frozen"] = ours["lp"]["frozen"].float().tolist()
    report["lp"] = {k: v.float().tolist() for k, v in ours["lp"].items()}
    report["unchanged"] = all(torch.equal(x, y) for x, y in zip(before["fp32"], ours["fp32"]))
    return report


# ---- the tests' harness ------------------------------------------------------------------------

_SAVED = {}


def _env(release=None):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    paths = [str(HERE)]
    if release is not None:
        rel = pathlib.Path(sys.prefix) / "deepspeed-releases" / release
        if not rel.is_dir():
            pytest.fail(f"DeepSpeed {release} is not installed at {rel} (scripts/setup.sh "
                        "installs it)")
        paths.insert(0, str(rel))
        # Releases before 0.16 load their own checkpoints with torch.load's old default
        # (weights_only=False), which torch 2.6 changed: the files are these tests' own.
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(paths + env.get("PYTHONPATH", "").split(os.pathsep))
    return env


def _ranks(release, mode, worker, world, *args):
    """``worker(rank, world, port, *args)`` on ``world`` fresh ranks: forked by this process's
    fork server under the environment's own DeepSpeed (no interpreter to start, nothing to
    import again), or under another release, by this file's ``mode`` in a process of its own
    with that release on its path."""
    if release is None:
        start_ranks(worker, world, *args)
        return
    argv = [a if isinstance(a, str) else json.dumps(a) for a in args]
    r = subprocess.run([sys.executable, str(HERE / "test_resume.py"), mode, argv[0], argv[1],
                        str(world), *argv[2:]], env=_env(release), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-6000:]


def saved(tmp_path_factory, stage, world, release=None, **opts):
    """A checkpoint saved at `world` ranks (cached for the session)."""
    key = (stage, world, release, json.dumps(opts, sort_keys=True))
    if key not in _SAVED:
        out = tmp_path_factory.mktemp(f"resume_z{stage}_w{world}")
        _ranks(release, "save", _save_worker, world, str(out), stage, opts)
        _SAVED[key] = out
    return _SAVED[key]


def universal(ckpts, release=None):
    """ds_to_universal of each CKPT/TAG into CKPT/TAG_universal, once, all in one process."""
    todo = [c for c in ckpts if not (c / f"{TAG}_universal").exists()]
    if todo:
        r = subprocess.run([sys.executable, str(HERE / "test_resume.py"), "universal",
                            *map(str, todo)], env=_env(release), capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]


def _universal_main(ckpts):
    from deepspeed.checkpoint import ds_to_universal

    for ckpt in ckpts:
        sys.argv = ["ds_to_universal", "--input_folder", os.path.join(ckpt, TAG),
                    "--output_folder", os.path.join(ckpt, f"{TAG}_universal"),
                    "--inject_missing_state", "--num_extract_workers", "1",
                    "--num_merge_workers", "1"]
        ds_to_universal.main(ds_to_universal.parse_arguments())


def resume(ckpt, stage, world, release=None, **opts):
    """One resume on `world` ranks; the ranks' reports."""
    result = pathlib.Path(ckpt).parent / f"result_{os.getpid()}_{world}"
    variants = [dict(opts, **v) for v in opts.get("variants", [{}])]
    roles = [None]
    if any(v.get("reference") and v.get("stage", stage) == 3 and not v.get("steps_unchecked")
           for v in variants):
        # ZeRO-3 steps compared: the reference in a process of its own (see _resume_one).
        roles = ["reference", "ours"]
    for role in roles:
        _ranks(release, "resume", _resume_worker, world, str(ckpt), stage, dict(opts, role=role),
               str(result))
    ranks = []
    for rank in range(world):
        with open(f"{result}.{rank}") as f:
            ranks.append(json.load(f))
        os.remove(f"{result}.{rank}")
    for path in pathlib.Path(result).parent.glob(pathlib.Path(result).name + ".ref*"):
        path.unlink()
    # Per variant, the ranks' reports.
    if "variants" in opts:
        return [list(v) for v in zip(*ranks)]
    return [r[0] for r in ranks]


def served(reports):
    """Every rank served by zeroflat, its steps after the load DeepSpeed's own (unless
    DeepSpeed's own ZeRO-3 steps went non-finite: see _resume_one)."""
    for r in reports:
        assert r["error"] is None, (r["name"], r["error"])
        assert r["fallbacks"] == [] and len(r["resumes"]) == 1, r
        assert r.get("steps_not_compared") or r["losses"] == r["ref_losses"], r
        # The progress callback's last report: the partitions' bytes (all the rank read but the
        # few scalars read before them), every one it expected.
        read = r["resumes"][0]["bytes_read"]
        rank, done, total, finished = r["progress"][-1]
        assert rank == r["rank"] and finished and done == total, r["progress"]
        assert 0.9 * read <= done <= read, (read, r["progress"])
        # The buffers' bytes were asked of the kernel first, in file order (the union of their
        # reads, ranges a little apart merged; two buffers of a universal checkpoint read the
        # same fp32 file), and the call's time is told by phase.
        resume = r["resumes"][0]
        assert (resume["read_ahead_bytes"] > 0) == (read > 0), resume
        assert set(resume["phases"]) == {"open", "small", "plan", "read", "agree", "write"}
        assert 0 <= sum(resume["phases"].values()) <= resume["seconds"] * 1.001 + 1e-3, resume


# ---- the same world size -----------------------------------------------------------------------

def test_same_world_is_deepspeeds_own_load(tmp_path_factory):
    """ZeRO-1 and ZeRO-2 with round-robin gradients, ZeRO-3 with sub-groups, each saved at 2
    ranks and resumed at 2: bit for bit DeepSpeed's own load, and the next 3 steps."""
    # ZeRO-3: DeepSpeed's own load does not restore frozen parameters (its module files hold
    # none of their values), so a frozen parameter changed before saving would make the two
    # loads differ; zeroflat's restore of them is checked in the next test.
    ckpt = saved(tmp_path_factory, 0, 2, stages=[1, 2, 3], round_robin=True, sub_group_size=100,
                 touch="all-zero12")
    variants = [{"name": f"ZeRO-{s}", "stage": s, "dir": f"z{s}"} for s in (1, 2, 3)]
    frozen = (Model().frozen.detach().to(torch.bfloat16) + 1).float().tolist()
    for variant, ranks in zip(variants, resume(ckpt, 0, 2, reference="deepspeed",
                                               variants=variants, round_robin=True,
                                               sub_group_size=100)):
        served(ranks)
        for r in ranks:
            # A fresh engine's fp32 master is read into in place (no buffer of the load's own).
            assert r["resumes"][0]["bytes_in_place"] > 0, r["resumes"]
            assert r["counters"] == [2, 8, 0]
            assert r["buffers"]["scale"] == [1.0, 2.0, 3.0]
            assert {"epoch", "note", "best"} <= set(r["client"])
            if variant["stage"] < 3:
                assert r["frozen"] == frozen


def test_a_checkpoint_of_another_layout_gives_each_parameter_its_values(tmp_path_factory):
    """ZeRO-1 and ZeRO-2 checkpoints saved with round-robin gradients, resumed by engines
    without (ZeRO-2's, and BF16_Optimizer's, which never is): every parameter's fp32 master,
    Adam states and 16-bit weights, the buffers, counters and scheduler are what DeepSpeed's own
    load into an engine of the saved layout gives (DeepSpeed's own load into these engines
    copies the partitions as they are: parameters get other parameters' values)."""
    ckpt = saved(tmp_path_factory, 0, 2, stages=[1, 2, 3], round_robin=True, sub_group_size=100,
                 touch="all-zero12")
    # The fp32 partitions and states are laid out otherwise by construction: compared by
    # parameter (by_name).
    layout = {"round_robin": False, "reference_opts": {"round_robin": True,
                                                        "bf16_optimizer": False},
              "skip": ["/fp32", "/states", "/loss_scale"], "steps_unchecked": True,
              "by_name": True}
    variants = [dict(layout, name="ZeRO-2 round-robin into ZeRO-2", stage=2, dir="z2"),
                dict(layout, name="ZeRO-1 round-robin into BF16_Optimizer", stage=1, dir="z1",
                     bf16_optimizer=True)]
    for variant, ranks in zip(variants, resume(ckpt, 0, 2, reference="deepspeed",
                                               variants=variants)):
        want = _saved_by_name(ckpt / variant["dir"], 2)
        for r in ranks:
            assert r["error"] is None, (variant["name"], r["error"])
            assert r["fallbacks"] == [] and len(r["resumes"]) == 1, r
            assert r["optimizer"] == ("BF16_Optimizer" if variant.get("bf16_optimizer") else
                                      "DeepSpeedZeroOptimizer")
            assert r["by_name"].keys() == want.keys()
            for name, values in want.items():
                assert r["by_name"][name] == values, (variant["name"], name)


def _saved_by_name(ckpt, world):
    """Each trained parameter's fp32 master, exp_avg and exp_avg_sq as a ZeRO-1/2 checkpoint
    saved at ``world`` ranks holds them: the ranks' partitions end to end, each group's
    parameters back to back in the order its param_shapes lists them (DeepSpeed saves them in
    its buffer's order: round-robin where the saving engine was)."""
    model = torch.load(ckpt / TAG / "mp_rank_00_model_states.pt", weights_only=False)
    optim = [torch.load(ckpt / TAG / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                        weights_only=False)["optimizer_state_dict"] for r in range(world)]
    out = {}
    for g, shapes in enumerate(model["param_shapes"]):
        flats = [torch.cat([o["single_partition_of_fp32_groups"][g] for o in optim])]
        flats += [torch.cat([o["base_optimizer_state"]["state"][g][k] for o in optim])
                  for k in ("exp_avg", "exp_avg_sq")]
        at = 0
        for name, shape in shapes.items():
            n = shape.numel()
            out[name] = [f[at:at + n].float().tolist() for f in flats]
            at += n
    return out


# ---- load_checkpoint's options -----------------------------------------------------------------

@pytest.mark.parametrize("stage", [2, 3])
def test_options_and_tags_are_deepspeeds(tmp_path_factory, stage):
    """load_module_only, load_optimizer_states=False, load_lr_scheduler_states=False,
    load_from_fp32_weights=False, the tag from 'latest', no 'latest' at all: what DeepSpeed's
    own load_checkpoint does, bit for bit. A call one rank cannot serve where the others can
    (its load_dir not a folder: DeepSpeed's own load would leave the ranks different, or at
    ZeRO-3 waiting on one another) is refused on every rank, every engine as it was."""
    ckpt = saved(tmp_path_factory, stage, 2, touch="buffer")
    (ckpt / "nolatest").mkdir(exist_ok=True)
    if not (ckpt / "nolatest" / TAG).exists():
        (ckpt / "nolatest" / TAG).symlink_to(ckpt / TAG)
    # A folder whose name is not UTF-8 (a str as os.fsdecode makes it, as DeepSpeed takes it).
    odd = os.fsdecode(b"folder-\xff")
    if not (ckpt / odd).exists():
        (ckpt / odd).symlink_to(ckpt, target_is_directory=True)
    variants = [
        {"name": "optimizer states off", "load": {"load_optimizer_states": False}},
        {"name": "scheduler off", "load": {"load_lr_scheduler_states": False}},
        {"name": "latest", "tag": None},
        {"name": "no latest", "tag": None, "dir": "nolatest"},
        {"name": "a folder not UTF-8", "tag": None, "dir": odd},
        {"name": "one rank unserved", "unserved": True},
    ]
    if stage != 3:
        # ZeRO-3: DeepSpeed's load_module_only restores no weights (its module files hold none
        # of their values); zeroflat's is checked below.
        variants.append({"name": "module only", "load": {"load_module_only": True}})
        variants.append({"name": "16-bit weights", "from_fp32": False})
    reports = resume(ckpt, stage, 2, reference="deepspeed", variants=variants)
    for variant, ranks in zip(variants, reports):
        for r in ranks:
            if variant["name"] == "one rank unserved":
                assert r["error"] is not None and r["unchanged"], r
                assert r["resumes"] == [] and r["fallbacks"] == [], r
                assert "cannot be served on this rank (this rank cannot (test))" in r["error"]
                if r["rank"] == 0:
                    assert "failed on rank 1" in r["error"], r["error"]
                continue
            assert r["error"] is None, (variant, r["error"])
            if variant["name"] == "no latest":
                assert r["path"] is None and r["resumes"] == [], r
            else:
                served([r])


def test_bf16_optimizer_resumes_as_deepspeeds_own_load(tmp_path_factory):
    """bf16 ZeRO-1 with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer), saved at 2
    ranks, resumed at 2: bit for bit DeepSpeed's own load and its next 3 steps, with the
    optimizer's states, without them and module only, frozen values and buffers restored (from
    the 16-bit weights: the same but for the fp32 master, which zeroflat restores from them); at
    3, what DeepSpeed's universal load gives."""
    ckpt = saved(tmp_path_factory, 1, 2, bf16_optimizer=True, touch="all-zero12")
    variants = [
        {"name": "all"},
        {"name": "optimizer states off", "load": {"load_optimizer_states": False}},
        {"name": "module only", "load": {"load_module_only": True}},
        {"name": "16-bit weights", "from_fp32": False, "master_from_16bit": True,
         "steps_unchecked": True},
    ]
    frozen = (Model().frozen.detach().to(torch.bfloat16) + 1).float().tolist()
    for variant, ranks in zip(variants, resume(ckpt, 1, 2, reference="deepspeed",
                                               variants=variants, bf16_optimizer=True)):
        served(ranks)
        for r in ranks:
            assert r["optimizer"] == "BF16_Optimizer", r["optimizer"]
            assert r["frozen"] == frozen and r["buffers"]["scale"] == [1.0, 2.0, 3.0]
            if variant["name"] == "all":
                # A fresh engine's fp32 master is read into in place.
                assert r["resumes"][0]["bytes_in_place"] > 0, r["resumes"]
                assert r["counters"] == [2, 8, 0]
    # At 3 ranks, the frozen values and buffers restored too (DeepSpeed's universal load
    # restores none of them: no reference).
    for ranks in resume(ckpt, 1, 3, bf16_optimizer=True, variants=[{"name": "2>3 touched"}]):
        for r in ranks:
            assert r["error"] is None and r["fallbacks"] == [] and len(r["resumes"]) == 1, r
            assert r["frozen"] == frozen and r["buffers"]["scale"] == [1.0, 2.0, 3.0]
    # At 3 ranks: straight from the saved per-rank files, and from the universal folder, each
    # what ds_to_universal and DeepSpeed's universal load give (a checkpoint whose frozen values
    # and buffers are the fresh model's).
    ckpt = saved(tmp_path_factory, 1, 2, bf16_optimizer=True)
    universal([ckpt])
    variants = [{"name": "2>3"}, {"name": "universal folder 2>3", "our_tag": f"{TAG}_universal"}]
    base = tmp_path_factory.mktemp("resume_bf16_to_3")
    for ranks in resume(base, 1, 3, reference="universal", bf16_optimizer=True,
                        variants=[dict(v, dir=str(ckpt)) for v in variants]):
        served(ranks)
        assert all(r["optimizer"] == "BF16_Optimizer" for r in ranks)


@pytest.mark.parametrize("stage", [2, 3])
def test_an_optimizer_offloaded_to_the_host_resumes_as_deepspeeds_own_load(tmp_path_factory,
                                                                          stage):
    """offload_optimizer (device cpu): the fp32 master and the states live in host memory of
    DeepSpeed's own (pinned where it can): served, bit for bit DeepSpeed's load, the next
    steps' losses the same."""
    ckpt = saved(tmp_path_factory, stage, 2, offload=True)
    served(resume(ckpt, stage, 2, reference="deepspeed", offload=True))


def test_zero3_persistent_parameters_are_whole_as_after_deepspeeds_own_load(tmp_path_factory):
    """ZeRO-3's persistent parameters (kept whole on every rank) come out of the resume whole,
    as DeepSpeed's epilogue leaves them, whether the resume gathers them in its one all-gather
    or hands them to DeepSpeed's own: none persistent, some (the biases), all, and with the
    parameters offloaded to the host; bit for bit DeepSpeed's own load (statuses, whole data,
    partitions) and the next steps the same."""
    ckpt = saved(tmp_path_factory, 3, 2)
    variants = [{"name": "none", "persistence": 0}, {"name": "biases", "persistence": 100},
                {"name": "all", "persistence": 10 ** 9},
                {"name": "offload_param", "offload_param": True}]
    for variant, ranks in zip(variants, resume(ckpt, 3, 2, reference="deepspeed",
                                               variants=variants)):
        served(ranks)
        whole, params = ranks[0]["whole"], ranks[0]["params"]
        assert all(r["whole"] == whole for r in ranks), (variant["name"], ranks)
        if variant["name"] == "none":
            assert whole == 0, (variant["name"], whole)
        elif variant["name"] == "biases":
            assert 0 < whole < params, (variant["name"], whole, params)
        else:  # every parameter is under the threshold (the default one with offload_param)
            assert whole == params, (variant["name"], whole, params)


def test_zero3_module_only_and_frozen_parameters(tmp_path_factory):
    """ZeRO-3's load_module_only restores the saved weights (DeepSpeed's own restores none):
    the same 16-bit partitions as load_optimizer_states=False gives; and its frozen parameters
    come back from their saved partitions (DeepSpeed leaves them as built)."""
    ckpt = saved(tmp_path_factory, 3, 2, touch="all")
    variants = [{"name": "module only", "load": {"load_module_only": True}},
                {"name": "optimizer states off", "load": {"load_optimizer_states": False}}]
    only, off = resume(ckpt, 3, 2, variants=variants)
    frozen = (Model().frozen.detach().to(torch.bfloat16) + 1).float()
    for a, b in zip(only, off):
        assert a["error"] is None and b["error"] is None, (a["error"], b["error"])
        assert not a["unchanged"] and a["counters"] == [0, 0, 0], a
        assert b["counters"] == [2, 8, 0], b
        assert a["lp"] == b["lp"] and a["buffers"] == b["buffers"]
        n = len(a["frozen"])  # this rank's partition: ceil(7 / 2) elements, the last padded
        mine = frozen[a["rank"] * n:(a["rank"] + 1) * n].tolist()
        assert a["frozen"][:len(mine)] == mine


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_saved_without_its_frozen_parameters(tmp_path_factory, stage):
    """save_checkpoint(exclude_frozen_parameters=True) leaves the frozen parameter out of every
    file: load_module_strict=False keeps the engine's own values, bit for bit DeepSpeed's own
    load and its next steps (ZeRO-3 refused it, "no values of 'frozen'"); a strict load is
    refused naming it, as DeepSpeed's, with the engine unchanged."""
    ckpt = saved(tmp_path_factory, stage, 2, touch="all", exclude_frozen=True)
    variants = [{"name": "not strict", "reference": "deepspeed",
                 "load": {"load_module_strict": False}},
                {"name": "strict"}]
    loose, strict = resume(ckpt, stage, 2, variants=variants)
    served(loose)
    built = Model().frozen.detach().to(torch.bfloat16).float().tolist()
    for r in loose:
        if stage < 3:
            assert r["frozen"] == built, r["frozen"]
    for r in strict:
        assert r["unchanged"] and "'frozen'" in r["error"], r["error"]


# ---- bad input ---------------------------------------------------------------------------------

def _copy(ckpt, name):
    out = ckpt / "bad" / name
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(ckpt / TAG, out / TAG)
    return out / TAG


def test_bad_checkpoints_are_refused_on_every_rank_with_the_engine_unchanged(tmp_path_factory):
    ckpt = saved(tmp_path_factory, 2, 2)
    optim = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    model = "mp_rank_00_model_states.pt"
    d = _copy(ckpt, "truncated")
    os.truncate(d / optim, os.path.getsize(d / optim) // 2)
    d = _copy(ckpt, "missing")
    os.remove(d / optim)
    d = _copy(ckpt, "compressed")
    with zipfile.ZipFile(ckpt / TAG / model) as zin, \
            zipfile.ZipFile(d / model, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            zout.writestr(item.filename, zin.read(item.filename))
    d = _copy(ckpt, "global")
    state = torch.load(d / model, weights_only=False)
    import datetime

    state["when"] = datetime.date(2026, 12, 1)  # a global no DeepSpeed checkpoint names
    torch.save(state, d / model)
    _copy(ckpt, "fault")
    d = _copy(ckpt, "noversion")  # a release no version can be read from (hand-edited files)
    for path in [d / model] + [d / optim.replace("rank_1", f"rank_{r}") for r in (0, 1)]:
        state = torch.load(path, weights_only=False)
        state["ds_version"] = "unknown"
        if "optimizer_state_dict" in state:
            state["optimizer_state_dict"]["ds_version"] = "unknown"
        torch.save(state, path)
    variants = [
        {"name": "truncated", "dir": "bad/truncated", "expect": optim},
        {"name": "missing", "dir": "bad/missing", "expect": "missing"},
        {"name": "compressed", "dir": "bad/compressed", "expect": "compressed"},
        {"name": "global", "dir": "bad/global", "expect": "datetime"},
        {"name": "shapes", "hidden": 19, "expect": "fc1.weight"},
        {"name": "fault", "dir": "bad/fault", "fault": "truncate", "expect": ""},
        {"name": "late", "fault": "late", "expect": "injected failure"},
        {"name": "signature", "fault": "signature", "expect": "takes other arguments"},
        {"name": "no version", "dir": "bad/noversion", "expect": "ds_version"},
        {"name": "clipping", "no_grad_norm": True, "expect": "compute_grad_norm=false"},
    ]
    reports = resume(ckpt, 2, 2, variants=variants)
    for variant, ranks in zip(variants, reports):
        for r in ranks:
            assert r["error"] is not None, (variant["name"], r)
            assert r["unchanged"], (variant["name"], r)
            assert r["resumes"] == [] and r["fallbacks"] == [], r
        # The rank that found it names the file and the entry; the others name that rank.
        assert any(variant["expect"] in r["error"] for r in ranks), (variant["name"], ranks)


@pytest.mark.parametrize("family", ["zero2", "bf16", "zero3"])
def test_a_write_failing_at_any_step_leaves_every_engine_as_it_was(tmp_path_factory, family):
    """The write is all or nothing by construction: made to fail at each of its steps in turn
    (a test hook), for ZeRO-1/2, BF16_Optimizer and ZeRO-3, every rank raises and every rank's
    engine is bit for bit as before (its 16-bit weights, fp32 master, optimizer states and
    groups, buffers, scheduler, counters; ZeRO-3's partitions, statuses and whole persistent
    parameters); past its last step the write succeeds. And the reproduction: a checkpoint whose
    optimizer states were re-saved without 'step' (torch's Adam refuses it with a KeyError in
    its load_state_dict, after zeroflat wrote the weights) leaves every engine as it was."""
    stage = {"zero2": 2, "bf16": 1, "zero3": 3}[family]
    opts = {"bf16_optimizer": True} if family == "bf16" else {}
    ckpt = saved(tmp_path_factory, stage, 2, touch="buffer", **opts)
    if family == "zero2":
        d = _copy(ckpt, "nostep")
        for path in d.glob("*optim_states.pt"):
            state = torch.load(path, weights_only=False)
            for entry in state["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
                entry.pop("step", None)
            torch.save(state, path)
    # A whole write first, to count its steps; then one run failing at each, and one past them.
    whole = resume(ckpt, stage, 2, variants=[{"name": "whole"}], **opts)[0]
    assert all(r["error"] is None for r in whole), whole
    total = whole[0]["write_steps"]
    assert total >= 5 and all(r["write_steps"] == total for r in whole), whole
    variants = [{"name": f"fail at {k}", "fail_at": k} for k in range(1, total + 2)]
    if family == "zero2":
        variants.append({"name": "no step", "dir": "bad/nostep"})
    reports = resume(ckpt, stage, 2, variants=variants, **opts)
    for variant, ranks in zip(variants, reports):
        k = variant.get("fail_at")
        for r in ranks:
            if k is not None and k > total:
                assert r["error"] is None, (variant["name"], r["error"])
                continue
            assert r["error"] is not None and r["unchanged"], (variant["name"], r)
            assert r["resumes"] == [], (variant["name"], r)
            words = "injected failure at step" if k is not None else "step"
            assert words in r["error"], (variant["name"], r["error"])


def test_ranks_whose_copies_differ_are_refused_with_every_engine_unchanged(tmp_path_factory):
    """The loads run without agreements of their own; the ranks then compare, in the call's one
    agreement, a digest of each rank's plan and of the headers of every buffer's files and
    tensors. A rank whose copy differs (under the same path, as on hosts that each hold one) in
    one parameter's exp_avg_sq.pt of a universal folder, or in a rank's optimizer file: every
    rank puts back what it read into its optimizer and refuses (a second pass whose loads run
    the loader's agreement names the entry), no engine changed."""
    ckpt = saved(tmp_path_factory, 2, 2)
    universal([ckpt])
    uni = f"{TAG}_universal"
    other = ckpt / "bad" / "other_universal"
    if other.exists():
        shutil.rmtree(other)
    shutil.copytree(ckpt / uni, other / uni)
    state_file = next(p for p in sorted((other / uni / "zero").glob("*/exp_avg_sq.pt")))
    state = torch.load(state_file, weights_only=False)
    state = state if isinstance(state, dict) else {"param": state}
    state["extra"] = torch.zeros(3)  # a larger file and one more entry, values unchanged
    torch.save(state, state_file)
    d = _copy(ckpt, "other_optim")
    optim = d / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = torch.load(optim, weights_only=False)
    state["extra"] = torch.zeros(3)
    torch.save(state, optim)
    variants = [
        {"name": "universal", "our_tag": uni, "other_copy": "bad/other_universal",
         "expect": "exp_avg_sq"},
        {"name": "optim", "other_copy": "bad/other_optim", "expect": "different"},
    ]
    for variant, ranks in zip(variants, resume(ckpt, 2, 2, variants=variants)):
        for r in ranks:
            assert r["error"] is not None and r["unchanged"], (variant["name"], r)
            assert r["resumes"] == [] and r["fallbacks"] == [], r
            assert "differ" in r["error"], (variant["name"], r["error"])
        assert any(variant["expect"] in r["error"] for r in ranks), (variant["name"], ranks)


def test_zero3_buffers_per_sub_group_hold_the_same_bytes(tmp_path_factory):
    """The plan with one ZeRO-3 buffer per sub-group (what the drop-in reads into the
    optimizer's own tensors) keeps and reads exactly what the plan with one buffer does."""
    import zeroflat

    ckpt = zeroflat._C.DeepSpeedCheckpoint(str(saved(tmp_path_factory, 3, 2, sub_group_size=100)),
                                           TAG)
    for world in (1, 2, 3):
        one = zeroflat._C.plan_resume(ckpt, world=world)
        per = zeroflat._C.plan_resume(ckpt, world=world, buffer_per_group=True)
        groups = len({b.group for b in per.buffers})
        assert groups > 1 and len(one.buffers) == len(one.targets)
        assert len(per.buffers) == groups * len(per.targets)
        assert [(b.target, b.group) for b in per.buffers] == [
            (t, g) for t in per.targets for g in range(groups)]
        for rank in range(world):
            assert per.rank_bytes(rank) == one.rank_bytes(rank), (world, rank)


def test_a_zero3_load_failing_after_reads_into_the_optimizer_puts_them_back(tmp_path_factory):
    """ZeRO-3 with sub-groups: the fp32 master of every sub-group is read straight into the
    optimizer's own tensors; a load that fails after them leaves every rank's engine exactly as
    it was (its master put back from the 16-bit partitions it was the up-cast of)."""
    ckpt = saved(tmp_path_factory, 3, 2, sub_group_size=100)
    for r in resume(ckpt, 3, 2, variants=[{"name": "late", "fault": "late"}],
                    sub_group_size=100)[0]:
        assert r["error"] is not None and "injected failure" in r["error"], r
        assert r["unchanged"] and r["resumes"] == [], r


# ---- every release ------------------------------------------------------------------------------

def _releases():
    """The last patch of every line the drop-in supports but the installed one, which every
    other test runs (0.18.6 is listed for its flatten, not its checkpoints: 0.18.9 saves and
    loads them alike)."""
    import importlib.metadata

    own = importlib.metadata.version("deepspeed")
    lines = (HERE.parent / "deepspeed-releases.txt").read_text().splitlines()
    releases = [x.strip() for x in lines if x.strip()[:1].isdigit()]
    last = {tuple(r.split(".")[:2]): r for r in releases}
    return [r for r in last.values() if r != own]


@pytest.mark.parametrize("release", _releases())
def test_each_release_resumes_its_own_checkpoints(tmp_path_factory, release):
    """A ZeRO-2 (round-robin) and a ZeRO-3 (sub-groups) checkpoint saved by each supported
    release, resumed under that release at 2 ranks: bit for bit its own load_checkpoint (ZeRO-2:
    and the next 3 steps; ZeRO-3: what was loaded, its steps not being reproducible between
    processes under these releases). Under the oldest, also one of BF16_Optimizer, and its
    ZeRO-2 and ZeRO-3 ones resumed under the installed release, as after an upgrade."""

    opts = {"round_robin": True, "sub_group_size": 100, "touch": "buffer"}
    ckpt = saved(tmp_path_factory, 0, 2, release=release, stages=[2, 3], **opts)
    # One set of ranks: ZeRO-2 (its steps compared) before any ZeRO-3 engine exists, then
    # ZeRO-3 (what was loaded compared, no steps).
    variants = [{"name": f"zero{s}", "stage": s, "dir": f"z{s}", "steps_unchecked": s == 3}
                for s in (2, 3)]
    for ranks in resume(ckpt, 2, 2, release=release, reference="deepspeed", variants=variants,
                        **opts):
        served(ranks)
        assert all(r["buffers"]["scale"] == [1.0, 2.0, 3.0] for r in ranks)
    if release != min(_releases(), key=lambda r: tuple(int(x) for x in r.split("."))):
        # The oldest release's checkpoints differ most from the installed one's, and its
        # BF16_Optimizer is the oldest (the names are the same in every release that has it;
        # 0.17.x and 0.18.0-0.18.5 run bf16 ZeRO-1 with fp32 accumulation without it): the two
        # checks below run for it alone.
        return
    # The same checkpoints resumed after an upgrade: under the installed release, bit for bit
    # its own load of them (ZeRO-2: and the next 3 steps; ZeRO-3's steps, in a process of
    # their own, are the installed release's other tests').
    variants = [{"name": f"zero{s} upgraded", "stage": s, "dir": f"z{s}", "steps_unchecked": s == 3}
                for s in (2, 3)]
    for ranks in resume(ckpt, 2, 2, reference="deepspeed", variants=variants, **opts):
        served(ranks)
    # bf16 ZeRO-1 with fp32 gradient accumulation (BF16_Optimizer), its steps compared.
    ckpt = saved(tmp_path_factory, 1, 2, release=release, bf16_optimizer=True, touch="buffer")
    ranks = resume(ckpt, 1, 2, release=release, reference="deepspeed", bf16_optimizer=True)
    served(ranks)
    assert all(r["optimizer"] == "BF16_Optimizer" for r in ranks)


# ---- the Transformers Trainer ------------------------------------------------------------------

def _client_run(kind, out, mode, stage):
    """One run of a client's script (this file's ``trainer`` or ``accelerate`` mode) in a fresh
    process: the JSON it printed on its line marked with the kind."""
    from reference import free_port

    r = subprocess.run([sys.executable, str(HERE / "test_resume.py"), kind, str(out), mode,
                        str(free_port()), str(stage)], env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    mark = kind.upper() + " "
    line = [x for x in r.stdout.splitlines() if x.startswith(mark)][-1]
    return json.loads(line[len(mark):])


def _trainer_main(out, mode, port, stage=2):
    """One Trainer run on one rank (DeepSpeed ZeRO-2 or 3, fp32: the Trainer asks a GPU for bf16):
    "save" trains 4 steps and saves; "resume" trains to step 6 from checkpoint-4 twice, with
    DeepSpeed's own load and with zeroflat's. Prints the losses as JSON."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import importlib

    comm_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    import zeroflat.deepspeed as zd

    def run(steps, resume):
        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        gen = torch.Generator().manual_seed(1)
        data = [{"input_ids": torch.randint(0, 128, (16,), generator=gen),
                 "labels": torch.randint(0, 128, (16,), generator=gen)} for _ in range(16)]
        ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=steps,
                                 save_steps=4, save_strategy="steps", deepspeed=ds,
                                 report_to=[], logging_steps=1, seed=0, data_seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    result = {}
    if mode == "save":
        result["losses"] = run(4, None)
    else:
        ckpt = os.path.join(out, "checkpoint-4")
        result["deepspeed"] = run(6, ckpt)
        with zd.installed():
            result["zeroflat"] = run(6, ckpt)
        result["resumes"] = zd.stats["resumes"]
        result["fallbacks"] = zd.stats["resume_fallbacks"]
    print("TRAINER " + json.dumps(result), flush=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_transformers_trainer_resumes_through_zeroflat(tmp_path, stage):
    """Trainer.train(resume_from_checkpoint=...) calls the engine's load_checkpoint: under the
    drop-in zeroflat serves it, and the steps after the resume are DeepSpeed's own (ZeRO-3: a
    Llama's norms are persistent parameters, gathered whole by the resume)."""
    def main(mode):
        return _client_run("trainer", tmp_path / "out", mode, stage)

    main("save")
    got = main("resume")
    assert len(got["resumes"]) == 1 and got["fallbacks"] == [], got
    assert got["resumes"][0]["tag"] == "global_step4"
    # The losses logged: the saved run's 4 (from trainer_state.json) and the 2 steps after.
    assert got["zeroflat"] == got["deepspeed"] and len(got["zeroflat"]) == 6, got


def _accelerate_main(out, mode, port, stage):
    """One accelerate run on one rank (its DeepSpeed plugin, ZeRO-2 or 3): "save" trains 3 steps
    and saves with ``save_state``; "deepspeed" and "zeroflat" build the same run afresh,
    ``load_state`` it (which calls the engine's load_checkpoint with accelerate's own tag) and
    train 3 steps more. Prints the losses as JSON."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                      ACCELERATE_USE_DEEPSPEED="true")
    import importlib

    comm_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    import zeroflat.deepspeed as zd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage,
                                                       gradient_accumulation_steps=1))
    acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    model, opt, sched = acc.prepare(model, opt, sched)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen))
            for _ in range(6)]
    state = os.path.join(out, "state")
    with zd.installed() if mode == "zeroflat" else contextlib.nullcontext():
        if mode != "save":
            acc.load_state(state)
        losses = []
        for x, y in data[:3] if mode == "save" else data[3:]:
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
    if mode == "save":
        acc.save_state(state)
    result = {"losses": losses, "resumes": zd.stats["resumes"],
              "fallbacks": zd.stats["resume_fallbacks"], "lr": sched.get_last_lr()}
    print("ACCELERATE " + json.dumps(result), flush=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_resumes_through_zeroflat(tmp_path, stage):
    """accelerate's ``load_state`` under its DeepSpeed plugin calls the engine's load_checkpoint:
    zeroflat serves it, and the steps after it, with the learning rate the scheduler restored,
    are those after DeepSpeed's own load."""
    pytest.importorskip("accelerate")  # scripts/setup.sh installs it: CI never skips
    def main(mode):
        return _client_run("accelerate", tmp_path, mode, stage)

    main("save")
    own, got = main("deepspeed"), main("zeroflat")
    assert own["resumes"] == [] and len(got["resumes"]) == 1 and got["fallbacks"] == [], got
    assert got["losses"] == own["losses"] and len(got["losses"]) == 3, (got, own)
    assert got["lr"] == own["lr"], (got, own)


# ---- another world size ------------------------------------------------------------------------

@pytest.mark.parametrize("world,saved_worlds", [(3, [2]), (2, [3, 4, 1])],
                         ids=["2>3", "3>2, 4>2, 1>2"])
def test_another_world_is_deepspeeds_universal_load(tmp_path_factory, world, saved_worlds):
    """Straight from the saved per-rank files, bit for bit what ds_to_universal and a universal
    load give (fp32 partitions, optimizer states, 16-bit weights), and the same next 3 steps:
    ZeRO-2 (2>3, 3>2), ZeRO-1 (4>2, 1>2) and ZeRO-3 with sub-groups (all four)."""
    zero12 = {2: 2, 3: 2, 4: 1, 1: 1}
    variants, folders = [], []
    for sw in saved_worlds:
        ckpt = saved(tmp_path_factory, 0, sw, stages=[zero12[sw], 3], sub_group_size=100)
        folders += [ckpt / f"z{s}" for s in (zero12[sw], 3)]
        for s in (zero12[sw], 3):
            where = {"stage": s, "dir": str(ckpt / f"z{s}")}
            variants.append(dict(where, name=f"ZeRO-{s} {sw}>{world}"))
            if sw == 2 and world == 3:
                # The universal folder itself, each rank reading only its ranges of its files.
                variants.append(dict(where, name=f"ZeRO-{s} universal folder {sw}>{world}",
                                     our_tag=f"{TAG}_universal"))
    universal(folders)
    base = tmp_path_factory.mktemp(f"resume_to_{world}")
    for ranks in resume(base, 2, world, reference="universal", variants=variants,
                        sub_group_size=100):
        served(ranks)


if __name__ == "__main__":
    if sys.argv[1] == "save":
        out, stage, world, opts = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        fork_deepspeed_ranks(_save_worker, world, out, stage, json.loads(opts))
    elif sys.argv[1] == "universal":
        _universal_main(sys.argv[2:])
    elif sys.argv[1] == "accelerate":
        _accelerate_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1] == "trainer":
        _trainer_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1] == "resume":
        ckpt, stage, world, opts, result = (sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                            sys.argv[5], sys.argv[6])
        fork_deepspeed_ranks(_resume_worker, world, ckpt, stage, json.loads(opts), result)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_masters_upcast_check_is_bit_for_bit_across_blocks(dtype):
    """The fp32 master is lent to the resume only while it is exactly the up-cast of its
    16-bit partition (putting it back is then exact): every element compared, across the
    library's blocks of 2048 and in the last partial one, bit for bit (a sign of zero, a NaN's
    payload)."""
    from zeroflat._resume_inplace import _upcast_of

    h = torch.randn(5003).to(dtype)
    h[7] = float("nan")
    m = h.float().clone()  # (float() of an fp32 tensor is the tensor itself)
    assert _upcast_of(m, h)
    for at in (0, 2047, 2048, 4096, 5002):  # block edges and the last, partial block
        other = m.clone()
        other[at] = other[at] + 1 if other[at] == other[at] else 0.0
        assert not _upcast_of(other, h), at
    other = m.clone()
    other.view(torch.int32)[7] ^= 1 << 13  # another NaN: as numbers both NaN
    assert torch.isnan(other[7]) and not _upcast_of(other, h)
    h[10], m[10] = 0.0, -0.0  # equal as numbers, not as bits
    assert not _upcast_of(m, h)
    with pytest.raises(ValueError, match="elements"):
        _upcast_of(m[:-1], h)


def test_the_writes_record_keeps_each_byte_once_and_restores_every_tensor():
    """Undo records a tensor's values unless all its bytes were recorded before, whichever
    tensors they came with (views across two recorded ones, the whole under its parts), and
    puts every tensor back; bytes it was told are put back otherwise are not recorded."""
    from zeroflat._resume_undo import Undo

    base = torch.arange(100, dtype=torch.float32)
    other = torch.arange(10, dtype=torch.float32)
    lent = torch.zeros(8)
    undo = Undo(put_back=[lent])
    undo.tensor(base[0:50])
    undo.tensor(base[60:100])
    undo.tensor(base[25:45])   # within the first
    undo.tensor(base[40:70])   # bridges the two: its bytes 50..60 are new
    undo.tensor(base)          # all of it recorded by now
    undo.tensor(base[10:90])
    undo.tensor(other)
    undo.tensor(lent)
    assert len(undo._tensors) == 4
    was_base, was_other = base.clone(), other.clone()
    base.fill_(-1.0)
    other.fill_(-2.0)
    lent.fill_(3.0)
    undo.restore()
    assert torch.equal(base, was_base) and torch.equal(other, was_other)
    assert bool((lent == 3.0).all())  # put back by its owner, not by the record
