"""DeepSpeed's ``engine.load_checkpoint`` through zeroflat (the drop-in's patch of it): a ZeRO-1/2
or ZeRO-3 checkpoint resumed with each rank reading only its own bytes, at the world size it was
saved at or another, no pickle executed.

- The folder is read by the library (``_C.DeepSpeedCheckpoint``: zip directories and pickles by
  a reader that refuses any global outside its list; never ``torch.load``).
- The fp32 master and each partitioned optimizer state are loads of the one pipeline
  (the library's load with the plan's placement: the slice for ZeRO-1/2, the partitions for
  ZeRO-3) from the saved runs that
  hold this rank's new partition, laid out by the running release's rules and checked against
  the optimizer's own bookkeeping.
- What was read becomes the state dict the running release's own ``optimizer.load_state_dict``
  takes; the 16-bit weights come from the fp32 master and one all-gather, or, without
  ``load_from_fp32_weights``, from the module file's 16-bit weights. Frozen parameters, buffers,
  the scheduler, the counters and the client state are restored as DeepSpeed restores them.
- A buffer is read straight into the optimizer's own tensor where that can be put back exactly
  (the fp32 master of an engine not yet stepped; a state all zero). Nothing else is written until
  every rank has read everything: an error on any rank is raised on every rank with the engine
  as it was, those tensors put back first.

What zeroflat does not serve on any rank (pipeline or model parallelism, MoE, NVMe offload, a
custom load function, elastic checkpoints, an optimizer other than DeepSpeed's ZeRO ones and
BF16_Optimizer, its bf16 ZeRO-1 with fp32 gradient accumulation) is
DeepSpeed's own ``load_checkpoint``, with one warning saying why; what some ranks cannot serve
and others can is refused on every rank."""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from . import _C, _dropin, _save
from ._comm import all_reduce_ints, failing_word, raise_failed
from ._common import TORCH_DTYPES, native_path, path_text
from ._dropin import log, stats
from ._errors import InvalidArgument
from ._progress import Phases, Watch
from ._resume_family import family_of, is_true, optimizer_kind
from ._resume_inplace import OwnBytes, lend, plan_digest
from ._resume_write import EngineWriter


# --- which calls zeroflat serves ----------------------------------------------------------------

def why_not(engine, load_dir, custom_load_fn) -> Optional[str]:
    """Why this call is DeepSpeed's own, or None when zeroflat serves it (this rank's view)."""
    if custom_load_fn is not None:
        return "a custom_load_fn is DeepSpeed's to call"
    if not is_true(engine, "zero_optimization"):
        return "the engine does not use ZeRO"
    if optimizer_kind(engine) is None:
        return (f"its optimizer is {type(getattr(engine, 'optimizer', None)).__name__} (zeroflat "
                "resumes DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3 and "
                "BF16_Optimizer)")
    if getattr(engine, "has_moe_layers", False):
        return "MoE layers keep expert files of their own"
    if type(engine.module).__name__ == "PipelineModule" or getattr(engine, "mp_world_size", 1) > 1:
        return "pipeline and model parallelism keep files per stage and model-parallel rank"
    if is_true(engine, "zero_nvme_offload_optimizer"):
        return "the optimizer is offloaded to NVMe"
    opt = engine.optimizer
    if getattr(opt, "elastic_checkpoint", False):
        return "elastic checkpoints (zero_optimization.elastic_checkpoint) are DeepSpeed's"
    if getattr(opt, "swap_optimizer", False) or getattr(opt, "offload_param_device", None) == "nvme":
        return "parameters or optimizer states are swapped to NVMe"
    config = getattr(engine, "_config", None)
    zero_config = getattr(config, "zero_config", None)
    if getattr(zero_config, "pipeline_loading_checkpoint", False):
        return "zero_optimization.pipeline_loading_checkpoint asks DeepSpeed's serial load"
    if not os.path.isdir(os.fspath(load_dir)):
        return f"{path_text(load_dir)} is not a folder"
    return None


# --- the ranks' agreement -----------------------------------------------------------------------

