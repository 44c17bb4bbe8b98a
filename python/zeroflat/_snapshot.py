"""A snapshot of what ``torch.save`` would write, taken at memory speed, for the library to write
in the background (include/zeroflat/save.h: write_torch_file, BackgroundSave).

``torch.save`` pickles the object with each storage replaced by a persistent id
``("storage", <storage class>, <key>, <location>, <numel>)`` and writes each storage's bytes as
the record ``data/<key>`` of a zip archive. ``Snapshot.add`` does the same pickling (protocol 2,
storages deduplicated by identity, keys "0", "1", ... in first-seen order) and copies each
storage's bytes into ``Staging`` (``copy_host``): memory reused from save to save (pinned host
memory when a storage is on an accelerator, copied on a side stream), so that the caller may
change its tensors as soon as ``add`` returns. The library then writes the records from there.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _C

_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Staging:
    """Host memory a rank's snapshots are copied into, reused from save to save.

    A save places each file's storages one after the other (64-byte aligned; one of
    SAVE_DIRECT_MIN_BYTES or more at its data's place within a page of its file, with a page of
    room for it, so that the writer writes its whole pages with O_DIRECT) in the segments there
    are; what does not fit gets one new segment of exactly the rest of that file. The
    next save places the same sizes in the same order, so a state of steady size fits the same
    segments again: the staging holds the rank's state (plus at most one storage's tail per
    segment) and never grows. When a save needed 256 MiB less than there is (the state shrank),
    the next one starts from a single segment of that need."""

    SLACK = 256 << 20

    def __init__(self):
        self._segments: List[torch.Tensor] = []
        self._pinned = False
        self._at = (0, 0)  # (segment, offset) of the next placement
        self.need = 0      # bytes the save placed so far needs
        self.last_need = 0

    @property
    def capacity(self) -> int:
        return sum(s.numel() for s in self._segments)

    def begin(self, pinned: bool, limit: Optional[int] = None) -> None:
        """A new save: the memory it will place into (the last save's bytes must be written).
        ``limit``: the most the staging may hold (its segments dropped when they hold more)."""
        pinned = pinned and torch.cuda.is_available()
        if limit is not None and self.capacity > limit:
            self._segments = []
            self.last_need = min(self.last_need, limit)
        if (pinned and not self._pinned) or self.capacity > self.last_need + self.SLACK:
            self._segments = []
            if self.last_need:
                self._segments = [self._new(self.last_need, pinned)]
            self._pinned = pinned
        self._at = (0, 0)
        self.need = 0

    def _new(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)

    @staticmethod
    def _reserved(sizes: List[int], phases: Optional[List[Optional[int]]]) -> List[int]:
        """The bytes each placement takes: 64-byte aligned, and a page more for one placed at a
        phase (so that a state of steady size takes the same room whatever its phases)."""
        phases = phases or [None] * len(sizes)
        return [_align(max(n, 1)) + (0 if ph is None else _C.SAVE_DIRECT_ALIGN)
                for n, ph in zip(sizes, phases)]

    def growth(self, sizes: List[int], phases: Optional[List[Optional[int]]] = None) -> int:
        """The bytes ``place(sizes, phases)`` would allocate (0: they fit where there is room)."""
        aligned = self._reserved(sizes, phases)
        seg, off = self._at
        for i, size in enumerate(aligned):
            while seg < len(self._segments) and off + size > self._segments[seg].numel():
                seg, off = seg + 1, 0
            if seg == len(self._segments):
                return sum(aligned[i:])
            off += size
        return 0

    def place(self, sizes: List[int], pinned: bool,
              phases: Optional[List[Optional[int]]] = None) -> List[torch.Tensor]:
        """Staging for one file's storages: a uint8 tensor of each size; one with a phase (not
        None) begins that many bytes into a page of SAVE_DIRECT_ALIGN bytes (its data's place in
        its page of the file: the writer writes its whole pages with O_DIRECT, save.h)."""
        pinned = pinned and torch.cuda.is_available()
        aligned = self._reserved(sizes, phases)
        phases = phases or [None] * len(sizes)
        self.need += sum(aligned)
        out = []
        seg, off = self._at
        for i, (n, size, phase) in enumerate(zip(sizes, aligned, phases)):
            while seg < len(self._segments) and off + size > self._segments[seg].numel():
                seg, off = seg + 1, 0
            if seg == len(self._segments):
                self._segments.append(self._new(sum(aligned[i:]), pinned))
                self._pinned = self._pinned or pinned
            start = off
            if phase is not None:
                start += (phase - self._segments[seg].data_ptr() - off) % _C.SAVE_DIRECT_ALIGN
            out.append(self._segments[seg][start:start + n])
            off += size
        self._at = (seg, off)
        return out

    def end(self) -> None:
        self.last_need = self.need


_STORAGES = (torch.storage.TypedStorage, torch.storage.UntypedStorage)


def copy_host(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies each (to, from) pair of contiguous host tensors of one dtype and size in one
    library call without the GIL, split over as many threads as torch's intra-op pool has (the
    caller's alone when it has one). Into staging reused past the cache the library writes with
    streaming stores: a 517 MiB ZeRO-2 state right after a training step took 28 ms on two
    threads against 36 ms for torch's own ``_foreach_copy_`` (docs/performance.md)."""
    todo = [(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size()) for d, s in pairs]
    todo = [t for t in todo if t[2]]
    if todo:
        _C.stage_copies(todo, max(1, torch.get_num_threads()))


