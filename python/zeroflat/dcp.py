"""A PyTorch Distributed Checkpoint ``StorageReader`` over the library's reader: a drop-in for
``torch.distributed.checkpoint.HuggingFaceStorageReader`` on Hugging Face safetensors folders.

    from torch.distributed.checkpoint import load
    load(model_state_dict, storage_reader=zeroflat.dcp.Reader(path))

Each rank's requests (DCP's load planner asks for the part of each tensor its local shards
hold) become one batch of exact byte ranges, read in parallel by the library's reader
(``_C.Checkpoint.read_boxes``: one pread per row run, neighbours merged, converted to the
target's dtype as torch rounds), never a tensor materialized whole. The headers are read by
the library (no pickle, no code named by the file)."""

from __future__ import annotations

import os

from typing import List, Optional, Union

import torch
from torch.distributed.checkpoint import StorageReader
from torch.futures import Future
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from . import _C
from ._common import DTYPES

__all__ = ["Reader"]

# Safetensors dtypes as torch names them (what DCP's metadata carries).
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class Reader(StorageReader):
    """Reads a Hugging Face safetensors checkpoint (a ``.safetensors`` file or a directory of
    them, with or without an index) for ``torch.distributed.checkpoint.load``, as
    ``HuggingFaceStorageReader`` does: every tensor one chunk under its own name. ``threads``:
    reader threads per rank (default: the library's for the ranks of this host)."""

    def __init__(self, path: Union[str, os.PathLike], threads: Optional[int] = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.threads = 0 if threads is None else int(threads)
        if self.threads < 0:
            raise ValueError(f"threads {threads!r}: expected a count >= 1, or None")
        self._ck: Optional["_C.Checkpoint"] = None
        self.load_id: Optional[str] = None
        self.bytes_read = 0

    # --- StorageReader ------------------------------------------------------------------------

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
            self._ck = None
        self.load_id = str(checkpoint_id) if checkpoint_id is not None else None
        self.bytes_read = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        p = os.fspath(checkpoint_id)
        if os.path.isfile(p):
            return p.endswith(".safetensors")
        return os.path.isdir(p) and any(f.endswith(".safetensors") for f in os.listdir(p))

    def _checkpoint(self) -> "_C.Checkpoint":
        if self._ck is None:
            self._ck = _C.Checkpoint(self.path)
        return self._ck

    def read_metadata(self, *args, **kwargs) -> Metadata:
        ck = self._checkpoint()
        tensors, storage = {}, {}
        for t in ck.tensors():
            dtype = _DTYPES.get(str(t.dtype))
            if dtype is None:
                raise ValueError(f"{ck.path}: tensor {t.name!r} is {t.dtype}, a dtype DCP's "
                                 "metadata cannot name")
            shape = torch.Size(list(t.shape))
            zeros = torch.Size([0] * len(shape))
            tensors[t.name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype), size=shape,
                chunks=[ChunkStorageMetadata(offsets=zeros, sizes=shape)])
            storage[MetadataIndex(fqn=t.name, offset=zeros)] = t.name
        metadata = Metadata(state_dict_metadata=tensors, storage_data=storage)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args,
                              **kwargs) -> None:
        self._checkpoint()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Every request of this rank in one batch of the library's reads, then each target
        committed. A request for a tensor of a dtype the library does not convert is read whole
        and copied."""
        ck = self._checkpoint()
        boxes, done = [], []
        for req in plan.items:
            if req.type != LoadItemType.TENSOR:
                raise ValueError(f"{ck.path}: {req.storage_index.fqn!r} is asked for as bytes; "
                                 "a safetensors checkpoint holds tensors only")
            target = planner.resolve_tensor(req).detach()
            name = req.storage_index.fqn
            stored = ck.find(name)
            if list(target.shape) != list(req.lengths):
                raise ValueError(f"{name!r}: the target is {list(target.shape)}, the request "
                                 f"{list(req.lengths)}")
            if stored.type is None or target.dtype not in DTYPES or target.device.type != "cpu":
                whole = torch.empty(list(stored.shape), dtype=_DTYPES[str(stored.dtype)])
                ck.read(name, whole)
                self.bytes_read += stored.bytes
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    whole = whole.narrow(d, int(o), int(n))
                target.copy_(whole)
                planner.commit_tensor(req, target)
                continue
            into = target if target.is_contiguous() else torch.empty(
                list(target.shape), dtype=target.dtype)
            boxes.append((name, [int(o) for o in req.storage_offsets],
                          [int(n) for n in req.lengths], into))
            done.append((req, target, into))
        if boxes:
            self.bytes_read += ck.read_boxes(boxes, self.threads)
        for req, target, into in done:
            if into is not target:
                target.copy_(into)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut
