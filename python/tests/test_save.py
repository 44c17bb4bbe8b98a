"""The drop-in's ``engine.save_checkpoint`` (python/zeroflat/_save.py): DeepSpeed's own files,
published so that a failure or a crash at any step never costs the last complete checkpoint.

Every test runs 2 ranks of DeepSpeed's CPU accelerator over gloo. A fault is injected through
the library's hook (include/zeroflat/save.h) on one rank at one step of the save; afterwards
``latest`` must name a checkpoint whose every file is byte for byte that of a complete save (the
one before, or the new one), and DeepSpeed's own load must take it."""

import enum
import filecmp
import os
import shutil
import signal
import subprocess
import sys
import zipfile

import pytest
import torch

from reference import CheckpointModel, end_rank, init_deepspeed_rank, start_ranks, train_steps

STAGES = [2, 3]


def _init(rank, world, port):
    os.environ["LOCAL_SIZE"] = str(world)  # as DeepSpeed's launcher sets it (0.14, 0.15 ask)
    init_deepspeed_rank(rank, world, port)


def _done():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    end_rank()


def _engine(stage):
    """A ZeRO engine of ``stage``: 2 or 3, or "round_robin" (ZeRO-2 with round-robin gradients),
    "bf16_optimizer" (bf16 ZeRO-1 with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer)."""
    import deepspeed

    model = CheckpointModel()
    optimizer = torch.optim.AdamW(model.groups(), lr=1e-3)
    zero = {"stage": stage if isinstance(stage, int) else 2}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "zero_force_ds_cpu_optimizer": False}
    if stage == "round_robin":
        zero["round_robin_gradients"] = True
    if stage == "bf16_optimizer":
        zero["stage"] = 1
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _files(folder):
    """Every file under ``folder``, relative to it."""
    out = set()
    for root, _, names in os.walk(folder):
        out.update(os.path.relpath(os.path.join(root, n), folder) for n in names)
    return out


def _same_folder(a, b):
    names = _files(a)
    return names == _files(b) and all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n),
                                                  shallow=False) for n in names)


