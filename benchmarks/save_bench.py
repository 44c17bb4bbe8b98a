#!/usr/bin/env python3
"""A DeepSpeed checkpoint save: the drop-in's (returns once snapshotted, written in the
background) beside DeepSpeed's own save_checkpoint, DCP's save and async_save of the same bytes,
a plain memcpy of them (the floor of a snapshot) and a plain write + fsync of them (the disk's
ceiling). Each round runs in fresh processes (--ranks of them, gloo on the CPU); the median of
--rounds with the range is printed, and the ratios the save is held to.

The shape is on the command line: --state-mb is each rank's optimizer state (AdamW under ZeRO-2
or ZeRO-3 in bf16: the fp32 master, exp_avg and exp_avg_sq partitions, 12 bytes per parameter
over the ranks); the model is --width-wide square Linear layers, as many as that takes.

Per rank, in each round (after one warm-up step):
  steps      --steps training steps, no save running (the step's time without a write)
  deepspeed  DeepSpeed's own save_checkpoint: the call, then its files fsync'd (durable);
             last in the round, the same through DeepSpeed's own checkpoint writers
             (--deepspeed-writers: "fast", written in the call; "decoupled", handed to a
             writer process without a copy and committed right after the call, as the next
             step would: the training is held for the call and that commit), where they run
  ceiling    the same bytes as one file: write + fsync, through the page cache and with
             O_DIRECT (64 MiB writes); the ceiling is the faster of the two
  beside     --steps steps while a thread at idle priority writes + fsyncs those bytes (what
             the steps feel of the disk's write itself, whoever writes)
  floor      a memcpy of the same bytes into memory already touched (the faster of
             torch's copy_ and the C library's memcpy, each the median of five)
  dcp        torch.distributed.checkpoint save of the rank's tensors (a dict of them), and
             async_save's call (a thread; a process where the release has it)
  zeroflat   the drop-in: the first save's call (fresh staging), --steps steps right before
             a second save, that save's call (the staging reused) and the steps while it is
             written (held to the steps right before: the same process, the same memory), and
             a third save's call to the end of zeroflat.deepspeed.wait(every_rank=True)
             (durable and published), with where each rank's time went: the call, then
             the background write's phases (its files' data, their fsync, the first rank's
             wait for the others' files, its publication)
  own work   --saves calls of DeepSpeed's save_checkpoint with nothing saved, run as the
             drop-in runs it (its state dicts; under ZeRO-3 the parameters partitioned before
             and the persistent ones gathered after): the part of the call that is neither
             the copies nor the ranks' agreement
  memory     --saves more saves (a step between them), each waited for before the next:
             the staging's size, the resident memory after each (and the C library's heap
             in use, apart from the free memory it keeps), and each one's call (their
             median is the blocking held to the floor: both medians of repeated copies;
             under FSDP2 also the part of each call in zeroflat.dcp.Writer.stage, the copy,
             the rest being DCP's async_save itself)
  waves      two saves with the staging capped at half the rank's bytes
             (install(save_staging_bytes=...)): the second one's call (the files that do not
             fit written from the tensors before it returns) and call to published
  priority   with --priorities idle,low,normal: for each writer priority in turn, in the same
             process, a save's call to published (no steps beside it) and --steps steps while
             a save is written against --steps steps right before it: the trade-off between
             the durable time and the steps, side by side

The target folder's pages are dropped before each write where the machine allows it
(/proc/sys/vm/drop_caches as root), and every folder is removed after its measurement.

With --stages fsdp2 the model is FSDP2's (fully_shard per layer, fp32 AdamW, the same
layers) and the state is get_state_dict's: DCP's own save and async_save (in fresh processes
of their own, each round) beside zeroflat.dcp.Writer under async_save (its call, the steps
while it writes, call to published and where it went; the staging's size and the resident
memory over --saves more saves), no DeepSpeed rows.

  python benchmarks/save_bench.py --ranks 1,2 --stages 2,3,fsdp2 --state-mb 512 --rounds 3
"""
import argparse
import contextlib
import ctypes
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def _rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _heap_in_use():
    """The C library's heap in use (glibc's mallinfo2: allocated, not the free memory it keeps
    mapped), or None where there is no mallinfo2. Resident memory also counts what the heap
    keeps free after the training's own short-lived buffers, which a save does not own."""
    try:
        import ctypes

        class _Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]
        f = ctypes.CDLL(None).mallinfo2
        f.restype = _Info
        info = f()
        return info.uordblks + info.hblkhd
    except (AttributeError, OSError):
        return None


def _drop_caches():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError:
        pass