def _raise_failed(failing: int, error: Optional[BaseException], group, what: str) -> None:
    """After an agreement on errors (_comm.failing_word): every rank raises where one failed,
    the others the failing rank's words."""
    raise_failed(failing, error, group, what, lambda rank, said: InvalidArgument(
        f"resuming from a DeepSpeed checkpoint: {what} failed on rank {rank}: {said}; nothing "
        "of the engine was changed"))


# --- the checkpoint's small values --------------------------------------------------------------

def _segment(key: Any) -> str:
    """A dict key as a path segment (torch_file.h's torch_path_segment, for str and int keys)."""
    if isinstance(key, str):
        return key.replace("%", "%25").replace("/", "%2F")
    return str(key)


class _Files:
    """The checkpoint's files by role, and the small values of the ones this rank reads."""

    def __init__(self, ck, rank: int):
        self.ck = ck
        files = ck.files
        self.universal = ck.format == "universal"
        by_rank = {r: i for i, (_, role, r) in enumerate(files) if role == "model" and r >= 0}
        whole = [i for i, (_, role, r) in enumerate(files) if role == "model" and r < 0]
        # The module file this rank takes the engine's values from: ZeRO-3 saves one per rank
        # (the same values; a new rank beyond the saved ones takes the first).
        if by_rank:
            self.model = by_rank.get(rank, by_rank[min(by_rank)])
        elif whole:
            self.model = whole[0]
        else:
            raise InvalidArgument(f"{ck.dir}: no module file (mp_rank_00_model_states.pt)")
        optim = {r: i for i, (_, role, r) in enumerate(files) if role == "optim"}
        common = [i for i, (_, role, _) in enumerate(files) if role == "universal-common"]
        # The optimizer's values (loss scaler, param_groups, step): this rank's saved file, or the
        # first one's (every rank saves the same), or universal's optimizer_state.pt.
        if optim:
            self.optim = optim.get(rank, optim[min(optim)])
            self.optim_prefix = "optimizer_state_dict/"
        elif common:
            self.optim = common[0]
            self.optim_prefix = ""
        else:
            self.optim = None
            self.optim_prefix = ""

    def value(self, file: int, path: str) -> Any:
        # The binding makes every value: plain data, tensors, and what the reader's allow-list
        # lets a file name, made as its row says (python/src/bind_deepspeed.cc).
        return self.ck.value(file, path)

    def has(self, file: int, path: str) -> bool:
        return bool(self.ck.has(file, path))

    def module_keys(self) -> List[str]:
        return list(self.ck.keys(self.model, ""))

    def module_value(self, key: str) -> Any:
        return self.value(self.model, _segment(key))

    def optim_value(self, key: str, default: Any = None) -> Any:
        if self.optim is None:
            return default
        path = self.optim_prefix + key
        return self.value(self.optim, path) if self.has(self.optim, path) else default

    def base_state_path(self) -> Optional[str]:
        """The path of the torch optimizer's saved state_dict ({'state', 'param_groups'}) in the
        optimizer file, or None (universal, elastic)."""
        if self.optim is None:
            return None
        for key in ("base_optimizer_state", "optimizer_state_dict"):
            path = self.optim_prefix + key
            if self.has(self.optim, path + "/param_groups"):
                return path
        return None

    def universal_file(self, name: str, state: str) -> Optional[int]:
        want = os.path.join(self.ck.dir, "zero", name, f"{state}.pt")
        for i, (path, role, _) in enumerate(self.ck.files):
            if role == "universal" and os.path.normpath(path) == os.path.normpath(want):
                return i
        return None


# --- one rank's resume --------------------------------------------------------------------------