def _same_values(a, b, where):
    """DeepSpeed's saved state ``a`` equal to ``b``: keys, values, dtypes; an enum member equal
    to its value (the drop-in writes ZeroStageEnum as its number)."""
    if isinstance(b, enum.Enum):
        assert type(a) is int and a == b.value, (where, a, b)
    elif isinstance(b, dict):
        assert list(a.keys()) == list(b.keys()), where
        for k in b:
            _same_values(a[k], b[k], f"{where}/{k}")
    elif isinstance(b, (list, tuple)) and not hasattr(b, "_fields"):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_values(x, y, f"{where}/{i}")
    elif isinstance(b, torch.Tensor):
        # Bit for bit: the padding of a ZeRO-3 flat group is uninitialized, NaN at times.
        assert _same_bits(a, b), where
    elif hasattr(b, "__dict__") and not isinstance(b, type):
        assert type(a) is type(b), where
        _same_values(vars(a), vars(b), where)
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def _same_bits(a, b):
    """Equal bit for bit (NaN included: DeepSpeed 0.14's ZeRO-3 consolidation can hand out the
    flat group's uninitialized padding inside a parameter, the same in both folders)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def _latest_is_whole(ckpt, refs):
    """Which reference the checkpoint ``latest`` names is, byte for byte (its index in refs)."""
    with open(os.path.join(ckpt, "latest")) as f:
        tag = f.read()
    for i, ref in enumerate(refs):
        if _same_folder(os.path.join(ckpt, tag), ref):
            return i
    raise AssertionError(f"latest names {tag!r}, which is no complete checkpoint")


def _cases(overwrite):
    """(rank, step) for every step of a save of 2 ranks: rank 0 writes 2 files under ZeRO-2
    (the model and its optimizer state) and 2 under ZeRO-3; rank 1 1 and 2."""
    publish = (["publish.exchange", "publish.fsync", "publish.remove"] if overwrite
               else ["publish.rename", "publish.fsync"])
    return ([(0, s) for s in ["write.1", "write.2", "sync_files.1", "sync_files.2", "sync_tree",
                              *publish, "latest.write", "latest.fsync", "latest.rename",
                              "latest.fsync_dir"]] +
            [(1, s) for s in ["write.1", "sync_files.1"]])


def _faults_worker(rank, world, port, out, stage, background, result):
    import zeroflat
    import zeroflat.deepspeed as zd
    from zeroflat import _C

    _init(rank, world, port)
    zd.install(save_in_background=background)
    engine = _engine(stage)
    ckpt, ref1, ref2 = (os.path.join(out, n) for n in ("ckpt", "ref1", "ref2"))
    train_steps(engine, rank, 1)
    engine.save_checkpoint(ckpt, tag="t1")
    zd.wait(every_rank=True)
    if rank == 0:
        shutil.copytree(os.path.join(ckpt, "t1"), ref1)
    train_steps(engine, rank, 1, seed=200)
    engine.save_checkpoint(os.path.join(out, "second"), tag="t1")
    zd.wait(every_rank=True)
    if rank == 0:
        shutil.copytree(os.path.join(out, "second", "t1"), ref2)
    torch.distributed.barrier()
    seen = []
    for target in ("t2", "t1"):
        for faulty, step in _cases(overwrite=target == "t1"):
            for kind in ("eio", "enospc"):
                if rank == 0:  # the checkpoint as the first save left it
                    shutil.rmtree(ckpt)
                    os.makedirs(ckpt)
                    shutil.copytree(ref1, os.path.join(ckpt, "t1"))
                    with open(os.path.join(ckpt, "latest"), "w") as f:
                        f.write("t1")
                torch.distributed.barrier()
                _C.set_save_fault_for_testing(f"{step}:{kind}" if rank == faulty else None)
                try:
                    engine.save_checkpoint(ckpt, tag=target)
                    # In the background, the failure raises on every rank at the collective wait.
                    zd.wait(every_rank=True)
                    raised = None
                except zeroflat.Error as e:
                    raised = e
                finally:
                    _C.set_save_fault_for_testing(None)
                case = f"{target}, rank {faulty}, {step}:{kind}"
                if step == "publish.remove":
                    # In the library's thread once the new tag is published: the save and
                    # wait() succeed (a warning), the old tag left to the next save's clean-up.
                    assert raised is None, f"{case}: {raised!r}"
                    torch.distributed.barrier()
                    if rank == 0:
                        assert _latest_is_whole(ckpt, [ref1, ref2]) == 1, case
                        old = os.path.join(ckpt, _C.partial_tag_name("t1"))
                        assert os.path.isdir(old), case
                        _C.finish_removals()  # the fault gone: tried again, removed
                        assert not os.path.exists(old), case
                        seen.append((case, 1))
                    torch.distributed.barrier()
                    continue
                assert raised is not None, f"{case}: the save did not fail"
                if rank == faulty:
                    assert isinstance(raised, zeroflat.IoError), f"{case}: {raised!r}"
                    assert step in str(raised) or step.startswith("write"), f"{case}: {raised}"
                else:
                    assert f"failed on rank {faulty}" in str(raised), f"{case}: {raised}"
                torch.distributed.barrier()
                if rank == 0:
                    seen.append((case, _latest_is_whole(ckpt, [ref1, ref2])))
                    if not step.startswith(("publish", "latest")):
                        assert not os.path.exists(os.path.join(ckpt, "t2")), case
                torch.distributed.barrier()
    # After every fault the next save succeeds and is whole, leftovers removed.
    engine.save_checkpoint(ckpt, tag="t1")
    zd.wait(every_rank=True)
    torch.distributed.barrier()
    if rank == 0:
        assert _latest_is_whole(ckpt, [ref1, ref2]) == 1
        assert not [n for n in os.listdir(ckpt) if n.startswith(".zeroflat-")]
        result.put(seen)
    _done()


@pytest.mark.parametrize("stage,background", [(2, True), (3, False)])
def test_a_fault_at_every_step_of_a_save_never_costs_the_last_complete_checkpoint(tmp_path, stage,
                                                                                   background):
    """ZeRO-2 saved in the background (the failure raised at the collective wait), ZeRO-3 saved
    blocking (raised by save_checkpoint itself): the same writer, the same steps."""
    import multiprocessing

    result = multiprocessing.get_context("forkserver").Manager().Queue()
    start_ranks(_faults_worker, 2, str(tmp_path), stage, background, result)
    seen = result.get(timeout=5)
    assert len(seen) == 2 * (len(_cases(False)) + len(_cases(True)))
    # Before the tag is published, latest gives the first save; after, whichever it names.
    for case, which in seen:
        if "publish" not in case and "latest" not in case:
            assert which == 0, case


def _module_state(engine, stage):
    """The module's parameters and buffers, whole (a ZeRO-3 engine's gathered), as fp32."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                           enabled=stage == 3):
        state = {k: v.float().clone() for k, v in engine.module.state_dict().items()}
    assert all(v.numel() for v in state.values())
    return state


