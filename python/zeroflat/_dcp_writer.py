"""``zeroflat.dcp.Writer``: a PyTorch Distributed Checkpoint ``StorageWriter`` that publishes a
checkpoint folder so that a crash never costs the last complete one (include/zeroflat/save.h).

DCP's ``FileSystemWriter`` writes each rank's files into the checkpoint folder in place, then
``.metadata`` by removing the old one and renaming a temporary one over it, with no fsync of the
folder: a crash mid-save over an existing checkpoint leaves a folder whose files are half the old
checkpoint's and half the new one's. Here the folder is DCP's own format (``__R_0.distcp``, one
file per rank, each tensor item a ``torch.save`` archive, each bytes item its bytes; ``.metadata``
a pickle of DCP's dataclasses), so that DCP's ``FileSystemReader`` and ``zeroflat.dcp.Reader``
read it at any world size, but:

1. every rank writes into ``.zeroflat-partial-<name>`` beside the folder (the coordinator
   removes a crashed save's first), and fsyncs its file before it reports its items;
2. the coordinator, once DCP has gathered every rank's results, writes ``.metadata`` there
   (fsync'd), fsyncs the folder's files and folders, and makes it the checkpoint in one rename:
   an existing folder of that name is swapped out in one atomic ``renameat2(RENAME_EXCHANGE)``,
   then removed, and the parent folder fsync'd.

After a crash at any step, the checkpoint's folder is the old one or the new one, whole. The
folder is replaced whole: files of the old folder that the save did not write are gone with it,
unless ``keep_other_files=True`` (then they are carried into the new folder, hard-linked where
the file system allows, before it is published, as DCP's writer leaves them in place).
``.metadata`` holds only DCP's dataclasses, torch's sizes, dtypes, layouts and memory formats:
the classes ``zeroflat.dcp.Reader``'s restricted reader allows.

    dcp.save(state_dict, storage_writer=zeroflat.dcp.Writer(path))
    dcp.async_save(state_dict, storage_writer=zeroflat.dcp.Writer(path))

Under ``async_save`` the Writer is DCP's stager too (``stage``): the state is copied into host
memory kept from one save to the next (one copy for the process, made the first time and again
only when the state's tensors change shape, dtype or number, or while the last save still
writes from it; pinned where the state has a device's tensors, copied without blocking and
waited for once; on the host, one anonymous mapping outside the C library's heap), the bytes
of host tensors copied by the library in one call without the GIL.
Each rank's file is then written by the library (include/zeroflat/save.h: write_appended), not
by ``torch.save``: the tensors' archives laid out and written without the GIL, by a thread at a
priority that lets the steps beside an ``async_save`` keep the cores and the GIL (``priority``).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import mmap
import os
import pickle
import shutil
import threading
import uuid
import weakref
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _C, _snapshot
from ._common import priority_option
from ._errors import InvalidArgument

_SUFFIX = ".distcp"
_METADATA = ".metadata"
# The version DCP's own writer records (its readers accept it).
_DCP_VERSION = "1.0.0"


# The process's staging for async_save (Writer.stage): the copy's structure, the signature of the
# state it was made for, whether a save is still writing from it, and a weak reference to the
# state dict handed to DCP for that save (its death frees the staging too: under the process
# executor the write runs in another process, and DCP drops the state dict once it is written).
_staging: Dict[str, Any] = {"signature": None, "copy": None, "busy": False, "owner": None}
_staging_lock = threading.Lock()


class _StagedDict(dict):
    """The top of a staged state dict: a dict that a weak reference can follow."""

    __slots__ = ("__weakref__",)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def _signature(value: Any) -> Any:
    """What a staging copy must match: the structure, and every tensor's type, shape, dtype and
    device kind (a DTensor's local tensor's)."""
    if isinstance(value, dict):
        return ("d", tuple((k, _signature(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    if isinstance(value, torch.Tensor):
        local = _local(value)
        return ("t", type(value).__name__, tuple(local.shape), local.dtype, local.device.type,
                tuple(value.shape))
    if type(value).__name__ == "ShardedTensor":
        return ("s", tuple((tuple(s.tensor.shape), s.tensor.dtype)
                           for s in value.local_shards()))
    return ("v",)


def _copy_into(value: Any, staged: Any, copies: list) -> Any:
    """``staged`` (a copy of ``value``'s structure on the host) given ``value``'s contents: host
    tensors as (to, from) in ``copies`` (copied after, together: _snapshot.copy_host), others
    copied here; plain values copied."""
    if isinstance(value, dict):
        return type(staged)((k, _copy_into(v, staged[k], copies)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        items = [_copy_into(v, s, copies) for v, s in zip(value, staged)]
        return items if isinstance(value, list) else type(value)(items)
    if isinstance(value, torch.Tensor):
        src, dst = _local(value), _local(staged)
        if src.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous() \
                and src.dtype == dst.dtype and src.numel() == dst.numel():
            if src.numel():
                copies.append((dst, src))
        else:  # a device's tensor into pinned memory: waited for once, after every copy began
            dst.copy_(src, non_blocking=src.device.type != "cpu" and dst.is_pinned())
        return staged
    if type(value).__name__ == "ShardedTensor":
        for a, b in zip(value.local_shards(), staged.local_shards()):
            b.tensor.copy_(a.tensor)
        return staged
    return copy.deepcopy(value)


class _Unsupported(Exception):
    """A state that _new_staging leaves to torch's own copy (a ShardedTensor)."""


def _slot(nbytes: int) -> int:
    """A staged tensor's room in the staging: whole cache lines, whole pages from 1 MiB."""
    unit = 4096 if nbytes >= 1 << 20 else 64
    return (nbytes + unit - 1) // unit * unit


def _new_staging(state_dict: Any, pinned: bool) -> Any:
    """An empty host copy of ``state_dict``'s structure (DCP's own walk of it, as its default
    stager makes one), its host tensors carved out of one anonymous mapping: outside the C
    library's heap, where thousands of tensors of a few MiB would otherwise sit between the
    training's own short-lived allocations and keep the memory they free resident (a rank's
    resident memory grew by about the state's size after the first saves, the heap's free
    space never returned). Each staged tensor has a storage of its own bytes (torch.frombuffer),
    as torch.save writes it. Pinned copies (a device's state) and ShardedTensors are left to
    torch's ``_create_cpu_state_dict``."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict, _iterate_state_dict

    if pinned:
        return _create_cpu_state_dict(state_dict, pin_memory=True)
    from torch.distributed.tensor import DTensor

    def unsupported(*_):
        raise _Unsupported()

    total = [0]

    def count(obj, *_):
        total[0] += _slot(obj.numel() * obj.element_size())
        return obj

    try:
        _iterate_state_dict(state_dict, unsupported, lambda d, *_: count(d._local_tensor), count)
    except _Unsupported:
        return _create_cpu_state_dict(state_dict)
    region = mmap.mmap(-1, max(total[0], 1))
    if total[0] >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    at = [0]

    def carve(obj, *_):
        n = obj.numel()
        if n == 0:
            return torch.empty(obj.shape, dtype=obj.dtype)
        t = torch.frombuffer(region, dtype=obj.dtype, count=n, offset=at[0]).view(obj.shape)
        at[0] += _slot(n * obj.element_size())
        return t

    def carve_dtensor(obj, *_):
        return DTensor.from_local(carve(obj._local_tensor), obj.device_mesh, obj.placements,
                                  run_check=False, shape=obj.size(), stride=obj.stride())

    return _iterate_state_dict(state_dict, unsupported, carve_dtensor, carve)


def stage(state_dict: Any) -> Any:
    """A host copy of ``state_dict`` for async_save, in the process's reused staging (module
    docstring)."""
    signature = _signature(state_dict)
    with _staging_lock:
        owner = _staging["owner"]
        if _staging["busy"] and owner is not None and owner() is None:
            _staging["busy"] = False  # the save written from it let it go
        reuse = _staging["copy"] is not None and not _staging["busy"] \
            and _staging["signature"] == signature
        if not reuse:
            device = any(t.device.type != "cpu" for t in _tensors(state_dict))
            made = _new_staging(state_dict, pinned=device)
            if not _staging["busy"]:
                _staging.update(signature=signature, copy=made)
        else:
            made = _staging["copy"]
        if made is _staging["copy"]:
            _staging["busy"] = True
    copies: list = []
    out = _copy_into(state_dict, made, copies)
    if type(out) is dict:
        out = _StagedDict(out)
    with _staging_lock:
        if made is _staging["copy"]:
            try:
                _staging["owner"] = weakref.ref(out)
            except TypeError:  # a container without weak references: freed by write_data alone
                _staging["owner"] = None
    _snapshot.copy_host(copies)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return out


def _staging_free(state_dict: Any) -> None:
    """A save written from ``state_dict``: the staging is free again if that was it."""
    with _staging_lock:
        if _staging["copy"] is not None and state_dict is not None and \
                _staging["busy"] and _shares_staging(state_dict):
            _staging["busy"] = False


def _shares_staging(state_dict: Any) -> bool:
    """Whether the state being written holds the staging's tensors (the planner's state)."""
    staged = _staging["copy"]
    first = next(iter(_tensors(staged)), None)
    return first is not None and any(t is first for t in _tensors(state_dict))


def _tensors(value: Any):
    if isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, torch.Tensor):
        yield value


class Writer(StorageWriter, AsyncStager):
    """A drop-in for ``FileSystemWriter(path)`` under ``dcp.save`` and ``dcp.async_save``, with
    the crash ordering of the module's docstring. ``sync_files=False`` skips the fsyncs (then
    nothing is promised after a crash). ``keep_other_files``: the old folder's files that this
    save does not write are carried into the new one (default: the folder is replaced whole). One
    file per rank; DCP's stream transforms, its safetensors format and saves without collectives
    (``no_dist``'s per-rank metadata) are not served (InvalidArgument). ``priority``: how the
    thread that writes the rank's file competes with the training's threads for the cores:
    "idle" (only when a core would otherwise idle), "low" (10 nicer) or "normal"."""

    def __init__(self, path: Union[str, os.PathLike], sync_files: bool = True,
                 keep_other_files: bool = False, priority: str = "idle") -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.priority = priority_option("priority", priority)
        self.sync_files = bool(sync_files)
        self.keep_other_files = bool(keep_other_files)
        self.save_id = uuid.uuid4().hex
        self.rank: Optional[int] = None
        self.is_coordinator = False

    # --- the staging under async_save (DCP's AsyncStager) ---------------------------------------

    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return stage(state_dict)

    def synchronize_staging(self) -> None:
        pass  # the copy is whole when stage returns

    # --- the checkpoint's place ---------------------------------------------------------------

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def _parts(self):
        """(parent folder, name, partial folder's name)."""
        full = os.path.abspath(self.path)
        parent, name = os.path.dirname(full), os.path.basename(full)
        return parent, name, _C.partial_tag_name(name)

    def _partial(self) -> str:
        parent, _, partial = self._parts()
        return os.path.join(parent, partial)

    # --- the plan -------------------------------------------------------------------------------

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = bool(is_coordinator)
        self.rank = kwargs.get("rank")
        if kwargs.get("use_collectives", True) is False:
            raise InvalidArgument("zeroflat.dcp.Writer publishes a checkpoint once every rank's "
                                  "files are durable, which takes DCP's collectives: a save "
                                  "without them (use_collectives=False) is not served")
        self._parts()  # a checkpoint name that cannot be published: refused before anything

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        # The coordinator, before any rank writes: a crashed save's leftovers gone.
        parent, _, partial = self._parts()
        os.makedirs(parent, exist_ok=True)
        _C.remove_partial(parent, partial)
        os.makedirs(os.path.join(parent, partial))
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_"))
                for i, plan in enumerate(plans)]

    # --- the data -------------------------------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        prefix: _StoragePrefix = plan.storage_data
        name = f"{prefix.prefix}0{_SUFFIX}"
        folder = self._partial()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        try:
            results = self._write(path, name, plan, planner)
        finally:  # written or failed: the staging it was written from is free again
            _staging_free(getattr(planner, "state_dict", None))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write(self, path: str, name: str, plan: SavePlan, planner: SavePlanner) -> list:
        # Each item as DCP's writer appends it (a tensor: the archive torch.save writes of it
        # into a stream; bytes: the bytes), pickled here and written by the library from where
        # the tensors are, without the GIL, at a low priority (the training's threads first).
        items = []
        keep = []  # what the items' addresses point into, alive until written
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                items.append((bytes(data.getbuffer()), None))
                continue
            tensor = data.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                tensor = tensor.clone()  # a view: its own bytes, not its storage's
            found: list = []
            buf = io.BytesIO()
            _snapshot.Pickler(buf, found).dump(tensor)
            keep.append(tensor)
            items.append((buf.getvalue(), [(key, storage.data_ptr(), storage.nbytes())
                                          for key, storage in found]))
        spans = _C.write_appended(path, items, self.sync_files, self.priority)
        del keep
        return [WriteResult(index=item.index, size_in_bytes=length,
                            storage_data=_StorageInfo(name, offset, length))
                for item, (offset, length) in zip(plan.items, spans)]

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        metadata.version = _DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        parent, name, partial = self._parts()
        folder = os.path.join(parent, partial)
        with open(os.path.join(folder, _METADATA), "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        old = os.path.join(parent, name)
        if self.keep_other_files and os.path.isdir(old):
            _carry_over(old, folder)
        if self.sync_files:
            _C.sync_tree(folder)
        replaced, _ = _C.publish_tag(parent, partial, name)
        if replaced:  # the old checkpoint is removed in the library's thread
            _snapshot.finish_removals_at_exit()


def _carry_over(old: str, new: str) -> None:
    """Every entry of folder ``old`` that ``new`` lacks, made in ``new``: folders recursively,
    symbolic links as links, files hard-linked (copied where the file system refuses a link)."""
    for entry in os.scandir(old):
        target = os.path.join(new, entry.name)
        if os.path.lexists(target):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir():
            os.mkdir(target)
            _carry_over(entry.path, target)
        else:
            try:
                os.link(entry.path, target)
            except OSError:
                shutil.copy2(entry.path, target)


def installed_writer_class(base: type, note: Callable[[bool, str], None]) -> type:
    """``base`` (DCP's FileSystemWriter) writing through ``Writer`` while zeroflat.dcp.install()
    is in place: a subclass (isinstance holds; ``async_save`` stages through Writer's reused
    staging unless the save is handed back or ``cache_staged_state_dict`` asks for base's own)
    that serves a save as FileSystemWriter would make it, the old folder's other files kept, and
    hands back to base's own methods what Writer does not serve: several files per rank
    (``single_file_per_rank=False``), stream transforms (``_extensions``), a serialization
    format other than torch.save's, ``overwrite=False`` and saves without collectives.
    ``note(served, why)`` is told once per save."""

    class Installed(base):  # type: ignore[misc, valid-type]
        __doc__ = (f"DCP's {base.__name__} while zeroflat.dcp.install(writer=True) is in place: "
                   "writes through zeroflat.dcp.Writer, or hands back to DCP's own what it does "
                   "not serve.")

        def __init__(self, path, *args, **kwargs):
            super().__init__(path, *args, **kwargs)
            self._zeroflat = Writer(path, sync_files=getattr(self, "sync_files", True),
                                    keep_other_files=True)
            self._why_not = self._refusal()
            self._served: Optional[bool] = None
            self._same_save_id()

        def _refusal(self) -> Optional[str]:
            if not getattr(self, "single_file_per_rank", True):
                return "several files per rank (single_file_per_rank=False)"
            if getattr(self, "transforms", None) is not None and \
                    getattr(self.transforms, "extensions", None):
                return "DCP's stream transforms (_extensions)"
            fmt = getattr(self, "serialization_format", None)
            if fmt is not None and getattr(fmt, "value", fmt) != "torch_save":
                return f"the serialization format {getattr(fmt, 'value', fmt)}"
            if getattr(self, "overwrite", True) is False:
                return "overwrite=False"
            return None

        def reset(self, checkpoint_id=None) -> None:
            super().reset(checkpoint_id)
            self._zeroflat.reset(checkpoint_id)
            self._served = None
            self._same_save_id()

        def _same_save_id(self) -> None:
            # One save, one id: the metadata zeroflat writes carries the id this writer shows.
            own = getattr(self, "save_id", None)
            if own is not None:
                self._zeroflat.save_id = own

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            why = self._why_not
            if why is None and kwargs.get("use_collectives", True) is False:
                why = "a save without collectives (use_collectives=False)"
            self._served = why is None
            note(self._served, f"{self.path}: {why}" if why else "")
            if self._served:
                self._zeroflat.set_up_storage_writer(is_coordinator, *args, **kwargs)
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)

        def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
            if not self._served:
                return super().prepare_local_plan(plan)
            if os.path.exists(os.path.join(os.fspath(self.path), _METADATA)):
                import warnings
                warnings.warn(f"Detected an existing checkpoint in {self.path}, overwriting since "
                              "self.overwrite=True.", stacklevel=2)
            return self._zeroflat.prepare_local_plan(plan)

        def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
            return (self._zeroflat if self._served else super()).prepare_global_plan(plans)

        def stage(self, state_dict: Any) -> Any:
            # async_save stages before the save is set up: what the constructor decided.
            if self._why_not is None and not getattr(self, "cache_staged_state_dict", False):
                return stage(state_dict)
            return super().stage(state_dict)

        def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
            return (self._zeroflat if self._served else super()).write_data(plan, planner)

        def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
            return (self._zeroflat if self._served else super()).finish(metadata, results)

        def storage_meta(self) -> Optional[StorageMeta]:
            if self._served:
                return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)
            return super().storage_meta()

    Installed.__name__ = Installed.__qualname__ = base.__name__
    Installed.__module__ = "zeroflat.dcp"
    return Installed