_removals_hooked_pid: Optional[int] = None


def finish_removals() -> None:
    """Waits for the library's removal of the checkpoints that publications replaced (it runs
    in a thread once the new one is published). One it could not remove is said in a warning
    and left to the next save's clean-up, which tries again: the new checkpoint is whole."""
    import logging

    try:
        _C.finish_removals()
    except Exception as e:  # noqa: BLE001 - said, not raised: nothing saved is at stake
        logging.getLogger("zeroflat").warning(
            "zeroflat: the checkpoint a save replaced was not removed (the next save's clean-up "
            "tries again): %s", e)


def finish_removals_at_exit() -> None:
    """Makes this process's end wait for ``finish_removals``: the library's own exit handler
    covers an interpreter's ordinary end; a process that multiprocessing started ends through
    ``os._exit`` after its finalizers, so one is registered there. Once per process."""
    global _removals_hooked_pid
    if _removals_hooked_pid == os.getpid():
        return
    _removals_hooked_pid = os.getpid()
    import multiprocessing.util

    multiprocessing.util.Finalize(None, finish_removals, exitpriority=90)


def _bytes_of(storage, begin: int = 0, n: Optional[int] = None) -> torch.Tensor:
    """A uint8 tensor over ``n`` bytes of ``storage`` from ``begin`` (all of them by default)."""
    t = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return t[begin:begin + (storage.nbytes() - begin if n is None else n)]


