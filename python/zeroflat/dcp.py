"""A PyTorch Distributed Checkpoint ``StorageReader`` over the library's reader, for two kinds
of checkpoint:

- a Hugging Face safetensors folder (or file): a drop-in for
  ``torch.distributed.checkpoint.HuggingFaceStorageReader``, folders its writer saved in
  pieces (``save_distributed=True`` without consolidation) included;
- a DCP folder, what ``torch.distributed.checkpoint.save`` wrote (``.metadata`` and
  ``__R_N.distcp``, model and optimizer state alike, saved at any world size): a drop-in for
  ``FileSystemReader`` that never unpickles anything.

    from torch.distributed.checkpoint import load
    load(state_dict, storage_reader=zeroflat.dcp.Reader(path))

or, for the readers that DCP, the Trainer, accelerate and torchtitan construct themselves,
``zeroflat.dcp.install()`` (or ``with zeroflat.dcp.installed(): ...``): every
``FileSystemReader`` and ``HuggingFaceStorageReader`` made while it is in place reads through
``Reader``, and hands back to DCP's own what it does not serve (a checkpoint saved through DCP's
stream transforms), with one warning; ``zeroflat.dcp.stats`` counts both. With
``install(writer=True)`` every ``FileSystemWriter`` made while it is in place also writes
through ``zeroflat.dcp.Writer`` (a crash never costs the checkpoint before), or hands back to
DCP's own writer what Writer does not serve.

Each rank's requests (DCP's load planner asks for the part of each saved chunk its local
shards overlap) become one batch of exact byte ranges, read in parallel by the library's reader
(``_C.Checkpoint.read_boxes``: one pread per row run, neighbours merged, converted to the
target's dtype as torch rounds), never a tensor materialized whole. The metadata is read by the
library: safetensors headers, or DCP's ``.metadata`` pickle by its restricted reader (the
allow-list's DCP rows; nothing in the file runs). DCP's values saved as bytes (optimizer
hyperparameters) are read by the same restricted reader and handed to the planner as plain
values re-saved by ``torch.save``: what the planner's ``torch.load`` sees was written here."""

from __future__ import annotations

import dataclasses
import gc
import io
import os
import uuid

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageReader
from torch.futures import Future
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

import contextlib
import logging
import threading

from . import _C
from ._common import DTYPES, FILE_DTYPES as _DTYPES, bool_option, native_path

if TYPE_CHECKING:
    from . import _patches

__all__ = ["Reader", "Writer", "install", "installed", "uninstall", "is_installed", "stats"]

# The key under which a load plan carries the number of loading ranks (prepare_global_plan).
_RANKS = "zeroflat_ranks"
# A rank's local plan carries its rank in the job; the global plan, every loading rank's.
_RANK = "zeroflat_rank"
_MEMBERS = "zeroflat_members"
# The loading ranks' own gloo groups for the agreement, by their global ranks (a group of fewer
# ranks than the job; made once, by those ranks alone).
_GROUPS: Dict[Tuple[int, ...], object] = {}
try:  # HuggingFaceStorageReader's record of a piece (torch 2.8 and later)
    from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
except ImportError:  # an older torch: the same fields
    @dataclasses.dataclass
    class _HFStorageInfo:  # type: ignore[no-redef]
        relative_path: str
        shape: torch.Size
        dtype: torch.dtype


def _new_id() -> str:
    return str(uuid.uuid4())


# torch's dtype names a DCP index may give (the library checked them against its list).
_TORCH_DTYPES = {str(d).split(".")[-1]: d for d in _DTYPES.values()}


def _rank_index(name: str) -> bool:
    """``__<rank>.metadata``: one rank's own DCP index (a save without collectives)."""
    return name.startswith("__") and name.endswith(".metadata") and name[2:-9].isdigit()