class _Resume(EngineWriter):
    """One rank's resume of one checkpoint: what it reads (``read``), then what it writes
    (``write``); nothing of the engine changes before ``write``."""

    def __init__(self, engine, ck, *, load_module_strict: bool, load_optimizer_states: bool,
                 load_lr_scheduler_states: bool, load_module_only: bool):
        self.engine = engine
        self.ck = ck
        self.group = engine.optimizer.dp_process_group
        self.dp = dist.get_world_size(self.group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        # Everything that differs between ZeRO-1/2, BF16_Optimizer and ZeRO-3.
        self.family = family_of(engine, self.rank, self.dp, self.group)
        self.opt = self.family.opt
        self.strict = bool(load_module_strict)
        self.module_only = bool(load_module_only)
        self.with_states = bool(load_optimizer_states) and not self.module_only
        self.with_scheduler = bool(load_lr_scheduler_states)
        self.load_optimizer_states = bool(load_optimizer_states)
        self.from_fp32 = is_true(engine, "zero_load_from_fp32_weights")
        self.names: Dict[Any, str] = dict(engine.param_names)
        self.files = _Files(ck, self.rank)
        self.small: Dict[str, Any] = {}
        self.values: Dict[str, List[torch.Tensor]] = {}
        self.frozen: Dict[str, torch.Tensor] = {}
        self.buffers: Dict[str, torch.Tensor] = {}
        self.bytes_read = 0
        self.bytes_in_place = 0  # read straight into the optimizer's own tensors
        self._lent: list = []  # how to put those back, until the engine takes what was read
        self._lent_tensors: list = []  # the optimizer's tensors read into (put_back restores)
        self._check()

    # - checks -----------------------------------------------------------------------------------

    def _persistent_buffers(self) -> Dict[str, torch.Tensor]:
        out = {}
        for mname, mod in self.engine.module.named_modules():
            skip = getattr(mod, "_non_persistent_buffers_set", set())
            for bname, buf in mod._buffers.items():
                if buf is not None and bname not in skip:
                    out[f"{mname}.{bname}" if mname else bname] = buf
        return out

    def _check(self) -> None:
        ck, engine = self.ck, self.engine
        if ck.format != "universal" and (ck.zero_stage == 3) != (self.family.stage == 3):
            raise InvalidArgument(
                f"{ck.dir}: a ZeRO-{ck.zero_stage} checkpoint, and the engine runs "
                f"ZeRO-{engine.zero_optimization_stage()}: resume with the stage it was saved "
                "with, or convert it to a universal checkpoint (ds_to_universal)")
        # The model's state_dict against the module file's, as DeepSpeed's strict load_state_dict
        # compares them; every trainable parameter must be in the optimizer's saved groups.
        f = self.files
        saved = set(ck.keys(f.model, "module")) if f.has(f.model, "module") else set()
        model = set(self.names.values()) | set(self._persistent_buffers())
        if self.strict:
            missing, extra = sorted(model - saved), sorted(saved - model)
            if missing or extra:
                words = []
                if missing:
                    words.append(f"the model's {', '.join(map(repr, missing[:5]))}"
                                 f"{' ...' if len(missing) > 5 else ''} not in it")
                if extra:
                    words.append(f"its {', '.join(map(repr, extra[:5]))}"
                                 f"{' ...' if len(extra) > 5 else ''} not in the model")
                raise InvalidArgument(f"{ck.dir}: the module file's state_dict does not match the "
                                      f"model's ({'; '.join(words)}); load_module_strict=False "
                                      "loads what both hold")
        trained = {name for group in ck.groups for name, *_ in group}
        for params in self._sub_groups():
            for p in params:
                name = self.names.get(p)
                if name is None:
                    raise InvalidArgument("a parameter of the optimizer is not one of the "
                                          "engine's module's")
                if trained and name not in trained:
                    raise InvalidArgument(f"{ck.dir}: the checkpoint's optimizer holds no "
                                          f"parameter {name!r}, which the engine trains")
                shape = self.family.shape(p)
                saved_shape = self._saved_shape(name)
                if saved_shape is not None and tuple(saved_shape) != shape:
                    raise InvalidArgument(f"{ck.dir}: parameter {name!r} is {list(saved_shape)} "
                                          f"in the checkpoint, {list(shape)} in the model")

    def _saved_shape(self, name: str):
        for group in self.ck.groups:
            for pname, shape, *_ in group:
                if pname == name:
                    return shape
        for pname, shape, _ in self.ck.frozen:
            if pname == name:
                return shape
        return None

    # - the optimizer's groups -------------------------------------------------------------------

    def _sub_groups(self) -> List[List[torch.nn.Parameter]]:
        """The optimizer's partitions' parameters: ZeRO-1/2's groups (group order), ZeRO-3's
        sub-groups."""
        return self.family.partitions()

    # - reading ----------------------------------------------------------------------------------

    def targets(self) -> List[str]:
        """What this rank reads per partition: "fp32" (the master), "module" (ZeRO-1/2's 16-bit
        weights), and each partitioned optimizer state."""
        weights = self.family.weights_target(self.with_states, self.from_fp32)
        if self.ck.format == "universal" and weights == "module":
            weights = "fp32"  # universal files hold no 16-bit weights; fp32 rounds to the same
        return [weights] + (list(self.ck.partitioned_states()) if self.with_states else [])

    def read_small(self) -> None:
        """The module file's bookkeeping and the optimizer's scalars and param_groups: local
        reads. The tensors read whole (frozen parameters under ZeRO-1/2, buffers) are the plan's
        small values (take_small)."""
        f = self.files
        keys = f.module_keys()
        self.module_keys = set(self.ck.keys(f.model, "module")) if "module" in keys else set()
        self.small = {key: f.module_value(key) for key in keys
                      if key not in ("module", "optimizer")
                      and self.family.keeps_small(key, self.ck.world)}
        if self.with_states:
            self.small["optimizer"] = self._optimizer_small()

    def _frozen_whole(self) -> List[Any]:
        """The parameters read whole (frozen, under ZeRO-1/2): not in an optimizer partition."""
        if not self.family.reads_frozen_whole():
            return []
        trained = {p for params in self._sub_groups() for p in params}
        return [p for p in self.names if p not in trained]

    def take_small(self, plan) -> None:
        """The plan's small values this rank takes (frozen parameters under ZeRO-1/2, buffers),
        then everything read so far checked against the engine."""
        buffers = self._persistent_buffers()
        frozen = {self.names[p] for p in self._frozen_whole()}
        for s in plan.small:
            if s.target != "module":
                continue  # an optimizer state read whole: among the optimizer's scalars
            if s.name in frozen:
                self.frozen[s.name] = self.ck.value(s.file, s.path)
                self.bytes_read += s.bytes
            elif s.name in buffers:
                self.buffers[s.name] = self.ck.value(s.file, s.path)
        missing = sorted(frozen - set(self.frozen))
        if missing and self.strict:
            raise InvalidArgument(f"{self.ck.dir}: no values of frozen parameter {missing[0]!r} "
                                  "in the module file; load_module_strict=False keeps the "
                                  "model's")
        self._check_small()

    def _optimizer_small(self) -> Dict[str, Any]:
        f = self.files
        out = {}
        for key in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "ds_version",
                    "zero_stage"):
            out[key] = f.optim_value(key)
        base = f.base_state_path()
        groups = None
        per_state = {}  # saved state index -> its values that are not partitioned
        if base is not None:
            groups = f.value(f.optim, base + "/param_groups")
            partitioned = set(self.ck.partitioned_states())
            for index in self.ck.keys(f.optim, base + "/state"):
                entries = {}
                for key in self.ck.keys(f.optim, f"{base}/state/{index}"):
                    if key not in partitioned:
                        entries[key] = f.value(f.optim, f"{base}/state/{index}/{key}")
                per_state[int(index)] = entries
        elif f.universal:
            groups = f.optim_value("param_groups")
        elif f.optim is not None:
            # An elastic checkpoint: base_optimizer_state is a list, one state per group (no
            # param_groups); its values that are not partitioned are restored as they are.
            partitioned = set(self.ck.partitioned_states())
            elastic = f.optim_prefix + "base_optimizer_state"
            index = 0
            while f.has(f.optim, f"{elastic}/{index}"):
                per_state[index] = {
                    key: f.value(f.optim, f"{elastic}/{index}/{key}")
                    for key in self.ck.keys(f.optim, f"{elastic}/{index}")
                    if key not in partitioned}
                index += 1
        out["param_groups"] = groups
        out["state_scalars"] = per_state
        # Elastic checkpoints keep one step for all groups; universal ones a step per parameter.
        out["step"] = f.optim_value("base_optimizer_state_step")
        if f.universal and out["step"] is None:
            first = self.names[self._sub_groups()[0][0]] if self._sub_groups() else None
            at = f.universal_file(first, "step") if first is not None else None
            if at is not None:
                # ds_to_universal saves the step as itself or under 'param' (as the tensors).
                path = "param" if f.has(at, "param") else ""
                out["step"] = f.value(at, path)
        return out

    def plan(self):
        """The library's plan of this resume (zeroflat/resume.h): this rank's buffers, their
        sources, layouts and placements, for the running engine's groups and layout choices."""
        subs = self._sub_groups()
        targets = self.targets()
        kw = dict(world=self.dp, stage=self.family.stage, states=targets[1:],
                  module_weights=targets[0] == "module",
                  groups=[[self.names[p] for p in params] for params in subs])
        kw.update(self.family.plan_options(self))
        frozen = self._frozen_whole()
        if frozen:
            kw["frozen"] = [self.names[p] for p in frozen]
            kw["frozen_numels"] = [p.numel() for p in frozen]
        kw["buffers"] = list(self._persistent_buffers())
        return _C.plan_resume(self.ck, **kw)

    def prepare(self) -> int:
        """This rank's plan (the library's) and what every rank must hold identically to read
        it: the checkpoint, the options, each buffer's layout choices and parameters, the headers
        of every file each buffer reads. Returns their digest (56 bits), which the ranks compare
        in load_checkpoint's one agreement, after the reads: equal digests mean the loads needed
        no agreement of their own. Local."""
        import hashlib

        self._plan = plan = self.plan()
        self.take_small(plan)
        subs = self._sub_groups()
        self._must_match = [f"resume {self.ck.dir} tag {self.ck.tag}", f"format {self.ck.format}",
                            f"saved world {self.ck.world} release {self.ck.ds_version}",
                            f"targets {plan.targets}", f"partitions {len(subs)}",
                            f"stage {self.family.stage}", f"world {self.dp}",
                            plan_digest(plan)]
        h = hashlib.sha256()
        for item in self._must_match:
            h.update(item.encode("utf-8", "replace") + b"\0")
        for params in subs + [getattr(self.family, "frozen", [])]:
            h.update(repr([self.names[p] for p in params]).encode("utf-8", "replace"))
        for b in plan.buffers:
            h.update(b.index.header_digest().to_bytes(8, "little"))
        return int.from_bytes(h.digest()[:7], "little")

    def read(self, threads: Optional[int], agreed: bool = True) -> Optional[BaseException]:
        """Every buffer this rank keeps, read on the host as the plan (prepare) says, one load
        per buffer, into the optimizer's own tensor where it can be put back (lend), else into
        a tensor of torch's; no load samples bytes (copies="off"). ``agreed`` (load_checkpoint
        compares the plans' digests after this): no collective, each load reads this rank's own
        bytes (OwnBytes); returns this rank's error, the lent tensors put back. Not ``agreed``
        (the digests differed): collective, every load runs the loader's agreement, which names
        the entry the ranks' copies differ in, and the resume is refused on every rank."""
        from ._load import engine_and_comm

        plan = self._plan
        # Buffers not read in place come from torch's allocator (unless ZEROFLAT_HOST_MEMORY
        # says otherwise), as DeepSpeed's own load's tensors do: the memory the process already
        # has (what building the engine freed), where fresh mappings would each be faulted in
        # page by page.
        engine, nthreads, comm, _ = engine_and_comm(
            torch.device("cpu"), threads, self.dp, self.group if self.dp > 1 else None,
            host_memory="torch")
        self.family.comm = comm
        if agreed:
            # Every byte of every buffer asked of the kernel now, in file order: the loads below
            # (one per buffer, each its own pass) find their bytes in flight or cached, so a
            # rank's optimizer file is read once, in order.
            self.read_ahead_bytes, expected = plan.read_ahead(self.rank)
        else:
            _, _, expected = plan.rank_bytes(self.rank)
        watch = Watch(f"resume from {self.ck.dir}", self.rank, self.dp, _dropin.progress,
                      expected)
        # A slice or partitions placement gathers nothing: each load reads this rank's own bytes.
        own = OwnBytes(comm.rank, comm.size) if comm is not None and agreed else comm
        try:
            with watch:
                self._read_buffers(plan, [] if agreed else self._must_match, engine, nthreads,
                                   own if self.dp > 1 else None, watch.counts)
            if not agreed and comm is not None:
                # Every load ran the loader's agreement and none found the difference: it is in
                # what only the digest covers (the engine's parameter names).
                raise InvalidArgument(
                    f"resuming from {self.ck.dir} tag {self.ck.tag}: the ranks' plans differ (a "
                    "digest of each rank's plan, its engine's parameter names and its copy's "
                    "headers); every rank must resume the same engine from an identical copy of "
                    "the checkpoint; nothing of the engine was changed")
        except Exception as e:  # noqa: BLE001 - the caller's agreement tells every rank
            self.put_back()
            if not agreed:
                raise
            return e
        except BaseException:
            self.put_back()
            raise
        return None

    # - reading into the optimizer's own tensors -------------------------------------------------

    def put_back(self) -> None:
        """The optimizer's tensors read into, as they were (the resume failed before the engine
        took what was read)."""
        lent, self._lent = self._lent, []
        self._lent_tensors = []
        with torch.no_grad():
            for put in lent:
                put()

    def _read_buffers(self, plan, must_match, engine, nthreads, comm, counts) -> None:
        """The plan's buffers, one load each (_load's one loop), then each buffer's partitions
        as the optimizer keeps them (the family's take)."""
        from ._load import Load, run_loads

        loads, lent = [], []
        for b in plan.buffers:
            what = b.target if b.group is None else f"{b.target} of group {b.group}"
            tensor, put = lend(self.family, b)
            if tensor is not None:
                self._lent.append(put)  # put back should anything fail from here on
            lent.append((tensor, put))

            def configure(options, b=b):
                options.layout = b.layout
                self.family.load_checks(b, options)
            loads.append(Load(_C.LoadPlacement(b.placement), b.params, configure=configure,
                              must_match=must_match + [f"target {b.target}", f"group {b.group}",
                                                       f"parameters {len(b.numels)}"],
                              into=tensor, source=b.index,
                              what=f"resuming {what} from {self.ck.dir}",
                              infeasible=f"resuming {what}: {{reason}}"))

        def take(k, report, buffer, lay):
            b, (tensor, put) = plan.buffers[k], lent[k]
            if tensor is None:
                pass
            elif buffer is not None and buffer.data_ptr() != tensor.data_ptr():
                # The load took a buffer of its own: the lent tensor is put back now.
                with torch.no_grad():
                    put()
                self._lent.remove(put)
            elif tensor is not None:
                self.bytes_in_place += tensor.numel() * tensor.element_size()
                self._lent_tensors.append(tensor)
            self.bytes_read += int(report.get("bytes_read") or 0)
            self.family.take(self, b, buffer, lay, TORCH_DTYPES[b.layout.dtype])

        if loads:
            run_loads(loads, engine=engine, comm=comm, ck=None, threads=nthreads,
                      target=torch.device("cpu"), counts=counts, copies="off", after=take)