class Pickler(pickle.Pickler):
    """torch.save's pickling: storages by persistent id, recorded in ``found``."""

    def __init__(self, buf, found: List[Tuple[str, Any]]):
        super().__init__(buf, protocol=2)
        self._keys = {}
        self._dtypes = {}
        self._found = found

    def persistent_id(self, obj):
        if not isinstance(obj, _STORAGES):
            return None
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

    def __init__(self, staging: Staging, free: Optional[int] = None):
        self.staging = staging
        # Host memory the staging may still grow by (None: no limit); past it, a file's host
        # tensors are written from where they are, and the save blocks until they are (the
        # writer writes those files first: BackgroundSave.add_file's `first`).
        self.free = free
        self.file_direct: List[bool] = []
        self._keep: List[Any] = []
        # Each file: (path, pickle, [(key, address, size, parts)]).
        self.files: List[Tuple[str, bytes, list]] = []
        # Each storage written by every rank: (file index, storage index, shared id, size).
        self.shared: List[Tuple[int, int, int, int]] = []
        # Another rank's parts of the first rank's shared records: (path, offset, address, size).
        self.parts: List[Tuple[str, int, int, int]] = []
        self.bytes = 0
        self._staged_parts: Dict[int, Tuple[int, int, int, int]] = {}

    def add(self, obj: Any, path: str, shared: Optional[Dict[int, int]] = None,
            ranks: int = 1) -> None:
        """Snapshots ``obj`` as ``torch.save(obj, path)`` would write it. A storage whose
        ``_cdata`` is a key of ``shared`` (an id every rank gives the same bytes) is written by
        ``ranks`` ranks together: only this rank's part (part 0) is copied here."""
        found: List[Tuple[str, Any]] = []
        buf = io.BytesIO()
        Pickler(buf, found).dump(obj)
        records = []
        host = []
        device = []
        on_device = any(storage.device.type != "cpu" for _, storage in found)
        ids = [(shared or {}).get(storage._cdata) if ranks > 1 else None for _, storage in found]
        sizes = [storage.nbytes() if i is None else _C.share_range(storage.nbytes(), ranks, 0)[1]
                 for (_, storage), i in zip(found, ids)]
        pickled = buf.getvalue()
        phases = self._phases(path, pickled, found, sizes, ids, ranks)
        # Host storages stay where they are when staging them would take more than is free.
        direct = [False] * len(found)
        if self.free is not None:
            grow = self.staging.growth(sizes, phases)
            if grow > self.free:
                direct = [storage.device.type == "cpu" for _, storage in found]
            else:
                self.free -= grow
        places = self.staging.place([0 if d else n for d, n in zip(direct, sizes)], on_device,
                                    phases)
        for index, ((key, storage), dst, n, i, d) in enumerate(zip(found, places, sizes, ids,
                                                                   direct)):
            on_host = storage.device.type == "cpu"
            if d:  # written from the tensor itself: the save blocks until it is
                self._keep.append(storage)
                records.append((key, storage.data_ptr(), storage.nbytes(),
                                1 if i is None else ranks))
            else:
                records.append((key, dst.data_ptr(), storage.nbytes(), 1 if i is None else ranks))
            if i is not None:
                self.shared.append((len(self.files), index, i, storage.nbytes()))
            if n == 0 or d:
                continue
            if on_host:
                host.append((dst, _bytes_of(storage, 0, n)))
            else:
                device.append((dst, _bytes_of(storage, 0, n)))
            self.bytes += n
        if host:
            copy_host(host)
        if device:
            self._copy_from_devices(device)
        self.files.append((path, pickled, records))
        self.file_direct.append(any(direct))

    @staticmethod
    def _phases(path, pickled, found, sizes, ids, ranks) -> Optional[List[Optional[int]]]:
        """Where in its page each large storage's staged bytes go: its data's offset in the file
        modulo SAVE_DIRECT_ALIGN (the layout the writer will make), so that the writer writes
        its whole pages with O_DIRECT from the staging; None for the small ones, or for all when
        the writes go through the page cache (ZEROFLAT_SAVE_IO=buffered)."""
        if not _C.save_direct_io() or max(sizes, default=0) < _C.SAVE_DIRECT_MIN_BYTES:
            return None
        records = [(key, 0, storage.nbytes(), 1 if i is None else ranks)
                   for (key, storage), i in zip(found, ids)]
        offsets = _C.torch_file_data_offsets((path, pickled, records))
        return [off % _C.SAVE_DIRECT_ALIGN if n >= _C.SAVE_DIRECT_MIN_BYTES else None
                for off, n in zip(offsets, sizes)]

    def stage_parts(self, tensors: List[torch.Tensor], rank: int, ranks: int) -> None:
        """Copies this rank's part of each shared tensor's storage (``tensors[i]``: shared id
        i), before the first rank's layout says where they go (``place_parts``)."""
        self._staged_parts = {}
        chunks = []
        for i, t in enumerate(tensors):
            storage = t.untyped_storage()
            begin, end = _C.share_range(storage.nbytes(), ranks, rank)
            chunks.append((i, storage, begin, end - begin))
        on_device = any(c[1].device.type != "cpu" for c in chunks)
        places = self.staging.place([c[3] for c in chunks], on_device)
        host, device = [], []
        for (i, storage, begin, n), dst in zip(chunks, places):
            self._staged_parts[i] = (dst.data_ptr(), begin, n, storage.nbytes())
            if n == 0:
                continue
            if storage.device.type == "cpu":
                host.append((dst, _bytes_of(storage, begin, n)))
            else:
                device.append((dst, _bytes_of(storage, begin, n)))
            self.bytes += n
        if device:
            self._copy_from_devices(device)
        if host:
            copy_host(host)

    def layout_words(self, folder: str) -> List[int]:
        """The shared records' places in their files (the first rank's layout), as integers for
        an all-reduce: each file's path (relative to the tag's ``folder``), then its records'
        (data offset, shared id, size). ``place_parts`` reads them back."""
        words: List[int] = []
        paths: Dict[str, list] = {}
        offsets = {}  # each file laid out once (the layout copies its pickle into the library)
        for f, index, i, size in self.shared:
            if f not in offsets:
                offsets[f] = _C.torch_file_data_offsets(self.files[f])
            path = os.path.relpath(self.files[f][0], folder)
            paths.setdefault(path, []).append((offsets[f][index], i, size))
        for path, records in paths.items():
            raw = os.fsencode(path)
            words += [len(raw), len(records)]
            words += [int.from_bytes(raw[k:k + 7], "little") for k in range(0, len(raw), 7)]
            for record in records:
                words += list(record)
        return words

    def place_parts(self, words: List[int], folder: str) -> None:
        """This rank's part of each shared record at its place in the first rank's layout
        (``layout_words``, the paths under this rank's ``folder``), from what ``stage_parts``
        copied."""
        at = 0
        while at < len(words):
            length, count = words[at], words[at + 1]
            at += 2
            raw = b"".join(w.to_bytes(7, "little") for w in words[at:at + (length + 6) // 7])
            path = os.path.join(folder, os.fsdecode(raw[:length]))
            at += (length + 6) // 7
            for offset, i, size in zip(*[iter(words[at:at + 3 * count])] * 3):
                if i not in self._staged_parts or self._staged_parts[i][3] != size:
                    held = self._staged_parts.get(i, (0, 0, 0, None))[3]
                    raise RuntimeError(f"shared storage {i} holds {held} bytes here, {size} on "
                                       "the first rank")
                address, begin, n, _ = self._staged_parts[i]
                self.parts.append((path, offset + begin, address, n))
            at += 3 * count

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
