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
folder is replaced whole: files of the old folder that the save did not write are gone with it.
``.metadata`` holds only DCP's dataclasses, torch's sizes, dtypes, layouts and memory formats:
the classes ``zeroflat.dcp.Reader``'s restricted reader allows.

    dcp.save(state_dict, storage_writer=zeroflat.dcp.Writer(path))
    dcp.async_save(state_dict, storage_writer=zeroflat.dcp.Writer(path))  # DCP stages, then this
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import uuid
from typing import Any, List, Optional, Union

import torch
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _C
from ._errors import InvalidArgument

_SUFFIX = ".distcp"
_METADATA = ".metadata"
# The version DCP's own writer records (its readers accept it).
_DCP_VERSION = "1.0.0"


class Writer(StorageWriter):
    """A drop-in for ``FileSystemWriter(path)`` under ``dcp.save`` and ``dcp.async_save``, with
    the crash ordering of the module's docstring. ``sync_files=False`` skips the fsyncs (then
    nothing is promised after a crash). One file per rank; DCP's stream transforms, its
    safetensors format and saves without collectives (``no_dist``'s per-rank metadata) are not
    served (InvalidArgument)."""

    def __init__(self, path: Union[str, os.PathLike], sync_files: bool = True) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.sync_files = bool(sync_files)
        self.save_id = uuid.uuid4().hex
        self.rank: Optional[int] = None
        self.is_coordinator = False

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
        results = []
        with open(path, "wb") as f:
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = f.tell()
                if item.type == WriteItemType.BYTE_IO:
                    f.write(data.getbuffer())
                else:
                    tensor = data.detach()
                    if tensor.device.type != "cpu":
                        tensor = tensor.cpu()
                    torch.save(tensor, f)
                length = f.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        fut: Future = Future()
        fut.set_result(results)
        return fut

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
        if self.sync_files:
            _C.sync_tree(folder)
        _C.publish_tag(parent, partial, name)