class Reader(StorageReader):
    """Reads a checkpoint for ``torch.distributed.checkpoint.load``: a DCP folder (one holding
    ``.metadata``: every saved chunk, of model and optimizer state, where DCP's planner asks for
    it, resharded to this world), or a Hugging Face safetensors checkpoint (a ``.safetensors``
    file or a directory of them, with or without an index: every tensor one chunk under its own
    name, as ``HuggingFaceStorageReader`` gives it; in a folder saved in pieces, every piece a
    chunk at its ``saved_offsets``, the pieces checked to tile each tensor). ``threads``: reader
    threads per rank (default: the library's for the ranks of this host). ``bytes_read``: the
    file bytes this rank's reads fetched."""

    def __init__(self, path: Union[str, os.PathLike], threads: Optional[int] = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.threads = 0 if threads is None else int(threads)
        if self.threads < 0:
            raise ValueError(f"threads {threads!r}: expected a count >= 1, or None")
        self._ck: Optional["_C.Checkpoint"] = None
        self._dcp: Optional["_C.DcpCheckpoint"] = None
        # The DCP index read: the global one, or this rank's (a save without collectives).
        self._index = ".metadata"
        # This load's id, handed to the planner in the metadata's storage_meta, as DCP's
        # readers make one: at construction and at each reset.
        self.load_id: str = _new_id()
        self.bytes_read = 0

    # --- StorageReader ------------------------------------------------------------------------

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
            self._ck = self._dcp = None
            self._index = ".metadata"
        self.load_id = _new_id()
        self.bytes_read = 0

    @property
    def checkpoint_id(self) -> Union[str, os.PathLike]:
        """The checkpoint this reader reads (its path), as DCP's readers name it."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        p = os.fspath(checkpoint_id)
        if os.path.isfile(p):
            return p.endswith(".safetensors")
        return os.path.isdir(p) and any(
            f == ".metadata" or f.endswith(".safetensors") or _rank_index(f)
            for f in os.listdir(p))

    def _is_dcp(self) -> bool:
        # Anything under the index's name (a FIFO, a link, a folder too): DCP's reader then
        # refuses it by name, not as a folder without .safetensors files.
        return os.path.lexists(os.path.join(self.path, self._index)) or (
            self._index == ".metadata" and self._rank_indexes())

    def _rank_indexes(self) -> bool:
        """Whether the folder holds only ranks' own indexes (a save without collectives)."""
        return (os.path.isdir(self.path) and
                any(_rank_index(f) for f in os.listdir(self.path)) and
                not any(f.endswith(".safetensors") for f in os.listdir(self.path)))

    def _checkpoint(self) -> "_C.Checkpoint":
        if self._ck is None:
            self._ck = _C.Checkpoint(native_path(self.path), pieces=True)
        return self._ck

    def _dcp_checkpoint(self) -> "_C.DcpCheckpoint":
        if self._dcp is None:
            self._dcp = _C.DcpCheckpoint(native_path(self.path), native_path(self._index))
        return self._dcp

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """The checkpoint's index. A DCP folder saved without collectives has no global
        ``.metadata``: asked without ``rank``, this raises, and DCP's load asks again with
        ``rank=`` for that rank's own ``__<rank>.metadata`` (its items alone, each rank loading
        what it saved), as it does with its own reader."""
        rank = kwargs.get("rank")
        if rank is not None and not os.path.lexists(os.path.join(self.path, ".metadata")):
            index = f"__{int(rank)}.metadata"
            if index != self._index:
                self._index, self._dcp = index, None
        elif self._index == ".metadata" and self._rank_indexes():
            raise FileNotFoundError(
                f"{self.path}: no .metadata, only ranks' own indexes (__<rank>.metadata: a save "
                "without collectives); DCP's load reads them with rank=")
        metadata = self._dcp_metadata() if self._is_dcp() else self._safetensors_metadata()
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _safetensors_metadata(self) -> Metadata:
        """One chunk per tensor, or per piece of a folder DCP's HuggingFaceStorageWriter saved
        in pieces (each rank's file its shards, not consolidated): the library places each
        piece in its whole and checks that a name's pieces tile it."""
        ck = self._checkpoint()
        tensors, storage = {}, {}
        for t in ck.tensors():
            dtype = _DTYPES.get(str(t.dtype))
            if dtype is None:
                raise ValueError(f"{ck.path}: tensor {t.name!r} is {t.dtype}, a dtype DCP's "
                                 "metadata cannot name")
            offsets = torch.Size(list(t.offsets))
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(list(t.shape)))
            if t.name in tensors:
                tensors[t.name].chunks.append(chunk)
            else:
                tensors[t.name] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype), size=torch.Size(list(t.whole)),
                    chunks=[chunk])
            # HuggingFaceStorageReader's record of where each piece is.
            storage[MetadataIndex(fqn=t.name, offset=offsets)] = _HFStorageInfo(
                relative_path=os.path.basename(ck.files[t.file]),
                shape=torch.Size(list(t.shape)), dtype=dtype)
        return Metadata(state_dict_metadata=tensors, storage_data=storage)

    def _dcp_metadata(self) -> Metadata:
        """DCP's Metadata built here from the library's plain reading of ``.metadata``."""
        ck = self._dcp_checkpoint()
        items, storage, planner = {}, {}, {}
        # DCP's own record of where each saved item is (the file, its bytes), keyed as the save
        # keyed it (the chunk's index in its item too), made by the library.
        # Without the cyclic collector, which would otherwise scan the growing records over and
        # over (most of the time a large index takes): none of them holds a cycle.
        collecting = gc.isenabled()
        gc.disable()
        try:
            records = ck.records(size=torch.Size, chunk=ChunkStorageMetadata,
                                 index=MetadataIndex, info=_StorageInfo, storage=storage)
        finally:
            if collecting:
                gc.enable()
        for fqn, is_bytes, dtype, size, requires_grad, metas, path in records:
            if path is not None:
                planner[fqn] = path
            if is_bytes:
                items[fqn] = BytesStorageMetadata()
                continue
            items[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_TORCH_DTYPES[dtype],
                                            requires_grad=requires_grad),
                size=torch.Size(size), chunks=metas)
        saved = ck.storage_meta
        meta = (StorageMeta(checkpoint_id=saved[0], save_id=saved[1],
                            modules=list(saved[2])) if saved is not None else None)
        return Metadata(state_dict_metadata=items, storage_data=storage,
                        planner_data=planner or None, version=ck.version or None,
                        storage_meta=meta)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args,
                              **kwargs) -> None:
        rank = kwargs.get("rank")
        if not kwargs.get("use_collectives", True) and rank is not None:
            index = f"__{int(rank)}.metadata"
            if index != self._index:
                self._index, self._dcp = index, None
        if self._is_dcp():
            self._dcp_checkpoint()  # a reader given another rank's metadata reads the index
        else:
            self._checkpoint()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Which rank of the job made this plan: the coordinator learns the loading ranks.
        if dist.is_initialized():
            return dataclasses.replace(plan, storage_data={_RANK: dist.get_rank()})
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        # Each rank's plan carries the loading ranks (their ranks in the job, in the group's
        # order): read_data has them agree before anything is written.
        members = [p.storage_data.get(_RANK) if isinstance(p.storage_data, dict) else None
                   for p in plans]
        data = {_RANKS: len(plans)}
        if all(isinstance(m, int) for m in members) and len(set(members)) == len(members):
            data[_MEMBERS] = members
        return [dataclasses.replace(p, storage_data=dict(data)) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Every request of this rank in one batch of the library's reads, then each target
        committed. Everything is checked before the first target is written: the index, every
        chunk's archive (DCP), every value (parsed by the restricted reader), every target's
        shape; the loading ranks then agree (_agree), so that one rank's refusal leaves every
        loading rank's state as it was. A request for a tensor of a dtype the library does
        not convert is read whole (its chunk) and copied."""
        error, reads = None, None
        try:
            reads = self._plan_reads(plan, planner)
        except Exception as e:  # noqa: BLE001 - the other ranks learn of it first
            error = e
        self._agree(plan, error)
        index, jobs, values = reads
        self._write(index, jobs, planner)
        for req, buf in values:
            planner.load_bytes(req, buf)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    # --- the reads ----------------------------------------------------------------------------

    def _plan_reads(self, plan: LoadPlan, planner: LoadPlanner):
        """This rank's reads, every check made and nothing written: (the index of its chunks,
        one (request, name, target) per tensor request, the bytes values)."""
        values = []
        if self._is_dcp():
            ck = self._dcp_checkpoint()
            tensors = [req for req in plan.items if req.type != LoadItemType.BYTE_IO]
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    values.append((req, self._value(ck, req)))
            refs = [(req.storage_index.fqn, self._chunk(req)) for req in tensors]
            index = ck.chunks(refs)
        else:
            ck = self._checkpoint()
            tensors = []
            for req in plan.items:
                if req.type != LoadItemType.TENSOR:
                    raise ValueError(f"{ck.path}: {req.storage_index.fqn!r} is asked for as "
                                     "bytes; a safetensors checkpoint holds tensors only")
                tensors.append(req)
            index = ck.pieces([(req.storage_index.fqn, [int(o) for o in req.storage_index.offset]
                                if req.storage_index.offset is not None else [])
                               for req in tensors])
            # Its files still the ones whose headers were read (a file replaced, cut or gone
            # since): refused here, before the ranks agree, not found by the reads after.
            index.check_files()
        jobs = []
        for i, req in enumerate(tensors):
            target = planner.resolve_tensor(req).detach()
            if list(target.shape) != list(req.lengths):
                raise ValueError(f"{req.storage_index.fqn!r}: the target is "
                                 f"{list(target.shape)}, the request {list(req.lengths)}")
            jobs.append((req, f"#{i:012d}", target))
        return index, jobs, values

    def _agree(self, plan: LoadPlan, error: Optional[BaseException]) -> None:
        """Raises this rank's own error; where several ranks load, first tells each of them
        whether any refused (one all-reduce over the loading ranks: the job's default group
        when they are all of it, else a gloo group of their own, made once by them alone), and
        raises on each then."""
        group = self._loading_group(plan)
        if group is False:
            if error is not None:
                raise error
            return
        from ._comm import raise_agreed  # the collectives, only where ranks agree

        raise_agreed(error, group, f"zeroflat.dcp.Reader({self.path!r})'s agreement", "dcp",
                     lambda rank: ValueError(f"{self.path}: rank {rank} refused its part of the "
                                             "load (its error says why); nothing was written on "
                                             "this rank"))

    @staticmethod
    def _loading_group(plan: LoadPlan):
        """The process group of the ranks that load (None: the default one), or False where
        they cannot agree (one rank, no process group, a plan not stamped by this reader)."""
        data = plan.storage_data if isinstance(plan.storage_data, dict) else {}
        ranks, members = data.get(_RANKS), data.get(_MEMBERS)
        if not isinstance(ranks, int) or ranks <= 1 or not dist.is_initialized():
            return False
        if dist.get_world_size() == ranks:
            return None
        if not isinstance(members, list) or len(members) != ranks:
            return False
        key = tuple(sorted(members))
        if dist.get_rank() not in key:
            return False
        if key not in _GROUPS:
            try:
                _GROUPS[key] = dist.new_group(list(key), backend="gloo",
                                              use_local_synchronization=True)
            except TypeError:  # a torch without local synchronization: each rank its own
                _GROUPS[key] = False
        return _GROUPS[key]

    def _write(self, index: "_C.Checkpoint", jobs, planner: LoadPlanner) -> None:
        boxes, done = [], []
        for req, name, target in jobs:
            stored = index.find(name)
            if stored.type is None or target.dtype not in DTYPES:
                whole = torch.empty(list(stored.shape), dtype=_DTYPES[str(stored.dtype)])
                index.read(name, whole)
                self.bytes_read += stored.bytes
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    whole = whole.narrow(d, int(o), int(n))
                target.copy_(whole)
                planner.commit_tensor(req, target)
                continue
            # A target on the host is read into in place where it is contiguous; one on a device
            # (CUDA DTensors' local shards) through a host buffer of its box alone, copied after.
            on_host = target.device.type == "cpu"
            into = target if on_host and target.is_contiguous() else torch.empty(
                list(target.shape), dtype=target.dtype,
                pin_memory=not on_host and torch.cuda.is_available())
            boxes.append((name, [int(o) for o in req.storage_offsets],
                          [int(n) for n in req.lengths], into))
            done.append((req, target, into))
        if boxes:
            # A job of one rank: no other rank reads these files (the kernel's read-ahead).
            sole = not dist.is_initialized() or dist.get_world_size() == 1
            self.bytes_read += index.read_boxes(boxes, self.threads, sole)
        for req, target, into in done:
            if into is not target:
                target.copy_(into)
            planner.commit_tensor(req, target)

    def _chunk(self, req) -> int:
        index = req.storage_index
        offsets = [int(o) for o in index.offset] if index.offset is not None else None
        chunk = None if offsets is None else self._dcp_checkpoint().chunk_at(
            index.fqn, offsets, -1 if index.index is None else int(index.index))
        if chunk is None:
            raise ValueError(f"{self.path}: the planner asks for {index.fqn!r} at "
                             f"{offsets or []}, which the checkpoint's index does not list")
        return chunk

    def _value(self, ck, req) -> io.BytesIO:
        """A bytes item: its value made by the library's restricted reader, re-saved here by
        torch.save for the planner's torch.load."""
        fqn = req.storage_index.fqn
        length = self._dcp_checkpoint().bytes_length(fqn)
        if length is None:
            raise ValueError(f"{self.path}: the planner asks for {fqn!r} as bytes, which the "
                             "checkpoint's index does not list")
        value = ck.value(fqn)
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        self.bytes_read += length
        return buf


