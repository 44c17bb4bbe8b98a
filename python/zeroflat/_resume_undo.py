"""A resume's write made all or nothing (``_resume_write``): what the write may change, recorded
before its first change and put back if it fails anywhere."""

from __future__ import annotations

import bisect
from typing import Any, Dict, List, Optional

import torch


class Undo:
    """What a write may change, recorded before the first change, so that a write that fails at
    any point (zeroflat's, the optimizer's load_state_dict, torch's __setstate__, a scheduler's,
    a KeyboardInterrupt) leaves the engine as it was: the values of every tensor it may write
    in place (host copies), the objects whose attributes it may set (their attributes as they
    were: a replaced value is put back, one added is removed), single attributes of others (the
    engine's counters; a parameter's data and status). ``restore`` puts it all back, in reverse
    order, with no collective."""

    def __init__(self, put_back: Optional[List[torch.Tensor]] = None) -> None:
        """``put_back``: tensors restored otherwise (the optimizer's tensors a resume read
        into, which it puts back from the 16-bit weights or to zeros): not recorded."""
        self._tensors: List[Any] = []  # (tensor, its values on the host)
        # Per device, the bytes recorded so far: sorted, disjoint [first byte, end) runs (a
        # tensor within them needs no record of its own: restore puts those bytes back).
        self._seen: Dict[Any, List[List[int]]] = {}
        self._skip = {(t.device, t.data_ptr()) for t in (put_back or [])}
        self._objects: List[Any] = []  # (object, its attributes as they were)
        self._attrs: List[Any] = []    # (object, name, value or _MISSING)

    def tensor(self, t: Optional[torch.Tensor]) -> None:
        """A tensor's values, unless its bytes were all recorded before (a parameter's view of
        its group's flat buffer). O(log n) a tensor: an engine records one per frozen parameter
        and buffer."""
        if t is None or not torch.is_tensor(t) or t.numel() == 0:
            return
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        if (t.device, lo) in self._skip:
            return
        runs = self._seen.setdefault(t.device, [])
        k = bisect.bisect_right(runs, [lo, float("inf")]) - 1  # the last run from lo or before
        if k >= 0 and hi <= runs[k][1]:
            return
        # Merged with the runs it touches, so that the list stays sorted and disjoint.
        start, end = lo, hi
        first = k if k >= 0 and runs[k][1] >= lo else k + 1
        last = first
        while last < len(runs) and runs[last][0] <= end:
            start, end = min(start, runs[last][0]), max(end, runs[last][1])
            last += 1
        runs[first:last] = [[start, end]]
        with torch.no_grad():
            self._tensors.append((t, t.detach().to("cpu", copy=True)))

    def state(self, obj: Any) -> None:
        """An object's attributes, and the values of the tensors in its dicts of tensors (an
        optimizer's state: updated in place by some releases)."""
        if obj is None or not hasattr(obj, "__dict__") or any(o is obj for o, _ in self._objects):
            return
        self._objects.append((obj, dict(vars(obj))))
        state = getattr(obj, "state", None)
        if isinstance(state, dict):
            # Each entry as it is, with its contents (a dict of one parameter's state).
            saved = {k: (v, dict(v) if isinstance(v, dict) else None) for k, v in state.items()}
            self._attrs.append((state, None, saved))
            for v in state.values():
                for t in (v.values() if isinstance(v, dict) else ()):
                    self.tensor(t)
        groups = getattr(obj, "param_groups", None)
        if isinstance(groups, list):
            self._attrs.append((groups, None, [(g, dict(g)) for g in groups]))

    def attr(self, obj: Any, name: str) -> None:
        self._attrs.append((obj, name, getattr(obj, name, _MISSING)))

    def data(self, p: torch.Tensor) -> None:
        """A parameter re-pointed or freed by the write: its data as it is now (a copy: a
        partitioning may free the storage in place) and its ZeRO-3 status."""
        self._attrs.append((p, ".data", (p.data, p.data.detach().clone())))
        if hasattr(p, "ds_status"):
            self.attr(p, "ds_status")

    def restore(self) -> None:
        with torch.no_grad():
            for obj, name, value in reversed(self._attrs):
                if name is None and isinstance(obj, dict):  # an optimizer's state: its entries
                    obj.clear()
                    for k, (entry, contents) in value.items():
                        if contents is not None:
                            entry.clear()
                            entry.update(contents)
                        obj[k] = entry
                elif name is None:  # param_groups: the groups and their entries
                    obj[:] = [g for g, _ in value]
                    for g, entries in value:
                        g.clear()
                        g.update(entries)
                elif name == ".data":
                    old, values = value
                    need = (old.storage_offset() + old.numel()) * old.element_size()
                    if old.untyped_storage().nbytes() >= need:
                        obj.data = old
                        if not torch.equal(old, values):
                            old.copy_(values)
                    else:  # its storage freed in place by a partitioning: the copy instead
                        obj.data = values
                elif value is _MISSING:
                    if hasattr(obj, name):
                        delattr(obj, name)
                else:
                    setattr(obj, name, value)
            for obj, saved in reversed(self._objects):
                d = vars(obj)
                for k in [k for k in d if k not in saved]:
                    del d[k]
                d.update(saved)
            for t, values in reversed(self._tensors):
                t.copy_(values.to(t.device))


_MISSING = object()
