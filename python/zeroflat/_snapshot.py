"""A snapshot of what ``torch.save`` would write, taken at memory speed, for the library to write
in the background (include/zeroflat/save.h: write_torch_file, BackgroundSave).

``torch.save`` pickles the object with each storage replaced by a persistent id
``("storage", <storage class>, <key>, <location>, <numel>)`` and writes each storage's bytes as
the record ``data/<key>`` of a zip archive. ``Snapshot.add`` does the same pickling (protocol 2,
storages deduplicated by identity, keys "0", "1", ... in first-seen order) and copies each
storage's bytes into ``Staging``: memory reused from save to save (pinned host memory when a
storage is on an accelerator, copied on a side stream), so that the caller may change its
tensors as soon as ``add`` returns. The library then writes the records from there.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, List, Tuple

import torch

from . import _C

_ALIGN = 64
_SEGMENT_FLOOR = 64 << 20


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Staging:
    """Host memory a rank's snapshots are copied into, reused from save to save.

    A save places its storages one after the other (64-byte aligned). When a save needs more
    than there is, a further segment holds the rest; the next save then starts from one segment
    the size of the last save's need, so that a state of steady size stays in one buffer that
    never grows (at most the rank's state plus the alignment)."""

    def __init__(self):
        self._segments: List[torch.Tensor] = []
        self._pinned = False
        self._at = (0, 0)  # (segment, offset) of the next placement
        self.need = 0      # bytes the save placed so far needs
        self.last_need = 0

    @property
    def capacity(self) -> int:
        return sum(s.numel() for s in self._segments)

    def begin(self, pinned: bool) -> None:
        """A new save: the memory it will place into (the last save's bytes must be written)."""
        want = self.last_need
        if (pinned and not self._pinned) or len(self._segments) > 1 or (
                self._segments and self._segments[0].numel() < want):
            self._segments = []
        if not self._segments and want:
            self._segments = [self._new(want, pinned)]
            self._pinned = pinned
        self._at = (0, 0)
        self.need = 0

    def _new(self, nbytes: int, pinned: bool) -> torch.Tensor:
        pinned = pinned and torch.cuda.is_available()
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)

    def place(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """``nbytes`` of staging for one storage (a uint8 tensor over them)."""
        size = _align(max(nbytes, 1))
        self.need += size
        seg, off = self._at
        while seg < len(self._segments) and off + size > self._segments[seg].numel():
            seg, off = seg + 1, 0
        if seg == len(self._segments):
            grow = max(size, _SEGMENT_FLOOR, self.last_need // 4)
            self._segments.append(self._new(grow, pinned))
            self._pinned = self._pinned or pinned
        self._at = (seg, off + size)
        return self._segments[seg][off:off + nbytes]

    def end(self) -> None:
        self.last_need = max(self.need, 1)


class _Pickler(pickle.Pickler):
    """torch.save's pickling: storages by persistent id, recorded in ``found``."""

    def __init__(self, buf, found: List[Tuple[str, Any]]):
        super().__init__(buf, protocol=2)
        self._keys = {}
        self._dtypes = {}
        self._found = found

    def persistent_id(self, obj):
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            dtype = obj.dtype
            storage_type = getattr(torch, obj._pickle_storage_type())
            numel = obj._size()
        elif torch.is_storage(obj):
            storage = obj
            dtype = torch.uint8
            storage_type = torch.serialization.normalize_storage_type(type(obj))
            numel = storage.nbytes()
        else:
            return None
        if storage.data_ptr() != 0:
            seen = self._dtypes.setdefault(storage.data_ptr(), dtype)
            if seen != dtype:
                raise RuntimeError("Cannot save multiple tensors or storages that view the same "
                                   "data as different types")
        key = self._keys.get(storage._cdata)
        if key is None:
            key = self._keys[storage._cdata] = str(len(self._keys))
            self._found.append((key, storage))
        return ("storage", storage_type, key, torch.serialization.location_tag(storage), numel)


class Snapshot:
    """The files of one save: each one's pickle and its storages' staged bytes."""

    def __init__(self, staging: Staging, threads: int):
        self.staging = staging
        self.threads = max(1, threads)
        self.files: List[Tuple[str, bytes, List[Tuple[str, int, int]]]] = []
        self.bytes = 0
        self._keep: List[torch.Tensor] = []

    def add(self, obj: Any, path: str) -> None:
        """Snapshots ``obj`` as ``torch.save(obj, path)`` would write it."""
        found: List[Tuple[str, Any]] = []
        buf = io.BytesIO()
        _Pickler(buf, found).dump(obj)
        records = []
        host = []
        device = []
        for key, storage in found:
            n = storage.nbytes()
            on_host = storage.device.type == "cpu"
            dst = self.staging.place(n, pinned=not on_host)
            records.append((key, dst.data_ptr(), n))
            if n == 0:
                continue
            if on_host:
                host.append((dst.data_ptr(), storage.data_ptr(), n))
            else:
                src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                device.append((dst, src))
            self.bytes += n
        if host:
            _C.stage_copies(host, self.threads)
        if device:
            self._copy_from_devices(device)
        self.files.append((path, buf.getvalue(), records))

    @staticmethod
    def _copy_from_devices(pairs) -> None:
        cuda = [p for p in pairs if p[1].device.type == "cuda"]
        for dst, src in pairs:
            if src.device.type != "cuda":
                dst.copy_(src)
        if cuda:
            side = torch.cuda.Stream(device=cuda[0][1].device)
            side.wait_stream(torch.cuda.current_stream(cuda[0][1].device))
            with torch.cuda.stream(side):
                for dst, src in cuda:
                    dst.copy_(src, non_blocking=True)
            side.synchronize()