def _restored_state(engine, stage):
    """What a load restored on this rank: a ZeRO-3 engine's own partitions (each parameter's
    16-bit partition, the fp32 flat partitions), else the module's state. A ZeRO-3 module's
    gathered state is not used: the parameters it keeps whole (below its persistence threshold)
    are gathered again after a load, and releases 0.14 to 0.16 under the CPU accelerator at
    times hand back other bytes for some of them, whichever checkpoint they load."""
    if stage != 3:
        return _module_state(engine, stage)
    state = {f"16/{n}": p.ds_tensor.detach().clone() for n, p in engine.module.named_parameters()}
    for i, flat in enumerate(engine.optimizer.fp32_partitioned_groups_flat):
        state[f"32/{i}"] = flat.detach().clone()
    return state


def _plain_load_worker(rank, world, port, ckpts, stage, result):
    """Plain DeepSpeed loads each of ``ckpts`` into an engine of its own (one process start)."""
    # Releases before 0.16 load their own checkpoints with torch.load's old default
    # (weights_only=False), which torch 2.6 changed: the files are this test's own.
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    _init(rank, world, port)
    for i, ckpt in enumerate(ckpts):
        engine = _engine(stage)
        path, client = engine.load_checkpoint(ckpt)
        assert path is not None
        result.put((rank, i, client.get("epoch"), _restored_state(engine, stage)))
    _done()


def _resume_worker(rank, world, port, ckpts, stage, result):
    """zeroflat's resume of each of ``ckpts`` (saved at 2 ranks), an engine of its own each."""
    import zeroflat.deepspeed as zd

    _init(rank, world, port)
    zd.install()
    for ckpt in ckpts:
        engine = _engine(stage)
        engine.load_checkpoint(ckpt)
        assert zd.stats["resumes"] and zd.stats["resumes"][-1]["saved_world"] == 2
        result.put(_module_state(engine, stage))
    _done()


def _save_worker(rank, world, port, ours, theirs, stage):
    import zeroflat.deepspeed as zd

    _init(rank, world, port)
    zd.install()
    engine = _engine(stage)
    train_steps(engine, rank, 2)
    # ZeRO-3: the parameters every rank keeps whole are gathered again after the drop-in's save
    # by the resume's one all-gather (zeroflat's epilogue): each one its ranks' partitions end
    # to end. (Not compared with their values before the save: before 0.19, DeepSpeed's gather
    # after a step waits on its last gloo handle only, so those may still be arriving.)
    from zeroflat import _resume_family
    epilogues = []
    own_epilogue = _resume_family.Zero3.epilogue

    def epilogue(self):
        epilogues.append(own_epilogue(self))
        return epilogues[-1]

    _resume_family.Zero3.epilogue = epilogue
    persistent = list(getattr(engine.optimizer, "persistent_parameters", None) or [])
    assert (stage == 3) == bool(persistent), len(persistent)
    # The same engine saved by the drop-in, then by DeepSpeed's own save (a ZeRO-3 engine's
    # padding is not the same from run to run: its flat groups are made uninitialized).
    for out, dropin in ((ours, True), (theirs, False)):
        if not dropin:
            zd.uninstall()
        engine.save_checkpoint(out, tag="t1", client_state={"epoch": 3})
        engine.save_checkpoint(out, tag="t1", client_state={"epoch": 4})  # over itself
        assert "checkpoint_event_epilogue" not in vars(engine.optimizer)
        for p in persistent if dropin else []:
            parts = [torch.empty_like(p.ds_tensor) for _ in range(world)]
            torch.distributed.all_gather(parts, p.ds_tensor)
            whole = torch.cat(parts)[:p.ds_numel].view(p.ds_shape)
            assert p.ds_status.name == "AVAILABLE" and _same_bits(p.data, whole), p.ds_shape
    assert epilogues == ([True, True] if stage == 3 else []), epilogues
    _resume_family.Zero3.epilogue = own_epilogue
    # Where each write's time went: the phases add up to no more than it, and only the first
    # rank publishes.
    for s in zd.stats["saves"]:
        phases = s["write_phases"]
        assert sorted(phases) == ["publish", "sync", "wait", "write"], phases
        assert min(phases.values()) >= 0 and sum(phases.values()) <= s["write_seconds"], s
        assert (phases["publish"] > 0) == (rank == 0), phases
    # the first rank publishes: it knows what the rename replaced
    assert [s["replaced"] for s in zd.stats["saves"]] == ([False, True] if rank == 0
                                                          else [False, False])
    # ZeRO-1/2: the second rank wrote its part of the 16-bit model file (one per flat group).
    parts = [s["parts"] for s in zd.stats["saves"]]
    assert parts == ([0, 0] if rank == 0 or stage == 3 else [parts[0]] * 2) and \
        (rank == 0 or stage == 3 or parts[0] >= 1), parts
    _done()