# ---- the install: the readers DCP and its callers construct --------------------------------------

log = logging.getLogger("zeroflat.dcp")

# What the installed readers did since the process started: loads served by zeroflat, loads
# handed back to DCP's own reader, and why each was handed back; the same of the saves of the
# installed writer (install(writer=True)).
stats = {"served": 0, "handed_back": 0, "handed_back_reasons": [],
         "saves_served": 0, "saves_handed_back": 0, "saves_handed_back_reasons": []}


def __getattr__(name: str) -> Any:
    """``Writer``, imported where it is first used: a load (``Reader``) pays for the reader
    alone, not for the save's modules."""
    if name != "Writer":
        raise AttributeError(f"module 'zeroflat.dcp' has no attribute {name!r}")
    from ._dcp_writer import Writer

    globals()["Writer"] = Writer
    return Writer


def __dir__() -> List[str]:
    return sorted(set(globals()) | {"Writer"})


_lock = threading.RLock()
_applied: Optional[_patches.Applied] = None
_writer_applied: Optional[_patches.Applied] = None
_warned: set = set()
# What Reader refuses that DCP's own reader reads, and so is handed back to it: the restricted
# reader has parsed the whole index first (only allow-listed classes), so what DCP then
# unpickles is such an index.
_HANDED_BACK = ("DCP's stream transforms",)