def _files_of(folder, rank, world):
    """The files of a DeepSpeed tag folder this rank wrote (rank 0: the model files too)."""
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".pt"):
            continue
        if "optim_states" in name:
            if f"rank_{rank}_" in name:
                out.append(os.path.join(folder, name))
        elif "model_states" in name:
            if name.startswith("zero_pp_rank_"):  # ZeRO-3: one per rank
                if f"rank_{rank}_" in name:
                    out.append(os.path.join(folder, name))
            elif rank == 0:
                out.append(os.path.join(folder, name))
    return out


def _fsync(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _barrier_time(start):
    dist.barrier()
    return time.perf_counter() - start


def _saves_loop(out, n, before, call):
    """``n`` saves, each after ``before(i)`` and a barrier (so that no rank's call takes in
    another's skew out of its steps); ``call(i, before(i)'s value)`` saves and returns what
    waits for its write. Records the calls' median (``zeroflat_steady``) and the resident
    memory after each save."""
    rss, heap, calls = [], [], []
    for i in range(n):
        ready = before(i)
        dist.barrier()
        start = time.perf_counter()
        wait = call(i, ready)
        calls.append(time.perf_counter() - start)
        wait()
        rss.append(_rss())
        heap.append(_heap_in_use())
    out["rss"] = rss
    out["heap"] = heap
    out["zeroflat_steady"] = statistics.median(calls)


def _engine(stage, width, layers):
    import deepspeed

    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "zero_force_ds_cpu_optimizer": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _steps(engine, n, width, seed):
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for _ in range(n):
        x = torch.randn(2, width, generator=g).to(torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    return time.perf_counter() - start


def _worker(rank, world, port, args, stage, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      CROSS_RANK="0", CROSS_SIZE="1")  # one node, as DeepSpeed's launcher says
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    per_layer = args.width * (args.width + 1)
    layers = max(1, round(args.state_mb * 2**20 * world / 12 / per_layer))
    if stage in ("fsdp2", "fsdp2-dcp"):
        _fsdp2_worker(rank, world, args, layers, queue, dcp_only=stage == "fsdp2-dcp")
        return
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    engine = _engine(stage, args.width, layers)
    _steps(engine, 1, args.width, 0)
    out = {}
    root = args.dir
    out["steps"] = _steps(engine, args.steps, args.width, 1)

    # DeepSpeed's own save.
    folder = os.path.join(root, "deepspeed")
    _drop_caches()
    dist.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(folder, tag="t")
    out["deepspeed_call"] = time.perf_counter() - start
    mine = _files_of(os.path.join(folder, "t"), rank, world)
    _fsync(mine)
    out["deepspeed_durable"] = _barrier_time(start)
    out["bytes"] = sum(os.path.getsize(p) for p in mine)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)

    _floor_and_ceiling(out, root, rank)
    out["steps_disk"] = _steps_beside_disk(lambda: _steps(engine, args.steps, args.width, 1),
                                           out["bytes"], root, rank)

    # DCP, the rank's tensors as a plain dict (each rank its own keys).
    state = {}
    tensors = [p.detach() for p in engine.module.parameters()]
    flat = getattr(engine.optimizer, "single_partition_of_fp32_groups", None) or \
        getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or []
    for i, t in enumerate(flat):
        state[f"rank{rank}.master.{i}"] = t.detach()
        opt = engine.optimizer.optimizer.state.get(t, {})
        for name in ("exp_avg", "exp_avg_sq"):
            if name in opt:
                state[f"rank{rank}.{name}.{i}"] = opt[name]
    if rank == 0 or stage == 3:
        for i, t in enumerate(tensors):
            state[f"rank{rank}.model.{i}"] = t
    _dcp_rows(state, out, root, rank, args.dcp_executors)
    del state
    _zeroflat_deepspeed(engine, out, root, args)
    # Last: these engines share the optimizer's tensors with a process or leave the model
    # file to every rank; the drop-in leaves such engines' saves to DeepSpeed.
    for kind in args.deepspeed_writers:
        _deepspeed_writer(engine, out, root, kind)
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def _local_bytes(state_dict):
    """The bytes of a state dict's tensors on this rank (a DTensor's local shard's)."""
    from zeroflat import _dcp_writer

    return sum(_dcp_writer._local(t).numel() * t.element_size()
               for t in _dcp_writer._tensors(state_dict))


def _fsdp2_worker(rank, world, args, layers, queue, dcp_only=False):
    """FSDP2 (fully_shard per layer, AdamW, fp32): zeroflat.dcp.Writer's saves, the floor and the
    ceiling of the rank's bytes; with ``dcp_only``, in processes of their own, DCP's own save and
    async_save of the same state (run in zeroflat's processes, before its saves, they left the
    process so that the first collective of zeroflat's next save took 0.13 s longer at 1 rank;
    run after, DCP's own save took half as long again: each system in a fresh process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import zeroflat.dcp
    from zeroflat import _dcp_writer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def steps(n, seed):
        g = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        for _ in range(n):
            loss = model(torch.randn(2, args.width, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return time.perf_counter() - start

    def state():
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    steps(1, 0)
    out = {"steps": steps(args.steps, 1)}
    sd = state()
    out["bytes"] = _local_bytes(sd)
    root = args.dir
    if dcp_only:
        _dcp_rows(sd, out, root, rank, args.dcp_executors)
        queue.put((rank, {k: v for k, v in out.items() if k.startswith("dcp_")}))
        dist.barrier()
        dist.destroy_process_group()
        return
    _floor_and_ceiling(out, root, rank)
    out["steps_disk"] = _steps_beside_disk(lambda: steps(args.steps, 1), out["bytes"], root, rank)

    # The saves' collectives on a group of their own, as DCP asks of an async_save beside
    # training's collectives.
    group = dist.new_group(backend="gloo")
    folder = os.path.join(root, "zeroflat")

    def save(priority="idle"):
        """A save through zeroflat's Writer from a quiet page cache: (its future, when it began).
        The state dict is taken before the clock starts, as DCP's rows are given one."""
        _drop_caches()
        dist.barrier()
        now = state()
        start = time.perf_counter()
        return dcp.async_save(now, storage_writer=zeroflat.dcp.Writer(folder, priority=priority),
                              process_group=group), start

    future, start = save()
    future.result()
    out["zeroflat_first_durable"] = _barrier_time(start)
    steps(1, 2)
    out["steps_before"] = steps(args.steps, 1)  # the same process state, no write
    future, start = save()
    out["zeroflat_call"] = time.perf_counter() - start
    out["steps_during"] = steps(args.steps, 1)
    future.result()
    dist.barrier()
    with _writer_marks() as marks:
        future, start = save()
        call_end = time.perf_counter()
        future.result()
        done = time.perf_counter()
    out["zeroflat_durable"] = _barrier_time(start)
    # Where it went: the call, DCP's planning, the items pickled, the file written and fsync'd,
    # DCP's gathering of the results, then the .metadata and the publication (the first
    # rank's; the others wait for them) until the future completes.
    if {"write_data", "write_appended"} <= marks.keys():
        points = [start, call_end, marks["write_data"][0], marks["write_appended"][0],
                  marks["write_appended"][1]]
        points += [marks.get("finish", (points[-1],))[0], done]
        out["durable_phases_dcp"] = [b - a for a, b in zip(points, points[1:])]
    out["zeroflat_bytes"] = out["bytes"]
    staging = _dcp_writer._staging["copy"]
    out["staging"] = _local_bytes(staging)

    def steady(i, now):
        future = dcp.async_save(now, storage_writer=zeroflat.dcp.Writer(folder),
                                process_group=group)

        def wait():
            future.result()
            assert _dcp_writer._staging["copy"] is staging, "the staging was made again"
        return wait

    def before(i):
        steps(1, 10 + i)
        return state()  # taken before the clock starts, as above

    staged = []
    stage = _dcp_writer.stage

    def timed_stage(state_dict):  # zeroflat's part of the call: the copy into the staging
        start = time.perf_counter()
        try:
            return stage(state_dict)
        finally:
            staged.append(time.perf_counter() - start)

    _dcp_writer.stage = timed_stage
    try:
        _saves_loop(out, args.saves, before, steady)
    finally:
        _dcp_writer.stage = stage
    out["zeroflat_stage"] = statistics.median(staged)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
    # zeroflat_first (the first call, fresh staging) is not taken apart from its write here.
    out["zeroflat_first"] = out["zeroflat_first_durable"]

    def save_at(priority):
        def run():
            future, start = save(priority)
            return start, future.result
        return run

    _by_priority(out, args, save_at, lambda n: steps(n, 1), lambda: steps(1, 3))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def _writer_marks():
    """While inside: when zeroflat.dcp.Writer's write_data and finish and the library's
    write_appended began and ended, {name: (begin, end)} (perf_counter), the last of each."""
    from zeroflat import _dcp_writer

    marks = {}

    def timed(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                marks[name] = (begin, time.perf_counter())
        setattr(owner, name, wrapper)
        return owner, name, original

    undo = [timed(_dcp_writer.Writer, "write_data"), timed(_dcp_writer.Writer, "finish"),
            timed(_dcp_writer._C, "write_appended")]
    try:
        yield marks
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)


def _write_fsync(path, src):
    """A plain write of ``src``'s bytes to a new file, fsync'd."""
    with open(path, "wb") as f:
        f.write(memoryview(src.numpy()))
        f.flush()
        os.fsync(f.fileno())


def _steps_beside_disk(run_steps, nbytes, root, rank):
    """The steps' time while the disk alone writes the rank's bytes: a plain write + fsync of
    them by a thread at the idle priority the writer takes (what the steps feel of the write
    itself: the page cache's copy, the memory's bandwidth, the write-back)."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    path = os.path.join(root, f"beside-{rank}")

    def write():
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass
        _write_fsync(path, src)

    _drop_caches()
    dist.barrier()
    writer = threading.Thread(target=write)
    writer.start()
    took = run_steps()
    writer.join()
    os.remove(path)
    return took


def _write_fsync_direct(path, nbytes):
    """``nbytes`` (rounded up to whole 4 KiB pages) written to a new file with O_DIRECT, 64 MiB
    at a time from page-aligned memory, fsync'd; False where the file system refuses O_DIRECT."""
    piece = 64 << 20
    nbytes = (nbytes + 4095) // 4096 * 4096
    buf = mmap.mmap(-1, min(piece, nbytes))
    buf.write(b"\1" * len(buf))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except (AttributeError, OSError):
        return False
    try:
        for off in range(0, nbytes, piece):
            os.pwrite(fd, memoryview(buf)[:min(piece, nbytes - off)], off)
        os.fsync(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()
    return True


def _floor_and_ceiling(out, root, rank):
    """The disk's ceiling (write + fsync; the faster of the page cache and O_DIRECT, each the
    slowest rank's) and the memcpy floor, for the rank's bytes."""
    src = torch.empty(out["bytes"], dtype=torch.uint8)
    src.fill_(1)
    path = os.path.join(root, f"ceiling-{rank}")
    _drop_caches()
    dist.barrier()
    start = time.perf_counter()
    _write_fsync(path, src)
    out["ceiling_buffered"] = _barrier_time(start)
    os.remove(path)
    _drop_caches()
    dist.barrier()
    start = time.perf_counter()
    direct = _write_fsync_direct(path, out["bytes"])
    out["ceiling_direct"] = _barrier_time(start) if direct else float("inf")
    if os.path.exists(path):
        os.remove(path)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touched
    # The faster of torch's copy_ (its intra-op threads) and the C library's memcpy (one
    # thread; a fifth faster than a one-thread copy_ here), each the median of five: the
    # blocking it is held to is a median of repeated saves.
    memcpy = ctypes.CDLL(None).memcpy
    memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    times = {False: [], True: []}
    for use_memcpy in (False, True) * 5:
        start = time.perf_counter()
        if use_memcpy:
            memcpy(dst.data_ptr(), src.data_ptr(), src.numel())
        else:
            dst.copy_(src)
        times[use_memcpy].append(time.perf_counter() - start)
    out["floor"] = min(statistics.median(t) for t in times.values())
    del src, dst


def _dcp_rows(state, out, root, rank, executors=("thread", "process")):
    """DCP's own save of ``state`` (call to durable), and async_save's call (a thread, and a
    process where the release has it) and its end."""
    import torch.distributed.checkpoint as dcp

    folder = os.path.join(root, "dcp")
    _drop_caches()
    dist.barrier()
    start = time.perf_counter()
    dcp.save(state, checkpoint_id=folder)
    out["dcp_save"] = _barrier_time(start)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
    for kind in executors:
        folder = os.path.join(root, f"dcp-{kind}")
        kwargs = {}
        if kind == "process":
            try:
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
                kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
            except ImportError:
                continue
        _drop_caches()
        dist.barrier()
        start = time.perf_counter()
        try:
            future = dcp.async_save(state, checkpoint_id=folder, **kwargs)
        except Exception as e:  # noqa: BLE001 - a release without it
            out[f"dcp_async_{kind}_error"] = f"{type(e).__name__}: {e}"
            continue
        out[f"dcp_async_{kind}"] = time.perf_counter() - start
        result = future.result() if hasattr(future, "result") else future
        if hasattr(result, "result"):
            result.result()
        out[f"dcp_async_{kind}_durable"] = _barrier_time(start)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def _deepspeeds_own_work(engine, folder, args):
    """DeepSpeed's save_checkpoint with nothing saved, as the drop-in's call runs it (its
    checkpoint engine's save a no-op, its barriers, tag check and script copies the drop-in's):
    its state dicts and, under ZeRO-3, its partitioning of every parameter before the save and
    the drop-in's gathering of the persistent ones after it; the part of the call that is
    neither the copies nor the agreement. The median of --saves calls."""
    from zeroflat import _save

    times = []
    for i in range(args.saves):
        _steps(engine, 1, args.width, 60 + i)
        dist.barrier()
        start = time.perf_counter()
        with _save._snapshotting(engine, lambda state_dict, path: None, []), \
                _save._one_gather_epilogue(engine):
            engine.save_checkpoint(folder, tag="nothing", save_latest=False)
        times.append(time.perf_counter() - start)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return statistics.median(times)


def _deepspeed_writer(engine, out, root, kind):
    """DeepSpeed's own save_checkpoint through its checkpoint writer (its "checkpoint":
    {"writer": ...} configuration, the python writer type: the FAST type's DeepNVMe buffer is
    pinned memory, which takes an accelerator's driver): "fast" writes in the call, "decoupled"
    hands the state to a writer process and commits at the next step (here: right after the
    call, as the next step would). The call, and the call to committed and fsync'd; a writer
    this DeepSpeed lacks or that fails records why."""
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = os.path.join(root, f"deepspeed-{kind}")
    try:
        from deepspeed.runtime.model_checkpointing.config import get_checkpoint_writer_config
        from deepspeed.runtime.model_checkpointing.constants import CHECKPOINT_WRITER
    except ImportError as e:
        out[f"ds_{kind}_error"] = f"this DeepSpeed has no checkpoint writer ({e})"
        return
    writer = {"type": "python", "decoupled": kind == "decoupled", "data_parallel": "replica"}
    engine._config.checkpoint_config[CHECKPOINT_WRITER] = get_checkpoint_writer_config(
        {"writer": writer})
    engine._configure_checkpointing()
    try:
        # A first save, untimed: the writer process started and warm, as in a long run.
        engine.save_checkpoint(folder, tag="w")
        if engine.checkpoint_engine.is_decoupled():
            engine._commit_decoupled_checkpoint()
        _drop_caches()
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(folder, tag="t")
        out[f"ds_{kind}_call"] = time.perf_counter() - start
        if engine.checkpoint_engine.is_decoupled():
            engine._commit_decoupled_checkpoint()
        # What holds the training: the call, and the decoupled writer's commit, which the
        # next step waits for (it shares the live tensors with its process: no copy).
        out[f"ds_{kind}_held"] = time.perf_counter() - start
    except Exception as e:  # the same on every rank: DeepSpeed's own failure, reported
        out[f"ds_{kind}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        out.pop(f"ds_{kind}_call", None)
    else:
        tag = os.path.join(folder, "t")
        _fsync([os.path.join(tag, n) for i, n in enumerate(sorted(os.listdir(tag)))
                if i % world == rank])
        out[f"ds_{kind}_durable"] = _barrier_time(start)
    finally:
        if engine.checkpoint_engine.is_decoupled():
            engine.checkpoint_engine.cleanup()  # its writer process ended
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


def _zeroflat_deepspeed(engine, out, root, args):
    """The drop-in's save_checkpoint: first call, a call with the staging reused and the steps
    while it writes, call to published, and the memory over --saves more saves."""
    import zeroflat.deepspeed as zd
    from zeroflat import _save

    rank = dist.get_rank()
    folder = os.path.join(root, "zeroflat")
    out["deepspeed_own"] = _deepspeeds_own_work(engine, folder, args)
    zd.install()

    def save(tag):
        """A save from a quiet page cache: (when it began, its call's time)."""
        _drop_caches()
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(folder, tag=tag)
        return start, time.perf_counter() - start

    start, out["zeroflat_first"] = save("t1")
    zd.wait(every_rank=True)
    out["zeroflat_first_durable"] = _barrier_time(start)
    _steps(engine, 1, args.width, 2)
    out["steps_before"] = _steps(engine, args.steps, args.width, 1)  # the same state, no write
    start, out["zeroflat_call"] = save("t2")
    out["steps_during"] = _steps(engine, args.steps, args.width, 1)
    zd.wait(every_rank=True)
    out["zeroflat_bytes"] = zd.stats["saves"][-1]["bytes"]  # what this rank wrote
    start, _ = save("t3")
    zd.wait(every_rank=True)
    out["zeroflat_durable"] = _barrier_time(start)
    out["durable_call"] = zd.stats["saves"][-1]["blocking_seconds"]
    out["durable_phases"] = zd.stats["saves"][-1]["write_phases"]
    out["staging"] = _save._staging.capacity
    def steady(i, _):
        engine.save_checkpoint(folder, tag=f"s{i % 2}")

        def wait():
            zd.wait(every_rank=True)
            assert _save._staging.capacity == out["staging"], "the staging grew"
        return wait

    _saves_loop(out, args.saves, lambda i: _steps(engine, 1, args.width, 10 + i), steady)
    out["staging_after"] = _save._staging.capacity
    # Waves: the staging capped at half the rank's bytes; the files that do not fit are written
    # from the tensors before the call returns (the first capped save makes the staging).
    zd.install(save_staging_bytes=out["zeroflat_bytes"] // 2)
    engine.save_checkpoint(folder, tag="w0")
    zd.wait(every_rank=True)
    _steps(engine, 1, args.width, 40)
    start, out["waves_call"] = save("w1")
    zd.wait(every_rank=True)
    out["waves_durable"] = _barrier_time(start)
    zd.install(save_staging_bytes=None)

    def save_at(priority):
        def run():
            zd.install(save_priority=priority)
            start, _ = save("p")
            return start, lambda: zd.wait(every_rank=True)
        return run

    _by_priority(out, args, save_at, lambda n: _steps(engine, n, args.width, 1),
                 lambda: _steps(engine, 1, args.width, 50))
    zd.install()  # the default options again
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)


def _by_priority(out, args, save_at, run_steps, one_step):
    """For each of --priorities: a save's call to published, and the steps while one is
    written against the steps right before it (``save_at(p)()`` starts a save at priority
    ``p``: (when it began, a function that waits for it))."""
    for priority in args.priorities:
        start, wait = save_at(priority)()
        wait()
        out[f"durable_{priority}"] = _barrier_time(start)
        one_step()
        out[f"steps_before_{priority}"] = run_steps(args.steps)
        _, wait = save_at(priority)()
        out[f"steps_during_{priority}"] = run_steps(args.steps)
        wait()
        dist.barrier()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _round(world, stage, args):
    ctx = mp.get_context("spawn")
    queue = ctx.Manager().Queue()
    mp.start_processes(_worker, args=(world, _free_port(), args, stage, queue), nprocs=world,
                       start_method="spawn")
    got = dict(queue.get(timeout=60) for _ in range(world))
    if stage == "fsdp2":  # DCP's own rows in processes of their own (_fsdp2_worker)
        for rank, dcp_out in enumerate(_round(world, "fsdp2-dcp", args)):
            got[rank].update(dcp_out)
    return [got[r] for r in range(world)]


def _fmt(values, unit="s"):
    med = statistics.median(values)
    if unit == "s":
        return f"{med:8.3f} s ({min(values):.3f}-{max(values):.3f})"
    return f"{med:8.2f}x ({min(values):.2f}-{max(values):.2f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2", help="world sizes, comma-separated")
    parser.add_argument("--stages", default="2,3",
                        help="comma-separated: 2, 3 (ZeRO under DeepSpeed) and fsdp2 (DCP)")
    parser.add_argument("--state-mb", type=float, default=512,
                        help="optimizer state per rank, MiB (default 512)")
    parser.add_argument("--width", type=int, default=1024, help="the layers' width")
    parser.add_argument("--steps", type=int, default=5, help="steps timed with and without a save")
    parser.add_argument("--saves", type=int, default=20,
                        help="saves whose memory and calls are tracked (the blocking: the "
                             "median of their calls)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--priorities", default="",
                        help="writer priorities to compare side by side, comma-separated "
                        "(idle, low, normal; default: none, the rows use the default, idle)")
    parser.add_argument("--dcp-executors", default="thread,process",
                        help="DCP async_save's executors timed beside (thread, process; "
                        "comma-separated, or none: the process executor holds another copy "
                        "of the state in a process of its own, which a large state may not "
                        "leave room for)")
    parser.add_argument("--deepspeed-writers", default="fast,decoupled",
                        help="DeepSpeed's own checkpoint writers timed beside its default "
                        "engine (fast, decoupled; comma-separated, or none), with its python "
                        "writer type: its DeepNVMe type needs an accelerator's driver")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a temporary "
                        "folder under it; default: the system's temporary folder)")
    args = parser.parse_args()
    from zeroflat._common import WRITE_PRIORITIES  # the writer's own list of them

    args.priorities = [p for p in args.priorities.split(",") if p]
    args.dcp_executors = [e for e in args.dcp_executors.split(",") if e and e != "none"]
    if any(e not in ("thread", "process") for e in args.dcp_executors):
        parser.error(f"--dcp-executors: {args.dcp_executors}: each is thread or process")
    args.deepspeed_writers = [w for w in args.deepspeed_writers.split(",") if w and w != "none"]
    if any(w not in ("fast", "decoupled") for w in args.deepspeed_writers):
        parser.error(f"--deepspeed-writers: {args.deepspeed_writers}: each is fast or decoupled")
    bad = [p for p in args.priorities if p not in WRITE_PRIORITIES]
    if bad:
        parser.error(f"--priorities: {', '.join(bad)}: each is one of "
                     f"{', '.join(WRITE_PRIORITIES)}")
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="zeroflat-save-bench-", dir=args.dir)
    args.dir = base
    try:
        for stage in [s if s == "fsdp2" else int(s) for s in args.stages.split(",")]:
            for world in [int(r) for r in args.ranks.split(",")]:
                rounds = [_round(world, stage, args) for _ in range(args.rounds)]
                report(stage, world, rounds, args)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def report(stage, world, rounds, args):
    def per(key, fn=max):
        """Per round, the key over the ranks (the slowest rank's by default)."""
        if key == "ceiling":  # the faster way the disk writes them, each the slowest rank's
            return [min(x, y) for x, y in zip(per("ceiling_buffered"), per("ceiling_direct"))]
        return [fn(r[key] for r in ranks) for ranks in rounds]

    state = statistics.median(per("bytes", max))
    name = "FSDP2, zeroflat = zeroflat.dcp.Writer under async_save" if stage == "fsdp2" \
        else f"ZeRO-{stage}, zeroflat = the drop-in's save_checkpoint"
    print(f"\n{name}, {world} rank(s), AdamW, {state / 2**20:.0f} MiB written by the busiest "
          f"rank; median of {len(rounds)} fresh-process rounds (range)")
    have = lambda key: all(key in r for ranks in rounds for r in ranks)  # noqa: E731
    rows = [("memcpy of the rank's bytes (floor)", per("floor"))]
    notes = []
    if stage != "fsdp2":
        rows.append(("zeroflat: call, first save", per("zeroflat_first")))
    rows.append(("zeroflat: call, staging reused", per("zeroflat_call")))
    rows.append((f"zeroflat: call, median of {args.saves} saves", per("zeroflat_steady")))
    if have("deepspeed_own"):
        rows.append(("  DeepSpeed's own work in it (nothing saved)", per("deepspeed_own")))
    if have("zeroflat_stage"):
        rows.append(("  of it, zeroflat's staging (Writer.stage)", per("zeroflat_stage")))
    if have("deepspeed_call"):
        rows.append(("DeepSpeed save_checkpoint: call", per("deepspeed_call")))
    for kind in args.deepspeed_writers if stage != "fsdp2" else ():
        if have(f"ds_{kind}_call"):
            rows += [(f"DeepSpeed, {kind} writer: call", per(f"ds_{kind}_call"))]
            if kind == "decoupled":
                rows.append(("  the same + its commit (the next step's)", per("ds_decoupled_held")))
            rows.append((f"DeepSpeed, {kind} writer: call to fsync'd", per(f"ds_{kind}_durable")))
        else:
            why = next((r[f"ds_{kind}_error"] for ranks in rounds for r in ranks
                        if f"ds_{kind}_error" in r), "not run")
            notes.append(f"DeepSpeed, {kind} writer: did not run here: {why}")
    rows.append(("DCP save", per("dcp_save")))
    for kind in ("thread", "process"):
        if all(f"dcp_async_{kind}" in r for ranks in rounds for r in ranks):
            rows.append((f"DCP async_save ({kind}): call", per(f"dcp_async_{kind}")))
    rows += [("disk: write + fsync, page cache", per("ceiling_buffered")),
             ("disk: write + fsync, O_DIRECT", per("ceiling_direct")),
             ("disk ceiling: the faster of the two", per("ceiling")),
             ("zeroflat: call to published", per("zeroflat_durable"))]
    if have("deepspeed_durable"):
        rows.append(("DeepSpeed: call to fsync'd", per("deepspeed_durable")))
    if have("waves_call"):
        rows += [("zeroflat, staging capped at half: call", per("waves_call")),
                 ("zeroflat, staging capped at half: published", per("waves_durable"))]
    for kind in ("thread", "process"):
        if have(f"dcp_async_{kind}_durable"):
            rows.append((f"DCP async_save ({kind}): call to written",
                         per(f"dcp_async_{kind}_durable")))
    rows += [(f"{args.steps} steps, no save", per("steps")),
             (f"{args.steps} steps while the disk alone writes", per("steps_disk")),
             (f"{args.steps} steps, no save, right before", per("steps_before")),
             (f"{args.steps} steps while zeroflat writes", per("steps_during"))]
    for name, values in rows:
        print(f"  {name:42s} {_fmt(values)}")
    for note in notes:
        print(f"  {note}")
    ours = per("zeroflat_call")

    def ratio(a, b):
        return [x / y for x, y in zip(a, b)]

    print("  ratios (per round, median and range):")
    # The blocking: the median of the --saves calls against the floor's median of copies;
    # the one call beside DeepSpeed's and DCP's (each one call after dropped page caches).
    checks = [("blocking / memcpy floor", ratio(per("zeroflat_steady"), per("floor")),
               "<= 1.2"),
              ("  one call / memcpy floor", ratio(ours, per("floor")), "printed")]
    if have("deepspeed_own"):
        checks.append(("  blocking / (floor + DeepSpeed's own work)",
                       ratio(per("zeroflat_steady"), [f + d for f, d in zip(
                           per("floor"), per("deepspeed_own"))]), "printed"))
    if have("zeroflat_stage"):
        checks.append(("  staging alone / memcpy floor", ratio(per("zeroflat_stage"),
                                                                per("floor")), "printed"))
    if have("deepspeed_call"):
        checks.append(("DeepSpeed's call / zeroflat's", ratio(per("deepspeed_call"), ours),
                       "printed"))
    for kind in args.deepspeed_writers if stage != "fsdp2" else ():
        if have(f"ds_{kind}_call"):
            checks += [(f"  DeepSpeed {kind}: training held / ours",
                        ratio(per(f"ds_{kind}_held"), ours), "printed"),
                       (f"  DeepSpeed {kind}: fsync'd / our published",
                        ratio(per(f"ds_{kind}_durable"), per("zeroflat_durable")), "printed")]
    for kind in ("thread", "process"):
        if all(f"dcp_async_{kind}" in r for ranks in rounds for r in ranks):
            checks.append((f"DCP async_save ({kind}) call / zeroflat's",
                           ratio(per(f"dcp_async_{kind}"), ours), ">= 2"))
    checks += [("durable / disk ceiling", ratio(per("zeroflat_durable"), per("ceiling")),
                "<= 1.2"),
               ("steps while writing / right before", ratio(per("steps_during"),
                                                             per("steps_before")), "<= 1.2"),
               ("  the same / the first steps, no save", ratio(per("steps_during"),
                                                              per("steps")), "printed"),
               ("  the disk's write alone / no save", ratio(per("steps_disk"), per("steps")),
                "printed")]
    if have("waves_call"):
        checks.append(("waves: call / the disk's write of it all", ratio(per("waves_call"),
                                                                       per("ceiling")),
                       "printed"))
    if world > 1 and stage != "fsdp2":
        r0 = [ranks[0]["zeroflat_bytes"] / statistics.mean(r["zeroflat_bytes"]
                                                            for r in ranks[1:])
              for ranks in rounds]
        checks.append(("rank 0's bytes / the others'", r0, "<= 1.1"))
    staging = [max(r["staging"] - r["zeroflat_bytes"] - (256 << 20) for r in ranks) / 2**20
               for ranks in rounds]
    growth = [max((r["rss"][-1] - r["rss"][0]) / 2**20 if r["rss"] else 0 for r in ranks)
              for ranks in rounds]
    heap = [max((r["heap"][-1] - r["heap"][0]) / 2**20 for r in ranks)
            for ranks in rounds if all(r.get("heap") and None not in r["heap"] for r in ranks)]
    for priority in args.priorities:
        checks += [(f"priority {priority}: durable / disk ceiling",
                    ratio(per(f"durable_{priority}"), per("ceiling")), "<= 1.2"),
                   (f"priority {priority}: steps writing / before",
                    ratio(per(f"steps_during_{priority}"), per(f"steps_before_{priority}")),
                    "<= 1.2")]
    for name, values, target in checks:
        print(f"  {name:42s} {_fmt(values, 'x')}   target {target}")
    if have("durable_phases_dcp"):
        print("  call to published, per rank (ms): call | DCP's planning, the items pickled, "
              "the file, DCP's gathering, .metadata + publication")
        for rank in range(world):
            if not all("durable_phases_dcp" in ranks[rank] for ranks in rounds):
                continue
            phases = [1000 * statistics.median(ranks[rank]["durable_phases_dcp"][k]
                                               for ranks in rounds) for k in range(6)]
            print(f"    rank {rank}: {phases[0]:6.0f} | "
                  + ", ".join(f"{v:.0f}" for v in phases[1:]))
    if have("durable_phases"):
        # Where the durable save's time went, per rank (the median over the rounds): the call,
        # then the background write's phases (save.h: SaveOutcome).
        print("  call to published, per rank (ms): call | write, sync, wait, publish")
        for rank in range(world):
            med = lambda f: 1000 * statistics.median(f(ranks[rank]) for ranks in rounds)  # noqa: E731
            phases = [med(lambda r, k=k: r["durable_phases"][k])
                      for k in ("write", "sync", "wait", "publish")]
            print(f"    rank {rank}: {med(lambda r: r['durable_call']):6.0f} | "
                  + ", ".join(f"{v:.0f}" for v in phases))
    print(f"  {'staging beyond state + 256 MiB (MiB)':42s} {statistics.median(staging):8.1f}"
          f"        target <= 0")
    print(f"  {'resident growth over the saves (MiB)':42s} {statistics.median(growth):8.1f}"
          f"        over {args.saves} saves")
    if heap:
        print(f"  {'  of it, the heap in use (MiB)':42s} {statistics.median(heap):8.1f}"
              f"        the rest is free memory the C library keeps")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