@pytest.mark.parametrize("stage", [*STAGES, "round_robin", "bf16_optimizer"])
def test_the_drop_ins_save_is_deepspeeds_folder_and_loads_in_plain_deepspeed(tmp_path, stage,
                                                                            monkeypatch):
    import multiprocessing

    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    start_ranks(_save_worker, 2, ours, theirs, stage)
    assert _files(ours) == _files(theirs)  # the same files, 'latest' and the recovery script too
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # releases before 0.16
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.utils.tensor_fragment import fragment_address
    for name in _files(os.path.join(ours, "t1")):
        if name.endswith(".pt"):  # a zip archive whose every CRC is right (ranks' parts too)
            with zipfile.ZipFile(os.path.join(ours, "t1", name)) as z:
                assert z.testzip() is None, name
        a = torch.load(os.path.join(ours, "t1", name), weights_only=False)
        b = torch.load(os.path.join(theirs, "t1", name), weights_only=False)
        _same_values(a, b, name)
        # Every file of the drop-in's loads without running anything but DeepSpeed's classes.
        with torch.serialization.safe_globals([LossScaler, fragment_address]):
            torch.load(os.path.join(ours, "t1", name), weights_only=True)
    # DeepSpeed's own consolidation reads it as its own (BF16_Optimizer's files, which hold no
    # ZeRO stage, it refuses both ways).
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    if stage == "bf16_optimizer":
        for folder in (ours, theirs):
            with pytest.raises(ValueError, match="not a zero checkpoint"):
                get_fp32_state_dict_from_zero_checkpoint(folder)
    else:
        fp32_ours = get_fp32_state_dict_from_zero_checkpoint(ours)
        fp32_theirs = get_fp32_state_dict_from_zero_checkpoint(theirs)
        assert fp32_ours.keys() == fp32_theirs.keys()
        for name, value in fp32_theirs.items():
            assert _same_bits(fp32_ours[name], value), name
    with open(os.path.join(ours, "latest")) as f:
        assert f.read() == "t1"
    result = multiprocessing.get_context("forkserver").Manager().Queue()
    start_ranks(_plain_load_worker, 2, [ours, theirs], stage, result)
    loaded = {}
    for _ in range(4):
        rank, which, epoch, state = result.get(timeout=5)
        assert epoch == 4
        loaded[rank, which] = state
    for rank in range(2):
        state, expected = loaded[rank, 0], loaded[rank, 1]
        assert state.keys() == expected.keys() and expected
        for name, value in expected.items():
            assert _same_bits(state[name], value), (rank, name)
    if stage in STAGES and "ZEROFLAT_DEEPSPEED_RELEASE" not in os.environ:
        # DeepSpeed's ds_to_universal makes the same universal checkpoint of both.
        made = []
        for folder in (ours, theirs):
            out = f"{folder}-universal"
            done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                   "--input_folder", os.path.join(folder, "t1"),
                                   "--output_folder", out, "--num_extract_workers", "1",
                                   "--num_merge_workers", "1", "--inject_missing_state"],
                                  capture_output=True, text=True, timeout=600)
            made.append((done.returncode, _files(out) if os.path.isdir(out) else set()))
            assert done.returncode == 0, done.stderr[-3000:]
        assert made[0] == made[1] and made[0][1], made
        for name in made[0][1]:
            if name.endswith(".pt"):
                _same_values(torch.load(os.path.join(f"{ours}-universal", name),
                                        weights_only=False),
                             torch.load(os.path.join(f"{theirs}-universal", name),
                                        weights_only=False), name)
        # zeroflat's resume at another world size (1 rank) reads both the same way.
        start_ranks(_resume_worker, 1, [ours, theirs], stage, result)
        resumed = result.get(timeout=5)
        expected = result.get(timeout=5)
        assert resumed.keys() == expected.keys()
        for name, value in expected.items():
            assert _same_bits(resumed[name], value), name