def _installed_class(base: type, reader_args) -> type:
    """``base`` (DCP's FileSystemReader or HuggingFaceStorageReader) reading through ``Reader``:
    a subclass (isinstance checks still hold) that decides at the load's first call whether
    zeroflat serves the checkpoint, and otherwise runs ``base``'s own methods."""

    class Installed(base):  # type: ignore[misc, valid-type]
        __doc__ = (f"DCP's {base.__name__} while zeroflat.dcp.install() is in place: reads "
                   "through zeroflat.dcp.Reader, or hands back to DCP's own what it does not "
                   "serve.")

        def __init__(self, path, *args, **kwargs):
            super().__init__(path, *args, **kwargs)
            self._zeroflat = Reader(path, **reader_args(*args, **kwargs))
            self._served: Optional[bool] = None
            self._same_load_id()

        def reset(self, checkpoint_id=None) -> None:
            super().reset(checkpoint_id)
            self._zeroflat.reset(checkpoint_id)
            self._served = None
            self._same_load_id()

        def _same_load_id(self) -> None:
            # One load, one id: the metadata zeroflat reads carries the id this reader shows.
            own = getattr(self, "load_id", None)
            if own is not None:
                self._zeroflat.load_id = own

        def read_metadata(self, *args, **kwargs) -> Metadata:
            if self._served is None:
                try:
                    metadata = self._zeroflat.read_metadata(*args, **kwargs)
                except ValueError as e:
                    if not any(words in str(e) for words in _HANDED_BACK):
                        raise
                    self._hand_back(str(e))
                    return super().read_metadata(*args, **kwargs)
                self._serve()
                return metadata
            if self._served:
                return self._zeroflat.read_metadata(*args, **kwargs)
            return super().read_metadata(*args, **kwargs)

        def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
            if self._served is None:  # a rank given the metadata, not reading it
                if any(getattr(info, "transform_descriptors", None)
                       for info in (metadata.storage_data or {}).values()):
                    self._hand_back("the checkpoint was saved through DCP's stream transforms")
                else:
                    self._serve()
            if self._served:
                self._zeroflat.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            else:
                super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

        def prepare_local_plan(self, plan):
            return (self._zeroflat if self._served else super()).prepare_local_plan(plan)

        def prepare_global_plan(self, plans):
            return (self._zeroflat if self._served else super()).prepare_global_plan(plans)

        def read_data(self, plan, planner):
            return (self._zeroflat if self._served else super()).read_data(plan, planner)

        @property
        def bytes_read(self) -> int:
            return self._zeroflat.bytes_read

        def _serve(self) -> None:
            self._served = True
            with _lock:
                stats["served"] += 1

        def _hand_back(self, why: str) -> None:
            self._served = False
            reason = f"{self.path}: {why}"
            with _lock:
                stats["handed_back"] += 1
                stats["handed_back_reasons"].append(reason)
                first = why not in _warned
                _warned.add(why)
            if first:
                log.warning("zeroflat.dcp: handed back to DCP's own %s: %s", base.__name__,
                            reason)

    Installed.__name__ = Installed.__qualname__ = base.__name__
    Installed.__module__ = __name__
    return Installed