def _tag(engine, load_dir) -> Optional[str]:
    """The tag DeepSpeed's load_checkpoint would take without one: the 'latest' file's (or
    'latest_universal' when the config loads universal checkpoints)."""
    universal = is_true(engine, "load_universal_checkpoint")
    name = "latest_universal" if universal else "latest"
    path = os.path.join(os.fsdecode(os.fspath(load_dir)), name)
    if os.path.isfile(path):
        with open(path, "rb") as fd:
            data = fd.read(4097)
        try:
            text = data.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise InvalidArgument(f"{path}: the tag it names is not UTF-8 text (byte "
                                  f"{e.start})") from None
        if len(data) > 4096 or not text or "\0" in text:
            raise InvalidArgument(f"{path}: expected the name of a tag folder, found "
                                  f"{'more than 4 KiB' if len(data) > 4096 else repr(text[:80])}")
        return text
    if universal:
        raise ValueError(f"Invalid for universal checkpoint: {path} does not exist")
    return None


def load_checkpoint(original, engine, load_dir, tag=None, load_module_strict=True,
                    load_optimizer_states=True, load_lr_scheduler_states=True,
                    load_module_only=False, custom_load_fn=None):
    """The drop-in's ``DeepSpeedEngine.load_checkpoint``: DeepSpeed's arguments and return
    value (``(load_path, client_state)``)."""
    args = dict(tag=tag, load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only, custom_load_fn=custom_load_fn)
    # A save still being written in the background first (its failure raised on every rank).
    _save.settle(agree=dist.is_initialized(), what=f"load_checkpoint({path_text(load_dir)})")
    reason = why_not(engine, load_dir, custom_load_fn)
    group = engine.optimizer.dp_process_group if optimizer_kind(engine) else None
    start, where = time.perf_counter(), path_text(load_dir)
    # This rank's part, before the call's one agreement: the tag, the checkpoint opened, its small
    # values, the plan and its digest, every buffer read (no collective; lent tensors only).
    plan, ck, error, digest = None, None, None, 0
    phases = Phases(start)  # where the call's time goes on this rank (stats["resumes"])
    if reason is None:
        try:
            if tag is None:
                tag = _tag(engine, load_dir)
            if tag is not None:
                ck = _C.DeepSpeedCheckpoint(native_path(load_dir), native_path(str(tag)))
                phases.end("open")
                plan = _Resume(engine, ck, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states,
                               load_module_only=load_module_only)
                plan.read_small()
                phases.end("small")
                digest = plan.prepare()
                phases.end("plan")
        except Exception as e:  # noqa: BLE001 - every rank must learn of it before anything is read
            error = e
    threads = getattr(engine, "_zeroflat_threads", None)
    if plan is not None and error is None:
        error = plan.read(threads)
        phases.end("read")
    # One all-reduce (max): the lowest rank that cannot serve, whether any can, whether any found
    # no tag, the lowest rank that failed, the highest and the lowest digest of the ranks' plans.
    no_tag = reason is None and error is None and tag is None
    unserved_error = None if reason is None else InvalidArgument(
        f"load_checkpoint({where}) cannot be served on this rank ({reason}) where "
        "other ranks can: every rank must load the same checkpoint the same way (DeepSpeed's "
        "load would leave the ranks different, or waiting); nothing of the engine was changed")
    try:
        unserved, any_served, any_no_tag, failing, high, low = all_reduce_ints(
            [failing_word(unserved_error, group), int(reason is None), int(no_tag),
             failing_word(error, group), digest, -digest],
            group, "max", "the ranks' agreement on serving load_checkpoint (an all-reduce)",
            "resume-serve")
        if plan is not None and (unserved or failing or any_no_tag or high != -low):
            plan.put_back()  # what was read into the optimizer's own tensors, undone
        # A refusal wins: what one rank refused never goes to DeepSpeed's own load on any rank.
        _raise_failed(failing, error, group, f"{where} tag {tag}")
        if unserved and any_served:  # the ranks see different things: none loads
            _raise_failed(unserved, unserved_error, group, where)
        if unserved:
            stats["resume_fallbacks"].append(reason)
            log.warning("zeroflat: load_checkpoint(%s) is DeepSpeed's own: %s", where, reason)
            return original(engine, load_dir, **args)
        if any_no_tag:
            log.warning("zeroflat: no 'latest' file in %s%s: pass the tag of the checkpoint to "
                        "load (DeepSpeed's own load_checkpoint returns (None, None) too)",
                        where, "" if no_tag else " as another rank sees it")
            return None, None
        assert plan is not None and ck is not None
        if high != -low:
            plan.read(threads, agreed=False)  # collective: names what differs, and raises
    except BaseException:
        if plan is not None:
            plan.put_back()
        raise
    phases.end("agree")
    plan.write()
    phases.end("write")
    seconds = time.perf_counter() - start
    stats["resumes"].append({"dir": os.fspath(load_dir), "tag": str(tag), "format": ck.format,
                             "saved_world": ck.world, "world": plan.dp,
                             "bytes_read": plan.bytes_read, "bytes_in_place": plan.bytes_in_place,
                             "seconds": seconds, "phases": phases.seconds,
                             "read_ahead_bytes": getattr(plan, "read_ahead_bytes", 0),
                             "record_seconds": getattr(plan, "record_seconds", 0.0)})
    load_path = engine._get_ckpt_name(os.fsdecode(os.fspath(load_dir)), tag)
    if not os.path.exists(load_path):
        load_path = ck.files[plan.files.model][0]
    return load_path, plan.client_state()
