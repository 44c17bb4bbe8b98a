"""DeepSpeed's ``engine.save_checkpoint`` through zeroflat (the drop-in's patch of it): a save that
returns once the state is snapshotted, is written in the library's threads while training goes
on, and that a crash never turns into the loss of the last good checkpoint.

DeepSpeed blocks until every file is written, writes each file of a tag in place, and
``latest`` with a plain write, no fsync: a crash mid-save can leave ``latest`` naming a tag whose
files are half written, and a save over an existing tag destroys it file by file. Here the files
are still DeepSpeed's own, built by its save (every release, every stage: the same names, keys
and values), but:

1. the save before is waited for (its failure raised here, on every rank), and the first rank
   removes the folders of saves that failed or crashed (``.zeroflat-partial-*``);
2. each file DeepSpeed's checkpoint engine would ``torch.save`` under the temporary folder
   ``.zeroflat-partial-<tag>`` is snapshotted instead (_snapshot.py: torch.save's pickling, the
   tensors' bytes copied into staging memory reused from save to save). Under ZeRO-1/2 the
   16-bit model file is laid out by the first rank and every rank stages its part of the flat
   groups' bytes. One all-reduce after DeepSpeed's save (whose barriers and tag check it
   replaces) tells every rank whether any rank failed, from step 1 on: a failure on any rank
   raises on every rank;
3. the library's thread (include/zeroflat/save.h: BackgroundSave) writes the files, fsyncs them,
   and the first rank, once every other rank's marker says its files are durable, makes the
   folder durable, visible under the tag's name in one rename (an existing tag swapped out
   atomically), then replaces ``latest`` by write, fsync and rename;
4. the call returns (``install(save_in_background=False)``: once published). The next save, a
   load, ``zeroflat.deepspeed.wait()`` and the process's exit wait for the write; its failure
   raises at the first of them. Progress is logged as a load's.

After a crash at any point, ``latest`` names a complete checkpoint: the one before, or the new
one.

One difference from DeepSpeed's files, on purpose: an enum member in the state (DeepSpeed's
``ZeroStageEnum``, which Python pickles as a call of ``getattr``) is written as its value, so
that every file loads with ``torch.load(weights_only=True)`` once a reader allows DeepSpeed's own
classes (``LossScaler``, ``fragment_address``) with ``torch.serialization.add_safe_globals``;
DeepSpeed's loads, ``zero_to_fp32`` and ``ds_to_universal`` compare the stage as a number. A
``client_state`` value that is not plain data (containers, numbers, text, tensors, dtypes,
devices) is written as DeepSpeed writes it, with a warning naming its key: that file then needs
``weights_only=False``. What the drop-in does not serve is DeepSpeed's own save, with one warning saying why
(``stats["save_fallbacks"]``): a checkpoint engine other than DeepSpeed's torch engine (the
decoupled, fast and Nebula engines commit on their own terms), node-local storage (each
node's first rank writes its own ``latest``), and tags that differ between the ranks (found at
the snapshot's agreement; under DeepSpeed's tag_validation FAIL an AssertionError instead).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import enum
import hashlib
import os
import threading
import time
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from . import _C, _dropin, _progress, _snapshot
from ._comm import all_reduce_ints, failing_word, raise_agreed, raise_failed
from ._common import bool_option, path_text, priority_option
from ._dropin import log, stats
from ._errors import Error, IoError
from ._resume_family import Zero3, optimizer_kind

_warned: set = set()


def _why_not(engine) -> Optional[str]:
    """Why the drop-in leaves this save to DeepSpeed, or None."""
    ce = getattr(engine, "checkpoint_engine", None)
    if type(ce).__name__ != "TorchCheckpointEngine":
        return (f"its checkpoint engine is {type(ce).__name__}, not DeepSpeed's torch engine "
                "(which the drop-in publishes safely)")
    is_decoupled = getattr(ce, "is_decoupled", None)
    if callable(is_decoupled) and is_decoupled():
        return "its checkpoint engine commits on its own (decoupled)"
    local = getattr(engine, "use_node_local_storage", None)
    if callable(local) and local():
        return "checkpoints go to node-local storage (each node writes its own 'latest')"
    if not dist.is_initialized():
        return "torch.distributed is not initialized"
    return None


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype,
          torch.device, torch.Size)


def _plain_enums(value: Any) -> Any:
    """``value`` with every enum member in its dicts, lists and tuples replaced by its value; the
    same object where there is none (tensors are never copied)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        items = [(k, _plain_enums(v)) for k, v in value.items()]
        if all(v is value[k] for k, v in items):
            return value
        out = type(value)() if type(value) in (dict, collections.OrderedDict) else dict()
        out.update(items)
        return out
    if type(value) in (list, tuple):
        items = [_plain_enums(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items)
    return value


def _not_plain(value: Any, depth: int = 0) -> Optional[str]:
    """The type of the first value in ``value`` that is not plain data, or None."""
    if isinstance(value, _PLAIN) or depth > 64:
        return None
    if isinstance(value, (dict, collections.OrderedDict)):
        for k, v in value.items():
            found = _not_plain(k, depth + 1) or _not_plain(v, depth + 1)
            if found:
                return found
        return None
    if type(value) in (list, tuple, set, frozenset):
        for v in value:
            found = _not_plain(v, depth + 1)
            if found:
                return found
        return None
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _warn_client_state(client_state: Any) -> None:
    for key, value in (client_state or {}).items():
        found = _not_plain(value)
        if found is not None and (key, found) not in _warned:
            _warned.add((key, found))
            log.warning("zeroflat: save_checkpoint's client_state[%r] holds a %s: written as "
                        "DeepSpeed writes it, and that file needs torch.load(weights_only=False)",
                        key, found)


# Whether ZeRO-1/2's 16-bit model file is written by every rank (install(share_model_file=...)).
share_model = True


def _shared_flats(engine, world: int) -> Optional[list]:
    """The flat 16-bit groups that every data parallel rank holds the same bytes of, when the
    first rank's model file is theirs to write together: ZeRO-1/2 (and BF16_Optimizer), data
    parallel over the whole world; else None."""
    if world < 2:
        return None
    opt = getattr(engine, "optimizer", None)
    flats = getattr(opt, "bit16_groups_flat", None) or getattr(opt, "bf16_groups_flat", None)
    try:
        stage = engine.zero_optimization_stage()
        dp = engine.dp_world_size
        mp = engine.mp_world_size
    except AttributeError:
        return None
    pipeline = type(engine).__name__ == "PipelineEngine"
    if stage > 2 or not flats or dp != world or mp != 1 or pipeline:
        return None
    if not all(isinstance(t, torch.Tensor) for t in flats):
        return None
    return list(flats)


@contextlib.contextmanager
def _one_gather_epilogue(engine):
    """While DeepSpeed's save runs: under ZeRO-3 it ends by gathering the persistent parameters
    (those kept whole on every rank) whole again, ``checkpoint_event_epilogue``, one all-gather
    per parameter; at 4 ranks on gloo that is most of the call. The resume's epilogue runs in its
    place (``Zero3.epilogue``: one all-gather, the same values in the same places), or
    DeepSpeed's own where that one cannot (hpZ, quantized or NVMe partitions, more than it
    holds). The optimizer is put back as it was."""
    opt = getattr(engine, "optimizer", None)
    if optimizer_kind(engine) != "DeepSpeedZeroOptimizer_Stage3":
        yield
        return
    group = opt.dp_process_group
    family = Zero3(opt, dist.get_rank(group), dist.get_world_size(group), group)
    theirs = opt.checkpoint_event_epilogue
    own = vars(opt).get("checkpoint_event_epilogue")  # an instance's own, put back as it was

    def epilogue():
        if not family.epilogue():
            theirs()

    opt.checkpoint_event_epilogue = epilogue
    try:
        yield
    finally:
        if own is None:
            del opt.checkpoint_event_epilogue
        else:
            opt.checkpoint_event_epilogue = own


_DIGEST_MAX = (1 << 56) - 1


def _digest(data: bytes) -> int:
    """56 bits of ``data``'s hash: a value that every rank must hold the same goes into an
    all-reduce (max) as ``_pair(d)``, and was the same on every rank when the two maxima add
    up to _DIGEST_MAX (``_agreed``)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def _pair(digest: int) -> List[int]:
    return [digest, _DIGEST_MAX - digest]


def _agreed(maxima: List[int]) -> Optional[int]:
    """The digest every rank gave (its ``_pair`` after the all-reduce), else None."""
    return maxima[0] if maxima[0] == _DIGEST_MAX - maxima[1] else None


# The other ranks' last copy of the first rank's layout of its shared records, as (its digest,
# its words): the layout seldom changes from save to save (a file's records move only when its
# pickle crosses a 64-byte boundary), and then needs no all-reduce of its own.
_plan_cache: tuple = (0, [])


def _place_parts(snap: _snapshot.Snapshot, folder: str, me: int, length: int, digest: int,
                 cached: List[int], words: List[int]) -> None:
    """This rank's parts of the first rank's shared records placed by its layout (``words`` on
    the first rank, ``length`` long, ``digest`` its digest): from the save before where every
    other rank holds it (``cached``: the maxima of their copies' ``_pair``), else by one more
    all-reduce."""
    global _plan_cache
    if _agreed(cached) != digest:
        words = all_reduce_ints(words + [0] * (length - len(words)), None, "max",
                                "the save's shared records", "save-share")
        if me != 0:
            _plan_cache = (digest, words)
    if me != 0:
        # Cannot fail where the sizes agreed; if it does, the writer's failure tells the first
        # rank (nothing published) and this rank raises.
        snap.place_parts(_plan_cache[1], folder)


def _failed_on(rank: int, what: str, where: str, tag: str) -> Error:
    return Error(f"save_checkpoint({where}, tag {tag!r}): {what} failed on rank {rank}; nothing "
                 "was published: 'latest' and every saved tag are as before")


# Whether a save returns once its state is snapshotted (install(save_in_background=...)).
background = True
# The background writer's thread priority (install(save_priority=...)).
priority = "idle"
# How long the first rank waits for the others' files before it gives the save up (seconds).
WAIT_SECONDS = 1800.0
# Host memory left free when the staging grows: past (the probe's free memory - this), a rank's
# files are written from its tensors themselves and the save blocks until they are (bytes).
STAGING_MARGIN = 256 << 20
# The most host memory a rank's staging may take (install(save_staging_bytes=...); None: what
# the probe leaves, above).
staging_bytes: Optional[int] = None


def configure(in_background: Any, save_priority: Any, save_staging_bytes: Any) -> None:
    """install()'s save options, each checked before any is set."""
    in_bg = bool_option("save_in_background", in_background)
    level = priority_option("save_priority", save_priority)
    if save_staging_bytes is not None and (
            isinstance(save_staging_bytes, bool) or not isinstance(save_staging_bytes, int)
            or save_staging_bytes < 0):
        raise ValueError(f"save_staging_bytes is {save_staging_bytes!r}: expected a number of "
                         "bytes (0 or more) or None")
    global background, priority, staging_bytes
    background, priority, staging_bytes = in_bg, level, save_staging_bytes


def options() -> tuple:
    """The save options in place, as configure() takes them."""
    return background, priority, staging_bytes


_writer: Optional["_C.BackgroundSave"] = None
_staging = _snapshot.Staging()
_pending: Optional[dict] = None  # the save being written: where, tag, when it returned
_exit_hooked_pid: Optional[int] = None  # the process whose exit waits for the save


def _outcome_error(pending: dict, outcome: dict) -> Optional[BaseException]:
    """This rank's own failure in the background save ``pending``, as an exception (None when it
    succeeded, or when what stopped it was another rank's failure)."""
    if not outcome["error"] or outcome["failed_rank"] >= 0:
        return None
    text = (f"save_checkpoint({pending['where']}, tag {pending['tag']!r}), written in the "
            f"background: {outcome['error']}; nothing was published: 'latest' names the "
            "checkpoint before")
    return IoError(text) if outcome["error_code"] else Error(text)


def _watch(pending: dict, rank: int, world: int) -> None:
    """Reports the background write's progress every ZEROFLAT_PROGRESS_SECONDS (10 s) while it
    runs, as a load's: through the ``zeroflat`` logger (INFO) and the drop-in's progress
    callback (``install(progress=...)``)."""
    interval = _progress.interval_seconds()
    what = f"save_checkpoint({pending['where']}, tag {pending['tag']!r}) in the background"
    start = time.monotonic()
    while not pending["stop"].wait(interval):
        if _writer.finished:
            return
        done, total = int(_writer.bytes_written), int(_writer.bytes_total)
        seconds = time.monotonic() - start
        line = _C.describe_progress(done, total, seconds)
        if line.startswith("read "):
            line = "wrote " + line[5:]
        if world > 1 and total and done >= total:
            line += ("; waiting for the other ranks' files" if rank == 0
                     else "; the first rank publishes it")
        log.info("zeroflat: rank %d: %s: %s", rank, what, line)
        callback = _dropin.progress
        if callback is not None:
            try:
                callback(_progress.Progress(rank, what, done, total, seconds, False, line))
            except Exception:  # noqa: BLE001 - the write goes on
                log.exception("zeroflat: the progress callback raised")


def _wait_own():
    """Waits for this rank's save being written in the background, if any: (its own failure or
    None, the save, how it ended or None)."""
    global _pending
    error: Optional[BaseException] = None
    pending, outcome = _pending, None
    if pending is not None:
        outcome = _writer.wait()
        pending["stop"].set()
        if pending.get("watch") is not None:
            pending["watch"].join()
        _pending = None
        if pending.get("cancelled"):  # given up at its call, which raised: never written
            return None, pending, None
        stats["saves"].append({"dir": pending["dir"], "tag": pending["tag"],
                               "files": pending["files"], "parts": pending["parts"],
                               "bytes": outcome["bytes"],
                               "direct_bytes": outcome["direct_bytes"],
                               "blocking_seconds": pending["blocking"],
                               "write_seconds": outcome["seconds"],
                               "write_phases": outcome["phases"],
                               "published": outcome["published"],
                               "replaced": outcome["replaced"],
                               "exchanged": outcome["exchanged"],
                               "error": outcome["error"] or None})
        error = _outcome_error(pending, outcome)
    return error, pending, outcome


def settle(agree: bool, what: str = "the save") -> None:
    """Waits for this rank's save being written in the background, if any, and raises its
    failure: agreed by every rank (a collective; the others raise that the rank failed) when
    ``agree``, else this rank's own, or on the first rank another rank's that stopped the
    publication."""
    error, pending, outcome = _wait_own()
    if agree and dist.is_initialized():
        where = pending["where"] if pending else "?"
        raise_agreed(error, None, f"{what}: the last save's background write (an all-reduce)",
                     "save-background",
                     lambda r: Error(f"the save_checkpoint({where}) written in the background "
                                     f"failed on rank {r}; nothing was published: 'latest' names "
                                     "the checkpoint before"))
        return
    if error is not None:
        raise error
    if outcome is not None and outcome["failed_rank"] >= 0:
        raise Error(f"save_checkpoint({pending['where']}, tag {pending['tag']!r}), written in the "
                    f"background: {outcome['error']}; nothing was published: 'latest' names the "
                    "checkpoint before")


def wait(*, every_rank: bool = False) -> None:
    """``zeroflat.deepspeed.wait()``: waits until this rank's checkpoint saved in the background
    (``engine.save_checkpoint``) is written: on the first rank, until it is durable and
    published (``latest`` names it). Raises its failure once: this rank's own
    (``zeroflat.IoError`` naming the file and the error), or on the first rank another rank's
    that stopped the publication. Local to the rank, unless ``every_rank=True``: then a
    collective that every rank calls, after which every rank has returned (the checkpoint
    published) or raised (a rank's failure: that rank its own, the others ``zeroflat.Error``
    naming it). Harmless when nothing is being written. On return, the tag that a save over an
    existing one replaced is removed too (the library removes it in a thread once the new one is
    published); one that cannot be removed is said in a warning and left to the next save's
    clean-up."""
    settle(agree=bool_option("every_rank", every_rank), what="zeroflat.deepspeed.wait()")
    _snapshot.finish_removals()


def _at_exit() -> None:
    try:
        settle(agree=False)
    except Exception as e:  # noqa: BLE001 - the process is ending: said, not raised
        log.error("zeroflat: %s", e)
    _snapshot.finish_removals()


def _hook_exit() -> None:
    """Makes this process's end wait for its save: atexit for an interpreter's ordinary end, and
    multiprocessing's finalizers for a process multiprocessing started (a pool's worker, the
    ranks torch.multiprocessing spawns), which ends through os._exit once they ran, without
    atexit. Once per process (a forked child registers its own)."""
    global _exit_hooked_pid
    if _exit_hooked_pid == os.getpid():
        return
    _exit_hooked_pid = os.getpid()
    atexit.register(_at_exit)
    import multiprocessing.util
    multiprocessing.util.Finalize(None, _at_exit, exitpriority=100)


def _writes_during_save(engine) -> bool:
    """Whether DeepSpeed's save writes files itself, snapshot or not (NVMe offload's copies)."""
    nvme = getattr(engine, "zero_nvme_offload_optimizer", None)  # from 0.16 on
    return bool(nvme()) if callable(nvme) else False


@contextlib.contextmanager
def _snapshotting(engine, save, scripts):
    """While DeepSpeed's save runs in the calling thread: its checkpoint engine's ``save``
    snapshots each file (``save(state_dict, path)``); its folders are made on the first rank
    alone (the others' are made when their files are handed to the writer, after the first
    rank's clean-up); its barriers, which order the ranks' writes of files that nobody writes
    during the call, do nothing; its tag check (two all-reduces) is the snapshot agreement's;
    its copies of the recovery scripts into the folder are kept in ``scripts`` (the folders),
    made once every rank agreed (``_copy_scripts``). Each is put back as it was."""
    import deepspeed.comm as ds_comm

    ce = engine.checkpoint_engine
    caller = threading.get_ident()
    theirs_barrier = ds_comm.barrier

    def barrier(*args, **kwargs):
        if threading.get_ident() != caller:
            return theirs_barrier(*args, **kwargs)
        return None

    first = dist.get_rank() == 0

    def makedirs(path, exist_ok=False):
        if first:
            os.makedirs(path, exist_ok=exist_ok)

    patched = [(ce, "save", save), (engine, "_checkpoint_tag_validation", lambda tag: None),
               (engine, "_copy_recovery_script", scripts.append)]
    if not _writes_during_save(engine):
        patched.append((ce, "makedirs", makedirs))
    owns = [(obj, name, vars(obj).get(name, _ABSENT)) for obj, name, _ in patched]
    for obj, name, value in patched:
        setattr(obj, name, value)
    ds_comm.barrier = barrier
    try:
        yield
    finally:
        ds_comm.barrier = theirs_barrier
        for obj, name, own in owns:
            if own is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, own)


_ABSENT = object()


def _copy_scripts(engine, scripts) -> None:
    """DeepSpeed's copies of its recovery scripts (zero_to_fp32.py) into the checkpoint folder,
    which its save makes on the first rank, made after the snapshot's agreement. A copy that
    fails is said, not raised: the agreement is behind, the checkpoint's own files do not need
    the scripts, and a folder that cannot be written fails the save's write itself."""
    for folder in scripts:
        try:
            engine._copy_recovery_script(folder)
        except Exception as e:  # noqa: BLE001 - see above
            log.warning("zeroflat: DeepSpeed's recovery scripts were not copied into %s: %s",
                        path_text(folder), e)


def _tags_differ(original, engine, save_dir, tag, save_latest, args) -> bool:
    """The ranks called save_checkpoint with different tags: what DeepSpeed does then. Under
    its ``checkpoint.tag_validation`` FAIL, an AssertionError on every rank; else (WARN, its
    default, or IGNORE) DeepSpeed's own save, each rank's files under its own tag, not
    published atomically (there is no one tag to publish), with DeepSpeed's warning."""
    fail = getattr(engine, "checkpoint_tag_validation_fail", None)
    enabled = getattr(engine, "checkpoint_tag_validation_enabled", None)
    if callable(enabled) and enabled() and callable(fail) and fail():
        raise AssertionError(f"save_checkpoint: the checkpoint tag {tag!r} of rank "
                             f"{dist.get_rank()} is not every rank's (checkpoint.tag_validation "
                             "is FAIL); nothing was saved")
    _wait_own()  # the given-up save's writer ended; its empty folder goes
    if dist.get_rank() == 0:
        _C.remove_partials(os.fspath(save_dir))
    why = "the ranks' checkpoint tags differ"
    stats["save_fallbacks"].append(why)
    if why not in _warned:
        _warned.add(why)
        log.warning("zeroflat: save_checkpoint is DeepSpeed's own: %s", why)
    return original(engine, save_dir, tag=tag, save_latest=save_latest, **args)


def save_checkpoint(original, engine, save_dir, tag=None, client_state={},  # noqa: B006
                    save_latest=True, exclude_frozen_parameters=False):
    """The drop-in's ``DeepSpeedEngine.save_checkpoint``: DeepSpeed's arguments and return value
    (True); the checkpoint published as the module docstring says."""
    global _writer, _pending
    args = dict(client_state=client_state, exclude_frozen_parameters=exclude_frozen_parameters)
    reason = _why_not(engine)
    if reason is not None:
        settle(agree=False)
        stats["save_fallbacks"].append(reason)
        if reason not in _warned:
            _warned.add(reason)
            log.warning("zeroflat: save_checkpoint is DeepSpeed's own: %s", reason)
        return original(engine, save_dir, tag=tag, save_latest=save_latest, **args)
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    start = time.perf_counter()
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    where = path_text(save_dir)
    partial = _C.partial_tag_name(tag)  # a tag that is not a plain folder name: refused here
    _warn_client_state(client_state)
    me, world = dist.get_rank(), dist.get_world_size()

    # 1. The save before this one written on this rank, and on the first rank the folder ready
    # (a crashed save's leftovers gone). A failure of either is kept: every rank learns of it at
    # the snapshot's agreement below, the one collective of the call (no rank writes in the
    # folder before it: DeepSpeed's folders are made by the first rank alone until then).
    error, _, _ = _wait_own()
    if me == 0 and error is None:
        try:
            os.makedirs(save_dir, exist_ok=True)
            _C.remove_partials(os.fspath(save_dir))  # this tag's, and failed saves' of others
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
    # DeepSpeed's NVMe offload copies its swap files into the tag's folder during the save
    # itself, on every rank: those must not meet the first rank's clean-up, so that case keeps
    # an agreement before DeepSpeed's save.
    if _writes_during_save(engine):
        failing = all_reduce_ints([failing_word(error, None)], None, "max",
                                  "the save's beginning (an all-reduce)", "save-begin")[0]
        raise_failed(failing, error, None, "the save's start",
                     lambda r, words: _failed_on(r, f"the last save's background write or this "
                                                    f"one's folder ({words})", where, tag))

    # 2. DeepSpeed's own save into the partial folder, each file it writes snapshotted instead
    # (pickled as torch.save would, its tensors' bytes copied into the staging memory): a
    # failure kept, not raised, so that every rank still meets DeepSpeed's collectives.
    _staging.begin(pinned=torch.cuda.is_available() and torch.cuda.is_initialized(),
                   limit=staging_bytes)
    free = max(0, _C.host_free_bytes() - STAGING_MARGIN)
    if staging_bytes is not None:
        free = min(free, max(0, staging_bytes - _staging.capacity))
    snap = _snapshot.Snapshot(_staging, free=free)
    flats = _shared_flats(engine, world) if share_model else None
    shared = {t.untyped_storage()._cdata: i for i, t in enumerate(flats or [])}
    failure: List[BaseException] = [error] if error is not None else []
    # The library's thread is started now and takes the files once every rank has agreed that
    # its snapshot is whole (below), else the save is given up (cancel: nothing published): a
    # writer that failed to start is one more failure that agreement tells every rank of.
    # (Handing each file over as soon as it is snapshotted, BackgroundSave's streamed job,
    # made the call a third longer at 2 ranks on 2 cores, the writer's CRCs and submissions
    # beside the copies, and the durable time no shorter: docs/performance.md.)
    try:
        if error is not None:
            raise error
        if _writer is None:
            _writer = _C.BackgroundSave()
        _writer.start(os.fspath(save_dir), partial, tag, me, world, bool(save_latest), priority,
                      float(WAIT_SECONDS), [], streamed=True)
        _pending = {"dir": os.fspath(save_dir), "where": where, "tag": tag, "files": 0,
                    "parts": 0, "blocking": 0.0, "stop": threading.Event()}
        _pending["watch"] = threading.Thread(target=_watch, args=(_pending, me, world),
                                             name="zeroflat-save-progress", daemon=True)
        _pending["watch"].start()
        _hook_exit()
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        error = e

    def save(state_dict: Any, path: str) -> None:
        if failure or _pending is None:
            return
        try:
            snap.add(_plain_enums(state_dict), os.fspath(path), shared, world)
        except Exception as e:  # noqa: BLE001 - kept for the agreement after DeepSpeed's save
            failure.append(e)

    scripts: List[str] = []
    if flats is not None and me != 0 and error is None:
        try:  # this rank's part of the model file's groups
            snap.stage_parts(flats, me, world)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
    try:
        with _snapshotting(engine, save, scripts), _one_gather_epilogue(engine):
            original(engine, save_dir, tag=partial, save_latest=False, **args)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        error = error or e
    if error is None and failure:
        error = failure[0]
    try:
        # One all-reduce: whether every rank took its snapshot (its last save written, its
        # writer started); whether every rank saves under the same tag (DeepSpeed's own tag
        # check, made here instead of by its two all-reduces); and under ZeRO-1/2, whose 16-bit
        # model file every rank writes its part of (at the offsets the first rank's layout of
        # it gives), whether every rank holds flat groups of the same sizes, the layout's length
        # and digest, and whether every other rank holds it from the save before.
        folder = os.path.join(os.fspath(save_dir), partial)
        words = snap.layout_words(folder) if me == 0 and flats is not None and error is None else []
        cached = [0, 0] if me == 0 else _pair(_plan_cache[0])
        sizes = _digest(repr([t.untyped_storage().nbytes() for t in flats or []]).encode())
        agreed = all_reduce_ints(
            [failing_word(error, None), len(words),
             _digest(b"".join(w.to_bytes(8, "little") for w in words)) if words else 0] + cached
            + _pair(_digest(tag.encode())) + _pair(sizes), None, "max",
            "the save's snapshot (an all-reduce)", "save-snapshot")
        failing, length, plan_digest = agreed[:3]
        raise_failed(failing, error, None, "the save's snapshot",
                     lambda r, why: _failed_on(r, f"its last save's background write, this "
                                                  f"one's folder or its snapshot ({why})", where,
                                               tag))
        if _agreed(agreed[5:7]) is None:  # not every rank's tag is this one's
            _writer.cancel()
            _pending["cancelled"] = True
            return _tags_differ(original, engine, save_dir, tag, save_latest, args)
        if _agreed(agreed[7:9]) is None:
            raise Error(f"save_checkpoint({where}, tag {tag!r}): the ranks' flat 16-bit groups "
                        "differ in size; nothing was saved")
        if flats is not None:
            _place_parts(snap, folder, me, length, plan_digest, agreed[3:5], words)
        # 3. The writer takes the files (those written from the tensors themselves first: the
        # call waits for them below), then this rank's parts; it fsyncs them, and the first
        # rank publishes once every rank's files are durable.
        _copy_scripts(engine, scripts)
        for folder in sorted({os.path.dirname(f[0]) for f in snap.files} |
                             {os.path.join(os.fspath(save_dir), partial)}):
            os.makedirs(folder, exist_ok=True)  # the markers go in the partial folder
        for file, first in sorted(zip(snap.files, snap.file_direct), key=lambda f: not f[1]):
            _writer.add_file(file, first)
        _writer.seal(snap.parts)
        _pending.update(files=len(snap.files), parts=len(snap.parts))
    except BaseException:
        if _pending is not None:
            _writer.cancel()  # written, never published; waited for by the next save
            _pending["cancelled"] = True
        raise
    finally:
        _staging.end()
    if any(snap.file_direct):
        # This rank's state did not all fit the staging (the free host memory, or
        # save_staging_bytes): the files that did not are written first, from the tensors
        # themselves, and the call returns once their data is (a wave); the staged rest is
        # written in the background. A failure meanwhile raises at the next save, load or wait.
        if "direct" not in _warned:
            _warned.add("direct")
            log.warning("zeroflat: save_checkpoint(%s): staging this rank's state would take "
                        "more host memory than the staging may (%s); the files that do not fit "
                        "are written before the call returns", where,
                        "save_staging_bytes" if staging_bytes is not None else "the free memory")
        while _writer.pending_first and not _writer.finished:
            time.sleep(0.002)
    _pending["blocking"] = time.perf_counter() - start

    # 4. Written and published by the library's thread (include/zeroflat/save.h): here, or in
    # the background, waited for by the next save, a load, zeroflat.deepspeed.wait() or the
    # process's exit.
    if not background:
        settle(agree=True, what=f"save_checkpoint({where}, tag {tag!r})")
    return True