def _patches_now() -> List[_patches.Patch]:
    from torch.distributed.checkpoint import filesystem

    from . import _patches

    fs = _installed_class(filesystem.FileSystemReader, lambda *a, **k: {})
    out = [_patches.Patch(owner, "FileSystemReader", value=fs, optional=optional)
           for owner, optional in (("torch.distributed.checkpoint", False),
                                   ("torch.distributed.checkpoint.filesystem", False),
                                   ("torch.distributed.checkpoint._storage_utils", True),
                                   ("torch.distributed.checkpoint.format_utils", True))]
    try:
        from torch.distributed.checkpoint import hf_storage
    except ImportError:  # a torch without DCP's Hugging Face reader
        return out
    hf = _installed_class(hf_storage.HuggingFaceStorageReader,
                          lambda thread_count=1, *a, **k: {})
    out += [_patches.Patch(owner, "HuggingFaceStorageReader", value=hf, optional=True)
            for owner in ("torch.distributed.checkpoint",
                          "torch.distributed.checkpoint.hf_storage")]
    return out


def _note_save(served: bool, reason: str) -> None:
    """What the installed writer did with one save."""
    with _lock:
        if served:
            stats["saves_served"] += 1
            return
        stats["saves_handed_back"] += 1
        stats["saves_handed_back_reasons"].append(reason)
        why = reason.split(": ", 1)[-1]
        first = ("writer", why) not in _warned
        _warned.add(("writer", why))
    if first:
        log.warning("zeroflat.dcp: handed back to DCP's own FileSystemWriter: %s", reason)


