"""A Hugging Face checkpoint straight into a model already sharded by PyTorch FSDP2
(``fully_shard``: parameters as DTensors): each rank reads only the bytes of its own local
shards, through the library's loader (``_load.run_loads``, the package's one load loop, with
the "shards" placement of the one pipeline; every layout and read of the load is the
library's). Python chooses where HSDP's replicas cut a shard between them
(``_split_replicas``, each part's shape the library's ``local_shard``) and has the library
compare the ranks' copies of what the load does not read itself (the shards used in place and
buffers read whole: ``_fsdp_copies`` hands them to ``check_taken_copies``).

    model = build_on_meta(); fully_shard(...); model.to_empty(device="cpu")
    zeroflat.fsdp.load(model, "/path/to/checkpoint")

What is read where: a parameter that is a DTensor on a mesh of the whole process group gets its
local shard (``Shard(d)`` rows, FSDP2's uneven last shard, ``Replicate()`` dimensions of an
HSDP mesh), converted to the local tensor's dtype as torch rounds; a plain parameter is read
whole (every rank), as a buffer is. Where HSDP's replica groups span nodes, the replicas of a
shard read a part of it each and complete one another with one all-gather (``replicas``).
Names are matched as Transformers renames them (the same rules as
``zeroflat.load_param_groups``; tied weights, fused MoE experts).

Nothing is changed until every rank has read everything: the reads land in a buffer of the
loader's own and are copied into the local shards only after every rank's load succeeded, so
that an error (a missing tensor, another shape, a rank whose read fails, ranks whose meshes
differ) is raised on every rank with every model as it was."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _C, _fsdp_copies, _fsdp_model as _model, _hf_names
from ._common import DTYPES, bool_option, path_text
from ._load import (Load, checkpoint_of, check_load_options, dtype_text, engine_and_comm,
                    read_whole, run_loads, sources_of, stored_name)
from ._progress import Watch, check_callback

log = logging.getLogger("zeroflat")

__all__ = ["load"]


_dtensor_class = _model.dtensor_class
_is_dtensor = _model.is_dtensor


class _Mesh:
    """The one mesh every DTensor of the model lives on: its shape and each rank's coordinate,
    the ranks in the order of ``process_group``."""

    def __init__(self, mesh, process_group):
        self.mesh = mesh
        self.shape = [int(n) for n in mesh.mesh.shape]
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        world = dist.get_world_size(process_group) if process_group is not None else 1
        group_ranks = (dist.get_process_group_ranks(process_group) if process_group is not None
                       else [0])
        if sorted(ranks) != sorted(group_ranks):
            raise ValueError(f"the model's mesh holds ranks {ranks[:8]}..., the process group "
                             f"{group_ranks[:8]}...: zeroflat.fsdp.load needs a mesh of exactly "
                             "the group's ranks (pass process_group=)")
        where = {r: k for k, r in enumerate(ranks)}
        self.coords = []
        for g in group_ranks:
            k, c = where[g], []
            for n in reversed(self.shape):
                c.append(k % n)
                k //= n
            self.coords.append(list(reversed(c)))
        assert len(self.coords) == world

    def same(self, other) -> bool:
        if other is self.mesh:  # FSDP2's DTensors share one mesh (DeviceMesh.mesh is not cheap)
            return True
        return (other.device_type == self.mesh.device_type
                and [int(n) for n in other.mesh.shape] == self.shape
                and other.mesh.flatten().tolist() == self.mesh.mesh.flatten().tolist())


def _placements(p, mesh: Optional[_Mesh], name: str) -> List[str]:
    """The parameter's placements as the library reads them (torch's own words)."""
    DTensor = _dtensor_class()
    if DTensor is not None and isinstance(p, DTensor):
        if mesh is None or not mesh.same(p.device_mesh):
            raise ValueError(f"parameter {name!r} lives on another mesh than the model's first "
                             "DTensor: zeroflat.fsdp.load reads into one mesh")
        return [_placement_text(pl) for pl in p.placements]
    return ["Replicate()"] * (len(mesh.shape) if mesh is not None else 1)


def _placement_text(pl) -> str:
    """A placement in the library's words: exactly torch's Shard (not a subclass such as
    _StridedShard) and Replicate; anything else by its repr, which the library refuses."""
    from torch.distributed.tensor import Replicate, Shard

    if type(pl) is Shard:
        return f"Shard({int(pl.dim)})"
    if type(pl) is Replicate:
        return "Replicate()"
    return repr(pl)


def _local(p) -> torch.Tensor:
    DTensor = _dtensor_class()
    return p.to_local() if DTensor is not None and isinstance(p, DTensor) else p


def _group(process_group) -> Any:
    """The group the ranks load over: the caller's, else the default group (one process
    without torch.distributed)."""
    if process_group != "default":
        return process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def load(model: torch.nn.Module, checkpoint: Union[str, os.PathLike, "_C.Checkpoint"], *,
         process_group: Any = "default", threads: Optional[int] = None, cold: bool = False,
         copies: str = "sampled", strict: bool = True, keep_tensors: bool = False,
         replicas: str = "auto", storage: str = "read", overwrite: bool = False,
         progress: Optional[Callable[[Any], None]] = None) -> Dict[str, Any]:
    """Fills every parameter and persistent buffer of ``model`` (sharded by FSDP2's
    ``fully_shard``: on the meta device as built, or materialized) from the checkpoint
    ``checkpoint`` (a ``.safetensors`` or ``pytorch_model.bin`` file, a folder whose model is
    chosen as Transformers chooses it, or a ``_C.Checkpoint``; ``load_param_groups`` takes the
    same). Each rank reads the bytes of its own local shards only: a DTensor's local tensor
    (``to_local()``) receives its elements of the checkpoint's tensor (``Shard(d)`` as
    torch.chunk cuts it along each mesh dimension, ``Replicate()`` whole), converted to the local
    tensor's dtype. Parameters that are not DTensors, and buffers, are read whole.

    Every parameter object stays the model's: an optimizer built before the load (the Trainer's,
    accelerate's ``prepare(model, optimizer)``) stays attached to the parameters it holds. A
    materialized DTensor keeps its local tensor, whose storage becomes the loaded shard (no
    second pass over the memory; FSDP2 takes it as its sharded data through the hook it keeps
    for loads, re-padding only an uneven shard); ``keep_tensors=True`` copies the values into the
    storage the local tensors had instead (one more pass; for whoever holds that storage). A
    model on the meta device (built there, ``fully_shard`` applied, not materialized: no rank
    ever holds the whole model) gets its shards in place of the meta ones, each parameter the
    same object (``torch.utils.swap_tensors``), on the mesh's device (the host under FSDP2's
    CPU offload); its non-persistent buffers on meta (rotary ``inv_freq``, which no checkpoint
    holds) are computed as the model's own initialisation computes them (Transformers 5's
    ``initialize_weights``, as its own load on meta does), and a model that cannot compute them
    is refused before anything is read (build it with ``zeroflat.meta_parameters()``: parameters
    on meta, buffers computed). Do not ``to_empty`` a model before the load: its non-persistent
    buffers would hold whatever memory held.

    ``overwrite``: an optimizer that holds the model's parameters and already has state for
    them (steps taken, or a checkpoint resumed into it: the Trainer resumes before its
    callbacks' ``on_train_begin``) makes the load refuse, on every rank, nothing read or changed
    (loading then would leave the optimizer's state for other weights, and overwrite what the
    resume loaded); ``True`` loads all the same.

    ``process_group``: the ranks that load together (``"default"``: the default group when
    torch.distributed runs with more than one rank, else one process); the model's mesh must
    hold exactly its ranks. Collective: every rank's own error (a tensor the checkpoint lacks or
    holds in another shape, a placement zeroflat does not read such as ``_StridedShard``, a
    mesh the ranks disagree on) is raised on every rank at the first collective, and nothing of
    any model is changed unless every rank read everything. ``strict``: a buffer the checkpoint
    does not hold is an error (else left as it is). ``threads``, ``cold``, ``copies`` and
    ``progress``: as ``zeroflat.load_param_groups`` takes them.

    ``replicas``: where the mesh has a dimension along which every DTensor is ``Replicate()``
    (HSDP's replica groups), ``"split"`` has the replicas of each shard read a part of it each
    (the shard cut once more along the dimension it is sharded on, torch.chunk's way, among the
    replica group) and complete one another with one all-gather over that mesh dimension's
    group: each byte is read once per replica group, not once per replica (across nodes, each
    node reads its share and the network completes the rest). ``"read"``: every rank reads its
    whole shard (replicas on one node share the page cache: the storage is read once per node
    anyway). ``"auto"`` (the default): ``"split"`` where a replica group spans nodes (by the
    launcher's ranks per node, ``LOCAL_WORLD_SIZE`` or ``ZEROFLAT_LOCAL_RANKS``, nodes holding
    consecutive ranks as torchrun numbers them), else ``"read"``.

    ``storage``: ``"read"`` (the default) reads every shard into memory of its own. ``"map"``
    uses in place the shards that lie in the files as they are (host shards of the file's dtype,
    each one run of a tensor's bytes: ``Shard(0)`` and ``Replicate()``, as FSDP2 makes them):
    the shard becomes a private, copy-on-write mapping of its bytes, brought in during the load
    (the page cache's pages mapped where they are cached, read where not), with no copy into
    fresh memory, as Transformers' own load maps its files; the rest is read. The memory then
    stays tied to the file: a checkpoint rewritten in place while the model lives (not replaced
    by a rename) changes or cuts the values under it (docs/python.md). Not with
    ``keep_tensors``, shards on a GPU or replicas that split their reads (those read).

    Returns a report: ``bytes_read`` (this rank's file bytes), ``share`` (the file bytes it must
    read: its shards', or its part of them when the replicas split), ``seconds`` (of which
    ``read_seconds`` until every rank read everything, ``assign_seconds`` after: the replicas'
    all-gather, then the shards handed to the model), ``replicas_split``, ``bytes_mapped`` (of
    ``bytes_read``, the bytes of the shards used in place), ``copy_check_read_bytes`` (the file
    bytes the copies check read again, other ranks' windows as this rank's copy holds them: all
    this rank read is ``bytes_read`` + ``copy_check_read_bytes``), ``rank``, ``world``, and each
    load's report under ``loads``, ``materialized`` (whether the model was on the meta
    device)."""
    t0 = time.perf_counter()
    local_error: Optional[BaseException] = None
    prep = None
    group = _group(process_group)
    try:
        check_load_options(cold=cold, round_robin=False, strict=strict, master_dtype=None,
                           threads=threads, margin_bytes=None, alignment_factor=2,
                           param_align_bytes=0, dtype=None, deepspeed=None, read_plan=None,
                           copies=copies, storage_bytes_per_second=0)
        check_callback(progress)
        bool_option("keep_tensors", keep_tensors)
        bool_option("overwrite", overwrite)
        if replicas not in ("auto", "split", "read"):
            raise ValueError(f"replicas={replicas!r}: expected 'auto', 'split' or 'read'")
        if storage not in ("read", "map"):
            raise ValueError(f"storage={storage!r}: expected 'read' or 'map'")
        prep = _prepare(model, checkpoint, group, strict, keep_tensors, overwrite)
        if replicas != "read":
            _split_replicas(prep, _rank(group), only_across_nodes=replicas == "auto")
        if storage == "map" and not keep_tensors:
            _choose_in_place(prep, _rank(group))
    except Exception as e:  # noqa: BLE001 - whatever it is, every rank must learn of it
        local_error = e
    world = dist.get_world_size(group) if group is not None else 1
    if local_error is not None and world == 1:
        raise local_error
    # On the shards' device; host buffers from torch's allocator: they become the parameters'
    # storage (fresh memory from it faults in fastest here: docs/performance.md, "FSDP2").
    target = prep.device if prep is not None else torch.device("cpu")
    engine, nthreads, comm, rank = engine_and_comm(target, threads if prep else 1, world, group,
                                                   host_memory="torch")
    path = prep.ck.path if prep is not None else path_text(checkpoint)
    mesh_shape = prep.mesh_shape if prep is not None else [world]
    coords = prep.coords if prep is not None else [[r] for r in range(world)]

    # One load per dtype of the local shards (the one loop, run_loads). Split among replicas,
    # each load's all-gather over the replica group runs (gloo's or NCCL's own thread) while the
    # next dtype's load reads.
    batches = _batches(prep) if prep is not None else []
    calls = max(1, len(batches))
    loads = []
    for k, (dtype, members) in enumerate(batches):
        def configure(options, dtype=dtype):
            options.layout = _C.LayoutOptions(dp=world, dtype=DTYPES[dtype])
        loads.append(Load(
            _C.LoadPlacement("shards", mesh=mesh_shape, coords=coords,
                             placements=[m.placements for m in members]),
            [m.param for m in members], configure=configure,
            must_match=[f"fsdp load {k} of {calls}", f"dtype {dtype_text(dtype)}"],
            what=f"loading {path} into FSDP2 shards",
            infeasible="the shards do not fit: {reason}; nothing was read"))
    if not loads:  # none, and at least one: it carries this rank's error
        loads.append(Load(_C.LoadPlacement("shards", mesh=mesh_shape, coords=coords,
                                           placements=[]), [],
                          must_match=["fsdp load 0 of 1", "dtype bf16"],
                          what=f"loading {path} into FSDP2 shards"))
    gatherings: Dict[int, Any] = {}

    def gather(k, report, buffer, lay):
        if buffer is not None and k < len(batches):
            gatherings[k] = _gather_replicas(prep, buffer[: lay["flat_bytes"]], batches[k][0])

    watch = Watch(f"load {path}", rank, world, progress if prep is not None else None)
    mapped_bytes = 0
    with watch:
        if prep is not None and local_error is None:
            try:
                mapped_bytes = _map_in_place(prep, nthreads, watch.counts, world, cold)
            except Exception as e:  # noqa: BLE001 - every rank must learn of it
                local_error = e
        loaded = run_loads(loads, engine=engine, comm=comm if world > 1 else None,
                           ck=prep.ck if prep is not None else None, threads=nthreads,
                           target=target, counts=watch.counts, cold=cold, copies=copies,
                           local_error=local_error,
                           entries=prep.entries if prep is not None else (), after=gather)
    results = [(batches[k][1], report, buffer, lay, batches[k][0], gatherings.get(k))
               for k, (report, buffer, _, lay) in enumerate(loaded)
               if k < len(batches) and report is not None]
    assert local_error is None and prep is not None
    # What the loads did not compare between the ranks' copies: shards in place, buffers.
    checked_bytes = _fsdp_copies.check(prep, comm, world, copies)
    # Every rank read everything: the model takes it.
    t_read = time.perf_counter()
    with torch.no_grad():
        for members, report, buffer, lay, dtype, gathering in results:
            if buffer is None:
                continue
            flat = buffer[: lay["flat_bytes"]].view(dtype)
            blocks = None
            if gathering is not None:
                blocks, work = gathering
                work.wait()
            for m, off in zip(members, lay["offsets"]):
                view = (_assemble(prep, m, off, blocks) if blocks is not None else
                        flat[off: off + m.local.numel()].view(m.local.shape))
                if (keep_tensors or not _is_dtensor(m.param_obj)) and not m.local.is_meta:
                    m.local.copy_(view)  # a plain parameter is read whole: copied, as before
                else:
                    _model.hand_over(m, view)
        for m in (m for ms in prep.by_dtype.values() for m in ms if m.mapped is not None):
            _model.hand_over(m, m.mapped)
        for name, local, value in prep.whole:
            if local.is_meta:
                _model.set_buffer(model, name, value.to(prep.device))
            else:
                local.copy_(value)
        # FSDP2 takes each DTensor's new storage as its sharded data (its load hook, which
        # re-pads an uneven shard and pins an offloaded one): the state dict is empty, nothing
        # else is loaded.
        if any(_is_dtensor(m.param_obj) for ms in prep.by_dtype.values() for m in ms):
            model.load_state_dict({}, strict=False)
        _model.compute_unheld(model, prep)
    bytes_read = sum(int(r[1].get("bytes_read") or 0) for r in results) + mapped_bytes
    checked_bytes += sum(int(r[1].get("copy_check_read_bytes") or 0) for r in results)
    done = time.perf_counter()
    return {"rank": rank, "world": world, "bytes_read": bytes_read, "share": prep.share(rank),
            "seconds": done - t0, "read_seconds": t_read - t0, "assign_seconds": done - t_read,
            "replicas_split": prep.replica is not None, "bytes_mapped": mapped_bytes,
            "copy_check_read_bytes": checked_bytes,
            "materialized": prep.meta, "loads": [r[1] for r in results]}


class _Member:
    """A parameter of the load: its names (tied weights have several), the library's LoadParam,
    the parameter and its local tensor, the placements the library reads it by; split among
    replicas, the shape of each replica's part (by replica coordinate) and the dimension it is
    cut along."""

    __slots__ = ("aliases", "param", "param_obj", "local", "placements", "parts", "cut", "range",
                 "mapped")

    def __init__(self, aliases, param, param_obj, local, placements):
        self.aliases, self.param, self.param_obj = aliases, param, param_obj
        self.local, self.placements = local, placements
        self.parts: Optional[List[List[int]]] = None
        self.cut = 0
        self.range: Optional[Tuple[int, int, int]] = None  # (file, offset, bytes) used in place
        self.mapped: Optional[torch.Tensor] = None  # the shard over its mapping


def _split_replicas(prep: "_Prepared", rank: int, only_across_nodes: bool) -> None:
    """HSDP's replicas share the reading of each shard: the mesh dimension along which every
    DTensor is Replicate() (one such dimension) moves last and becomes one more cut of the
    dimension each parameter is sharded on (its last Shard(d); dim 0 for a parameter
    replicated everywhere; a 0-d parameter stays whole). The library reads each rank's part
    (its layouts, from the placements given); _gather_replicas and _assemble rebuild the
    shards."""
    members = [m for ms in prep.by_dtype.values() for m in ms if _is_dtensor(m.param_obj)]
    dims = [d for d in range(len(prep.mesh_shape)) if prep.mesh_shape[d] > 1 and members
            and all(m.placements[d] == "Replicate()" for m in members)]
    if len(dims) != 1:
        return  # no replica dimension (a 1-D mesh), or several: each rank reads its shard
    r = dims[0]
    group = prep.mesh.mesh.get_group(r)
    if only_across_nodes:
        per_node = _C.local_ranks()
        if not per_node or len({g // per_node for g in dist.get_process_group_ranks(group)}) < 2:
            return  # one node (or not known): its page cache serves each replica's reads
    order = [d for d in range(len(prep.mesh_shape)) if d != r] + [r]
    shape = [prep.mesh_shape[d] for d in order]
    coords = [[c[d] for d in order] for c in prep.coords]
    for m in members:
        shards = [pl for pl in m.placements if pl.startswith("Shard(")]
        if not m.param.shape:  # a 0-d parameter: every replica reads it (a few bytes)
            m.placements = [m.placements[d] for d in order]
            continue
        cut = shards[-1] if shards else "Shard(0)"
        m.cut = int(cut[len("Shard("):-1])
        m.placements = [m.placements[d] for d in order[:-1]] + [cut]
        m.parts = []
        for j in range(prep.mesh_shape[r]):
            where = list(coords[rank][:-1]) + [j]
            m.parts.append(list(_C.local_shard(list(m.param.shape), shape, m.placements,
                                               where)["shape"]))
    split = {id(m) for m in members}
    for m in (m for ms in prep.by_dtype.values() for m in ms if id(m) not in split):
        m.placements = [m.placements[d] for d in order]
    prep.mesh_shape, prep.coords = shape, coords
    prep.replica = group
    prep.entries.append(f"replicas split along mesh dimension {r}")


def _batches(prep: "_Prepared") -> List[Tuple[torch.dtype, List["_Member"]]]:
    """The loads: one per dtype of the local shards. (Cutting them in parts so that the
    replicas' all-gather of one overlaps the reading of the next was slower on the nodes
    harness: each part's agreement rounds waited behind the bulk transfer on the link.)"""
    return [(dtype, [m for m in prep.by_dtype[dtype] if m.range is None])
            for dtype in sorted(prep.by_dtype, key=str)]


def _choose_in_place(prep: "_Prepared", rank: int) -> None:
    """storage="map": the DTensor shards on the host that the library finds in the files as they
    are (shard_file_ranges: the same parameters on every rank) are used in place, not read."""
    if prep.device is None or prep.device.type != "cpu" or prep.replica is not None:
        return  # a GPU's shards are copied there; split replicas gather what they read
    for dtype, members in prep.by_dtype.items():
        members = [m for m in members if _is_dtensor(m.param_obj)]
        if not members:
            continue
        for m, r in zip(members, _fsdp_copies.file_ranges(prep, members, dtype, rank)):
            m.range = r


def _map_in_place(prep: "_Prepared", threads: int, counts, world: int, cold: bool) -> int:
    """The chosen shards mapped and brought in (their pages mapped from the page cache, or read);
    returns their bytes."""
    members = [m for ms in prep.by_dtype.values() for m in ms if m.range is not None]
    if not members:
        return 0
    tensors = _C.map_file_ranges(prep.ck, [m.range for m in members], threads=threads,
                                 progress=counts, sole_reader=world == 1, cold=bool(cold))
    for m, t in zip(members, tensors):
        m.mapped = t.view(m.local.dtype).view(m.local.shape)
    return sum(m.range[2] for m in members)


def _gather_replicas(prep: "_Prepared", flat: torch.Tensor, dtype):
    """Each replica's loaded part (in replica-coordinate order), gathered over the replica
    group without waiting: (blocks, work), or None when the replicas did not split the reads."""
    if prep.replica is None:
        return None
    n = dist.get_world_size(prep.replica)
    src = flat.contiguous()
    blocks = [torch.empty_like(src) for _ in range(n)]
    work = dist.all_gather(blocks, src, group=prep.replica, async_op=True)
    return [b.view(dtype) for b in blocks], work


def _assemble(prep: "_Prepared", m: "_Member", off: int, blocks: List[torch.Tensor]):
    """A parameter's shard from its replicas' parts (cut along m.cut, in coordinate order)."""
    if m.parts is None:  # read whole by every replica
        return blocks[0][off: off + m.local.numel()].view(m.local.shape)
    pieces = [block[off: off + math.prod(shape)].view(shape)
              for block, shape in zip(blocks, m.parts)]
    out = torch.cat(pieces, dim=m.cut)
    assert list(out.shape) == list(m.local.shape), (m.aliases[0], out.shape, m.local.shape)
    return out


class _Prepared:
    def __init__(self, ck):
        self.ck = ck
        self.by_dtype: Dict[torch.dtype, List[_Member]] = {}
        self.whole: List[Tuple[str, torch.Tensor, torch.Tensor]] = []  # buffers read whole
        self.entries: List[str] = []
        self.device: Optional[torch.device] = None  # where the local shards live
        self.mesh_shape: List[int] = [1]
        self.coords: List[List[int]] = [[0]]
        self.mesh: Optional[_Mesh] = None
        self.replica = None  # the replica group's process group, when replicas split reads
        self.meta = False  # the model's parameters were on the meta device
        self.unheld: List[Tuple[str, torch.Tensor]] = []  # its non-persistent buffers on meta

    def share(self, rank: int) -> int:
        """The file bytes of this rank's shards (the library's count)."""
        layout = _C.LayoutOptions(dp=len(self.coords))
        return sum(_C.load_read_bytes(self.ck, [m.param for m in ms], _C.LoadPlacement(
                       "shards", mesh=self.mesh_shape, coords=self.coords,
                       placements=[m.placements for m in ms]), layout, rank)
                   for ms in self.by_dtype.values())


def _prepare(model: torch.nn.Module, checkpoint, group, strict: bool, keep_tensors: bool,
             overwrite: bool) -> _Prepared:
    """Every check of this rank and every whole read, before the ranks meet."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model is a {type(model).__name__}: expected a torch.nn.Module")
    _model.reshard(model)
    ck = checkpoint_of(checkpoint)
    out = _Prepared(ck)
    DTensor = _dtensor_class()
    # Transformers' renaming rules only add names to look for: asked for (a few hundred regular
    # expressions compiled, 0.1-0.3 s) only when a tensor is not under the model's own name.
    built: List[list] = []

    def rules() -> list:
        if not built:
            built.append(_hf_names.converters(model))
        return built[0]
    aliases: Dict[int, List[str]] = {}
    by_id: Dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        by_id[id(p)] = p
    lookup = _model.finder(model, ck, rules)
    first = next((p for p in by_id.values() if DTensor is not None and isinstance(p, DTensor)),
                 None)
    if first is None:
        raise ValueError("the model has no DTensor parameter: shard it with FSDP2's fully_shard "
                         "first (or load a plain model with zeroflat.load_param_groups)")
    mesh = _Mesh(first.device_mesh, group)
    out.mesh, out.mesh_shape, out.coords = mesh, mesh.shape, mesh.coords
    out.entries.append(f"mesh {mesh.shape} {mesh.mesh.device_type}")
    if not overwrite:
        busy = _model.optimizers_with_state(by_id)
        if busy:
            raise ValueError(
                f"an optimizer holds the model's parameters and already has state for them: "
                f"{'; '.join(busy)} (steps taken, or a checkpoint resumed into it: the Trainer "
                "resumes before its callbacks' on_train_begin); loading now would overwrite "
                "those weights and leave the optimizer's state for other ones. Load before the "
                "optimizer has state (zeroflat.hf.from_pretrained(..., fsdp2=True) loads when "
                "the model is sharded, before any resume), or pass overwrite=True to load all "
                "the same")
    metas = [p for p in by_id.values() if p.is_meta or _local(p).is_meta]
    # FSDP2's record of its parameters: where a meta parameter's shard goes.
    fsdp_params = _model.fsdp_params(model) if metas else {}
    if metas:
        if len(metas) != len(by_id):
            raise ValueError(f"{len(metas)} of the model's {len(by_id)} parameters are on the "
                             "meta device: zeroflat.fsdp.load fills a model built on meta (all "
                             "of it) or a materialized one")
        if keep_tensors:
            raise ValueError("keep_tensors=True copies into the parameters' local tensors; the "
                             "model is on the meta device, which has none: leave keep_tensors "
                             "out (every parameter object stays the model's either way)")
        import weakref

        held = [aliases[id(p)][0] for p in metas if weakref.getweakrefcount(p)]
        if held:
            raise ValueError(f"parameter {held[0]!r} (and {len(held) - 1} more) is referenced "
                             "weakly: its meta tensor cannot be exchanged for its shard in place")
        out.meta = True
        out.unheld = _model.meta_unheld(model)
        if out.unheld and not _hf_names.computes_unheld(model):
            raise ValueError(
                f"the model's non-persistent buffer {out.unheld[0][0]!r} (and "
                f"{len(out.unheld) - 1} more) is on the meta device: no checkpoint holds it and "
                "zeroflat cannot compute it for this model; build the model with "
                "zeroflat.meta_parameters() (parameters on meta, buffers computed) instead of "
                "torch.device('meta')")
    missing = []
    for pid, p in by_id.items():
        name = aliases[pid][0]
        local = _local(p)
        device = (_model.target_device(p, mesh if _is_dtensor(p) else None,
                                       fsdp_params.get(pid)) if out.meta else local.device)
        if out.device is None:
            out.device = device
        elif device != out.device:
            raise ValueError(f"parameter {name!r} lives on {device}, others on "
                             f"{out.device}: zeroflat.fsdp.load reads into one device")
        if local.dtype not in DTYPES:
            raise TypeError(f"parameter {name!r} is {local.dtype}: zeroflat loads bfloat16, "
                            "float16 and float32 parameters")
        src = (sources_of(aliases[pid], list(p.shape), [], ck)
               or sources_of(aliases[pid], list(p.shape), rules(), ck))
        if src is None:
            missing.append(name)
            continue
        placements = _placements(p, mesh, name)
        shard = _C.local_shard(list(p.shape), mesh.shape, placements, mesh.coords[_rank(group)])
        if list(shard["shape"]) != list(local.shape) or not (local.is_meta or
                                                             local.is_contiguous()):
            raise ValueError(f"parameter {name!r}: its local shard is {list(local.shape)}, but "
                             f"{placements} on mesh {mesh.shape} give {shard['shape']} at this "
                             "rank's coordinate (a placement zeroflat does not read?)")
        if len(aliases[pid]) > 1 and len(src[0]) == 1:
            _check_twins(ck, aliases[pid], src[0][0], lookup, shard, local.dtype)
        param = _C.LoadParam(name=name, shape=list(p.shape), sources=src[0],
                             source_shapes=src[1])
        out.by_dtype.setdefault(local.dtype, []).append(
            _Member(aliases[pid], param, p, local, placements))
        out.entries.append(f"parameter {name} {list(p.shape)} {dtype_text(local.dtype)} "
                           f"{' '.join(placements)} <- {','.join(src[0])}")
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ValueError(f"{ck.path} holds no tensor for {len(missing)} parameter(s) of the "
                         f"model: {shown}")
    for name, b in _persistent_buffers(model):
        stored = stored_name(name, [], ck) or stored_name(name, rules(), ck)
        if stored is None:
            if strict or b.is_meta:
                raise ValueError(f"{ck.path} holds no tensor for the model's buffer {name!r}" + (
                    " (on the meta device)" if b.is_meta else "; strict=False leaves it as is"))
            continue
        local = _local(b)
        value = read_whole(ck, name, [stored], [list(b.shape)], list(b.shape),
                            local.dtype if local.dtype in DTYPES else None, raw_dtype=local.dtype)
        out.whole.append((name, local, value))
        out.entries.append(f"buffer {name} {list(b.shape)} {local.dtype}")
    return out


def _persistent_buffers(model: torch.nn.Module):
    """(name, buffer) of every buffer a state dict holds (a non-persistent one, such as rotary
    inv_freq, is the model's own to make)."""
    for module_name, module in model.named_modules():
        for attr, b in module._buffers.items():
            if b is not None and attr not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{attr}" if module_name else attr), b


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def _check_twins(ck: "_C.Checkpoint", names: List[str], source: str,
                 lookup: Callable[[str], Optional[str]], shard: dict, dtype: torch.dtype) -> None:
    """A tied parameter (one parameter, several names) of which the checkpoint holds other
    names too (``lookup``, _fsdp_model.finder's): this rank's rows of each must equal those of
    the tensor it reads (``source``), else ValueError naming both, which the load's agreement
    raises on every rank, nothing changed (a tied parameter holds one value)."""
    others = []
    for n in names:
        stored = lookup(n)
        if stored is not None and stored != source and stored not in others:
            others.append(stored)
    if not others:
        return
    size, offsets = [int(x) for x in shard["shape"]], [int(x) for x in shard["offsets"]]
    mine = torch.empty(size, dtype=dtype)
    ck.read_boxes([(source, offsets, size, mine)], 1, False)
    for other in others:
        if list(ck.find(other).shape) != list(ck.find(source).shape):
            raise ValueError(f"the model ties {names} (one parameter), but {ck.path} holds "
                             f"{source!r} and {other!r} of different shapes")
        theirs = torch.empty(size, dtype=dtype)
        ck.read_boxes([(other, offsets, size, theirs)], 1, False)
        if not torch.equal(mine, theirs):
            raise ValueError(
                f"the model ties {names} (one parameter), but {ck.path} holds {source!r} and "
                f"{other!r} with different values: a tied parameter takes one; untie them in "
                "the model before sharding it (tie_word_embeddings=False), or load with "
                "zeroflat.hf.from_pretrained, which leaves such weights untied as Transformers "
                "does")