def _killed_worker(rank, world, port, out, stage, faulty, step):
    import zeroflat.deepspeed as zd
    from zeroflat import _C, _save

    _init(rank, world, port)
    zd.install()
    _save.WAIT_SECONDS = 120.0  # the first rank's wait for a rank killed
    engine = _engine(stage)
    train_steps(engine, rank, 1)
    engine.save_checkpoint(out, tag="t1")
    zd.wait(every_rank=True)  # published before the fault is armed (it would act on this write)
    train_steps(engine, rank, 1, seed=200)
    if rank == faulty:
        _C.set_save_fault_for_testing(f"{step}:kill")
    engine.save_checkpoint(out, tag="t1")
    zd.wait()  # the faulty rank dies in the background write; the other with it
    os.kill(os.getpid(), signal.SIGKILL)


def _tags_worker(rank, world, port, out, result):
    import deepspeed.comm as ds_comm

    import zeroflat.deepspeed as zd

    _init(rank, world, port)
    engine = _engine(2)
    train_steps(engine, rank, 1)
    zd.install()
    ds_barrier = ds_comm.barrier
    # One save: DeepSpeed's barriers and its tag check's all-reduces are not made (the
    # snapshot's agreement checks the tag); the drop-in's own collectives are counted.
    counts = {"barrier": 0, "all_reduce": 0, "tag check": 0}
    theirs = (torch.distributed.barrier, torch.distributed.all_reduce,
              type(engine)._checkpoint_tag_validation)

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    torch.distributed.barrier = counted("barrier", theirs[0])
    torch.distributed.all_reduce = counted("all_reduce", theirs[1])
    type(engine)._checkpoint_tag_validation = counted("tag check", theirs[2])
    seen = []
    try:
        for tag in ("t", "t2"):
            engine.save_checkpoint(os.path.join(out, "same"), tag=tag)
            seen.append(dict(counts))
            counts.update({k: 0 for k in counts})
            zd.wait()
    finally:
        torch.distributed.barrier, torch.distributed.all_reduce = theirs[:2]
        type(engine)._checkpoint_tag_validation = theirs[2]
    zd.wait(every_rank=True)
    assert ds_comm.barrier is ds_barrier  # put back
    # The snapshot's agreement, and at the first save the first rank's layout of the model
    # file (the second save's is the same: the other ranks still hold it).
    assert seen == [{"barrier": 0, "all_reduce": 2, "tag check": 0},
                    {"barrier": 0, "all_reduce": 1, "tag check": 0}], seen
    # DeepSpeed's recovery scripts, copied after the agreement: a copy that fails is said, and
    # the checkpoint is published all the same.
    scripts = type(engine)._copy_recovery_script

    def refused(self, folder):
        raise PermissionError(f"no writing in {folder}")

    type(engine)._copy_recovery_script = refused
    try:
        engine.save_checkpoint(os.path.join(out, "same"), tag="t3")
        zd.wait(every_rank=True)
    finally:
        type(engine)._copy_recovery_script = scripts
    if rank == 0:
        with open(os.path.join(out, "same", "latest")) as f:
            assert f.read() == "t3"
    # Tags that differ between the ranks: DeepSpeed's own save under its default (WARN), each
    # rank's files under its own tag; an AssertionError on every rank under FAIL, nothing saved.
    warned = os.path.join(out, "warn")
    assert engine.save_checkpoint(warned, tag=f"tag-{rank}") is True
    assert zd.stats["save_fallbacks"] == ["the ranks' checkpoint tags differ"]
    engine.checkpoint_tag_validation_fail = lambda: True
    try:
        with pytest.raises(AssertionError, match="not every rank's"):
            engine.save_checkpoint(os.path.join(out, "fail"), tag=f"tag-{rank}")
    finally:
        del engine.checkpoint_tag_validation_fail
    torch.distributed.barrier()
    if rank == 0:
        result.put({name: sorted(_files(os.path.join(out, name)))
                    for name in ("same", "warn", "fail") if os.path.exists(os.path.join(out, name))})
    _done()