def _writer_patches() -> List[_patches.Patch]:
    from . import _patches
    from ._dcp_writer import installed_writer_class

    from torch.distributed.checkpoint import filesystem

    fs = installed_writer_class(filesystem.FileSystemWriter, _note_save)
    return [_patches.Patch(owner, "FileSystemWriter", value=fs, optional=optional)
            for owner, optional in (("torch.distributed.checkpoint", False),
                                    ("torch.distributed.checkpoint.filesystem", False),
                                    ("torch.distributed.checkpoint._storage_utils", True),
                                    ("torch.distributed.checkpoint.format_utils", True))]


def install(*, writer: bool = False) -> None:
    """Makes the readers DCP and its callers construct zeroflat's: ``FileSystemReader`` (what
    ``dcp.load(state_dict, checkpoint_id=...)`` makes, and the Trainer's and accelerate's FSDP
    checkpoints, ``load_state``, and torchtitan use) and ``HuggingFaceStorageReader``. Each
    reads through ``Reader``, or, for a checkpoint it does not serve (saved through DCP's stream
    transforms), hands back to DCP's own reader with one warning; ``stats`` counts both. The
    readers are subclasses of DCP's own (``isinstance`` holds).

    ``writer=True``: ``FileSystemWriter`` too (what ``dcp.save``/``dcp.async_save`` with a
    ``checkpoint_id`` make, and their callers): it writes through ``Writer``, the old folder's
    other files kept as DCP's writer keeps them, or hands back to DCP's own writer, with one
    warning, what Writer does not serve (several files per rank, stream transforms, the
    safetensors format, ``overwrite=False``, a save without collectives); ``stats["saves_*"]``
    count both. ``HuggingFaceStorageWriter`` stays DCP's.

    Installing twice is harmless (``writer=True`` later adds the writer); nothing is patched at
    import (docs/patches.md)."""
    from . import _patches

    global _applied, _writer_applied
    writer = bool_option("writer", writer)
    with _lock:
        if _applied is None:
            _applied = _patches.apply(_patches_now())
        if writer and _writer_applied is None:
            _writer_applied = _patches.apply(_writer_patches())


def uninstall() -> None:
    """Puts DCP's readers (and writer) back. Harmless when not installed."""
    from . import _patches

    global _applied, _writer_applied
    with _lock:
        for applied in (_writer_applied, _applied):
            if applied is not None:
                _patches.restore(applied)
        _applied = _writer_applied = None


def is_installed() -> bool:
    return _applied is not None


@contextlib.contextmanager
def installed(*, writer: bool = False):
    """``with zeroflat.dcp.installed(): trainer.train(resume_from_checkpoint=...)``;
    ``install()``'s options."""
    global _writer_applied
    was, had_writer = is_installed(), _writer_applied is not None
    install(writer=writer)
    try:
        yield
    finally:
        if not was:
            uninstall()
        elif not had_writer:
            from . import _patches

            with _lock:
                if _writer_applied is not None:
                    _patches.restore(_writer_applied)
                    _writer_applied = None
