"""DeepSpeed's ``engine.save_checkpoint`` through zeroflat (the drop-in's patch of it): a save that
a crash never turns into the loss of the last good checkpoint.

DeepSpeed writes each file of a tag in place, and ``latest`` with a plain write, no fsync: a
crash mid-save can leave ``latest`` naming a tag whose files are half written, and a save over
an existing tag destroys it file by file. Here the files are still DeepSpeed's own, written by
its checkpoint engine (every release, every stage: the same names, keys and values), but:

1. under a temporary folder beside the tag (``.zeroflat-partial-<tag>``; a crashed save's is
   removed first);
2. each rank makes the files it wrote durable (fsync), and the ranks agree that every rank did:
   a failure on any rank (a full disk, an I/O error, an exception in DeepSpeed's writing) raises
   on every rank, and nothing is published: ``latest`` and every saved tag are as they were;
3. the first rank makes the folder durable, then visible under the tag's name in one rename (an
   existing tag of that name swapped out atomically, then removed), then replaces ``latest``
   by write, fsync and rename (include/zeroflat/save.h).

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
decoupled, fast and Nebula engines commit on their own terms), and node-local storage (each
node's first rank writes its own ``latest``).
"""

from __future__ import annotations

import collections
import enum
import os
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from . import _C
from ._comm import raise_agreed
from ._common import path_text
from ._dropin import log, stats
from ._errors import Error

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


def _failed_on(rank: int, what: str, where: str, tag: str) -> Error:
    return Error(f"save_checkpoint({where}, tag {tag!r}): {what} failed on rank {rank}; nothing "
                 "was published: 'latest' and every saved tag are as before")


def save_checkpoint(original, engine, save_dir, tag=None, client_state={},  # noqa: B006
                    save_latest=True, exclude_frozen_parameters=False):
    """The drop-in's ``DeepSpeedEngine.save_checkpoint``: DeepSpeed's arguments and return value
    (True); the checkpoint published as the module docstring says."""
    args = dict(client_state=client_state, exclude_frozen_parameters=exclude_frozen_parameters)
    reason = _why_not(engine)
    if reason is not None:
        stats["save_fallbacks"].append(reason)
        if reason not in _warned:
            _warned.add(reason)
            log.warning("zeroflat: save_checkpoint is DeepSpeed's own: %s", reason)
        return original(engine, save_dir, tag=tag, save_latest=save_latest, **args)
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    where = path_text(save_dir)
    partial = _C.partial_tag_name(tag)  # a tag that is not a plain folder name: refused here
    _warn_client_state(client_state)
    me = dist.get_rank()

    # 1. The folder, and a crashed save's leftovers gone; every rank learns of a failure.
    error: Optional[BaseException] = None
    if me == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            _C.remove_partial(os.fspath(save_dir), partial)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
    raise_agreed(error, None, "the save's folder (an all-reduce)", "save-folder",
                 lambda r: _failed_on(r, "preparing the folder", where, tag))

    # 2. DeepSpeed's own save into the partial folder, each file this rank writes recorded (a
    # failure kept, not raised, so that every rank still meets DeepSpeed's collectives), then
    # made durable.
    ce = engine.checkpoint_engine
    write = ce.save
    written: List[str] = []
    failure: List[BaseException] = []

    def save(state_dict: Any, path: str) -> None:
        if failure:
            return
        try:
            _C.save_step(f"write.{len(written) + 1}", os.fspath(path))
            write(_plain_enums(state_dict), path)
            written.append(os.fspath(path))
        except Exception as e:  # noqa: BLE001 - kept for the agreement after DeepSpeed's save
            failure.append(e)

    own = vars(ce).get("save")  # an instance's own save, put back as it was
    ce.save = save
    try:
        original(engine, save_dir, tag=partial, save_latest=False, **args)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        error = e
    finally:
        if own is None:
            del ce.save
        else:
            ce.save = own
    if error is None and failure:
        error = failure[0]
    if error is None:
        try:
            _C.sync_files(written)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
    raise_agreed(error, None, "the save's files (an all-reduce)", "save-files",
                 lambda r: _failed_on(r, "writing its files", where, tag))

    # 3. Published by the first rank: the folder durable, one rename, then 'latest'.
    replaced = exchanged = False
    if me == 0:
        try:
            _C.sync_tree(os.path.join(os.fspath(save_dir), partial))
            replaced, exchanged = _C.publish_tag(os.fspath(save_dir), partial, tag)
            if save_latest:
                _C.write_latest(os.fspath(save_dir), tag)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
    raise_agreed(error, None, "publishing the save (an all-reduce)", "save-publish",
                 lambda r: Error(f"save_checkpoint({where}, tag {tag!r}): publishing the "
                                 f"checkpoint failed on rank {r}; 'latest' still names a complete "
                                 "checkpoint (the one before, or this one)"))
    stats["saves"].append({"dir": os.fspath(save_dir), "tag": tag, "files": len(written),
                           "replaced": replaced, "exchanged": exchanged})
    return True