def test_tags_are_checked_by_the_snapshot_agreement_and_a_difference_is_deepspeeds_own(tmp_path):
    """The drop-in's save makes one agreement where DeepSpeed makes two barriers and two
    all-reduces; where the ranks' tags differ, what DeepSpeed's tag_validation does."""
    import multiprocessing

    result = multiprocessing.get_context("forkserver").Manager().Queue()
    start_ranks(_tags_worker, 2, str(tmp_path), result)
    folders = result.get(timeout=5)
    assert "fail" not in folders or folders["fail"] == [], folders
    assert [n for n in folders["same"] if not n.endswith(".py")] == ["latest"] + [
        f"{t}/{n}" for t in ("t", "t2", "t3") for n in ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                 "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                                 "mp_rank_00_model_states.pt")], folders
    assert "zero_to_fp32.py" in folders["same"], folders  # DeepSpeed's recovery script
    warn = [n for n in folders["warn"] if not n.endswith(".py")]
    assert "latest" in warn and "tag-0/mp_rank_00_model_states.pt" in warn, warn
    assert "tag-1/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in warn, warn
    assert not any(".zeroflat-" in n for n in folders["warn"]), folders


@pytest.mark.parametrize("faulty,step", [(1, "write.1"), (0, "publish.exchange"),
                                         (0, "latest.rename")])
def test_a_rank_killed_during_a_save_over_the_last_tag_leaves_it_loadable(tmp_path, faulty, step):
    import multiprocessing

    out = str(tmp_path / "ckpt")
    with pytest.raises(Exception) as raised:
        start_ranks(_killed_worker, 2, out, 2, faulty, step)
    assert os.path.exists(os.path.join(out, "latest")), (os.listdir(out), raised.value)
    with open(os.path.join(out, "latest")) as f:
        assert f.read() == "t1"
    result = multiprocessing.get_context("forkserver").Manager().Queue()
    start_ranks(_plain_load_worker, 2, [out], 2, result)
    assert result.get(timeout=5) is not None


def _background_worker(rank, world, port, out, stage, result):
    import zeroflat
    import zeroflat.deepspeed as zd
    from zeroflat import _C, _save, _snapshot

    _init(rank, world, port)
    engine = _engine(stage)
    train_steps(engine, rank, 1)
    theirs, ours = os.path.join(out, "theirs"), os.path.join(out, "ours")
    engine.save_checkpoint(theirs, tag="t1")  # DeepSpeed's own, before the drop-in is there
    zd.install()
    engine.save_checkpoint(ours, tag="t1")
    # The save returned with its state snapshotted: the steps change it while it is written.
    train_steps(engine, rank, 2, seed=300)
    zd.wait(every_rank=True)
    capacity = _save._staging.capacity
    # A failure in the background raises at the next save, on every rank; nothing published.
    if rank == 1:
        _C.set_save_fault_for_testing("write.1:eio")
    engine.save_checkpoint(ours, tag="t2")
    train_steps(engine, rank, 1, seed=400)
    with pytest.raises(zeroflat.Error) as raised:
        engine.save_checkpoint(ours, tag="t3")
    _C.set_save_fault_for_testing(None)  # disarmed once the write it acts on is over
    if rank == 1:
        assert isinstance(raised.value, zeroflat.IoError), raised.value
        assert "zero_pp_rank_1" in str(raised.value) and "write.1" in str(raised.value)
    else:
        assert "failed on rank 1" in str(raised.value), raised.value
    assert not os.path.exists(os.path.join(ours, "t2"))
    with open(os.path.join(ours, "latest")) as f:
        assert f.read() == "t1"
    # A save whose second rank is slow: the first rank reports its progress while it waits.
    reports = []
    os.environ["ZEROFLAT_PROGRESS_SECONDS"] = "0.05"
    zd.install(progress=reports.append)
    if rank == 1:
        _C.set_save_fault_for_testing("marker:delay")
    engine.save_checkpoint(ours, tag="slow")
    zd.wait(every_rank=True)
    _C.set_save_fault_for_testing(None)
    del os.environ["ZEROFLAT_PROGRESS_SECONDS"]
    if rank == 0:
        assert reports and all("in the background" in p.what and p.line.startswith("wrote ")
                               for p in reports), reports
        assert "waiting for the other ranks' files" in reports[-1].line, reports[-1]
    # Then saves go on, in the same staging memory (it never grows for the same state).
    for i in range(4):
        engine.save_checkpoint(ours, tag=f"s{i}")
        train_steps(engine, rank, 1, seed=500 + i)
        assert _save._staging.capacity == capacity
    zd.wait()
    # Host memory too short for the staging (the margin above the probe's free memory): the
    # files are written from the tensors themselves first, and the call returns once their data
    # is written (a wave), before the save is published (held back here by half a second at
    # the first rank's sync of the folder): a step right after the call does not reach them.
    kept, _save._staging = _save._staging, _snapshot.Staging()  # as at a process's first save
    _save.STAGING_MARGIN = 1 << 62
    at_call = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if rank == 0:
        _C.set_save_fault_for_testing("sync_tree:delay")
    try:
        engine.save_checkpoint(ours, tag="direct")
        # The host tensors were written in place, not staged.
        assert _save._staging.last_need < kept.last_need, (_save._staging.last_need,
                                                           kept.last_need)
        if rank == 0:
            with open(os.path.join(ours, "latest")) as f:
                assert f.read() == "s3"  # returned before the save was published
        train_steps(engine, rank, 1, seed=700)
        zd.wait(every_rank=True)
    finally:
        _C.set_save_fault_for_testing(None)
        _save.STAGING_MARGIN = 256 << 20
        _save._staging = kept
    if rank == 0:
        with open(os.path.join(ours, "latest")) as f:
            assert f.read() == "direct"
    torch.distributed.barrier()
    if stage != 3:  # ZeRO-3's module files hold placeholders
        direct = torch.load(os.path.join(ours, "direct", "mp_rank_00_model_states.pt"),
                            weights_only=False)["module"]
        assert any(not torch.equal(v, engine.module.state_dict()[k]) for k, v in at_call.items())
        for name, value in at_call.items():
            assert torch.equal(direct[name], value), name
    outcomes = [s for s in zd.stats["saves"] if s["dir"] == ours]
    assert [s["error"] is None for s in outcomes] == [True, False] + [True] * 6
    assert all(s["blocking_seconds"] > 0 and s["bytes"] > 0 for s in outcomes if not s["error"])
    if rank == 0:
        result.put(sorted(os.listdir(ours)))
    _done()


@pytest.mark.parametrize("stage", STAGES)
def test_a_save_in_the_background_holds_the_state_at_the_call_and_its_failure_raises_next(
        tmp_path, stage, monkeypatch):
    import multiprocessing

    result = multiprocessing.get_context("forkserver").Manager().Queue()
    start_ranks(_background_worker, 2, str(tmp_path), stage, result)
    names = result.get(timeout=5)
    assert [n for n in names if not n.endswith(".py")] == ["direct", "latest", "s0", "s1", "s2",
                                                             "s3", "slow", "t1"], names
    ours, theirs = str(tmp_path / "ours" / "t1"), str(tmp_path / "theirs" / "t1")
    assert _files(ours) == _files(theirs)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    for name in _files(ours):
        _same_values(torch.load(os.path.join(ours, name), weights_only=False),
                     torch.load(os.path.join(theirs, name), weights_only=False), name)


def _takes_direct_writes(folder):
    """Whether the file system under ``folder`` takes an O_DIRECT write of an aligned page."""
    import mmap

    path = os.path.join(folder, "probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        page = mmap.mmap(-1, 4096)  # page-aligned
        return os.pwrite(fd, page, 0) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)
        os.remove(path)


def test_large_tensors_are_staged_at_their_place_in_a_page_and_written_direct(tmp_path):
    """A save's staging places each tensor of 1 MiB or more at its data's place within a 4 KiB
    page of its file, so that the writer writes its whole pages with O_DIRECT from the staging
    (where the file system takes it); the file is the same torch file, and the staging does not
    grow from save to save."""
    from zeroflat import _C, _snapshot

    state = {"big": torch.randn(1 << 20), "odd": torch.arange(600_013, dtype=torch.int16),
             "small": torch.ones(5), "view": torch.randn(3, 1 << 19)[1]}
    staging = _snapshot.Staging()
    capacities, direct = [], []
    for tag in ("a", "b"):
        staging.begin(pinned=False)
        snap = _snapshot.Snapshot(staging)
        partial = _C.partial_tag_name(tag)
        os.makedirs(tmp_path / partial)
        snap.add({**state, "tag": tag * 1000}, str(tmp_path / partial / "state.pt"))
        staging.end()
        capacities.append(staging.capacity)
        (path, pickled, records), = snap.files
        offsets = _C.torch_file_data_offsets((path, pickled, records))
        expect = 0
        for (key, address, size, _), off in zip(records, offsets):
            if size >= _C.SAVE_DIRECT_MIN_BYTES:
                assert address % 4096 == off % 4096, (key, address, off)
                expect += (off + size) // 4096 * 4096 - (off + 4095) // 4096 * 4096
        writer = _C.BackgroundSave()
        files = snap.files
        writer.start(str(tmp_path), partial, tag, 0, 1, True, "normal", 60.0, files, snap.parts)
        outcome = writer.wait()
        assert not outcome["error"] and outcome["published"], outcome
        direct.append((outcome["direct_bytes"], expect))
        loaded = torch.load(tmp_path / tag / "state.pt", weights_only=True)
        assert loaded["tag"] == tag * 1000
        for name, value in state.items():
            assert torch.equal(loaded[name], value), name
    assert capacities[0] == capacities[1], capacities
    takes = _takes_direct_writes(str(tmp_path))
    assert all(got == (want if takes else 0) and want > 3 << 20 for got, want in direct), direct
    # ZEROFLAT_SAVE_IO=buffered: no phases, every byte through the page cache.
    probe = ("from zeroflat import _C, _snapshot; import torch; s = _snapshot.Staging(); "
             "s.begin(False); n = _snapshot.Snapshot(s); n.add({'w': torch.ones(1 << 20)}, "
             "'/nonexistent/x.pt'); print(_C.save_direct_io(), "
             "n.files[0][2][0][1] - s._segments[0].data_ptr())")
    for value, says in (("buffered", "False 0\n"), ("direct", "True")):
        env = {**os.environ, "ZEROFLAT_SAVE_IO": value}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, check=True).stdout
        assert out.startswith(says), (value, out)
    env = {**os.environ, "ZEROFLAT_SAVE_IO": "sometimes"}
    bad = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "ZEROFLAT_SAVE_IO='sometimes'" in bad.stderr, bad.stderr


def _exit_worker(rank, world, port, out):
    import zeroflat.deepspeed as zd
    from zeroflat import _C

    _init(rank, world, port)
    engine = _engine(2)
    train_steps(engine, rank, 1)
    zd.install()
    _C.set_save_fault_for_testing("write.0:delay")  # the write outlives the rank's last line
    engine.save_checkpoint(out, tag="t1")
    # The rank returns without zeroflat.deepspeed.wait(): torch's spawn ends the process
    # through multiprocessing, whose os._exit skips atexit; the save is still published.


def test_ranks_that_return_without_waiting_still_publish_their_save(tmp_path):
    """Ranks started by torch.multiprocessing return right after save_checkpoint, their write
    still running: the processes' ends wait for it (multiprocessing's finalizers, not only
    atexit), and the tag is published, whole."""
    out = str(tmp_path / "ck")
    start_ranks(_exit_worker, 2, out)
    with open(os.path.join(out, "latest")) as f:
        assert f.read() == "t1"
    assert not [n for n in os.listdir(out) if n.startswith(".zeroflat-")]
    for name in os.listdir(os.path.join(out, "t1")):
        torch.load(os.path.join(out, "t1", name), map_location="cpu", weights_only=False)
