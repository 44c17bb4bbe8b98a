"""DeepSpeed's ``engine.load_checkpoint`` through zeroflat (the drop-in's patch of it): a ZeRO-1/2
or ZeRO-3 checkpoint resumed with each rank reading only its own bytes, at the world size it was
saved at or another, no pickle executed.

- The checkpoint folder is read by the library (``_C.DeepSpeedCheckpoint``: its files' zip
  directories and pickles, with a reader that refuses any global outside its list; never
  ``torch.load``).
- The fp32 master weights and each partitioned optimizer state are loads of the one pipeline
  (``_C.load_slice`` for ZeRO-1/2, ``_C.load_partitions`` for ZeRO-3) from the saved runs that hold
  this rank's new partition (``DeepSpeedCheckpoint.source``): every rank reads its share, laid
  out by the running release's rules and checked against the optimizer's own bookkeeping.
- What was read becomes the state dict the running release's own loader takes for this rank
  (``optimizer.load_state_dict``), so the optimizer's restore is DeepSpeed's own code; the
  16-bit weights come from the fp32 master and one all-gather (``update_lp_params``), or, without
  ``load_from_fp32_weights``, from each rank's slice of the module file's 16-bit weights.
  Frozen parameters and buffers come from their own bytes in the module files; the scheduler,
  the step counters and the client state as DeepSpeed restores them.
- Nothing of the engine is written until every rank has read everything it needs: an error on
  any rank (a bad file, a read that fails) is raised on every rank with the engine as it was.

What zeroflat does not serve (pipeline or model parallelism, MoE, NVMe offload, a custom load
function, elastic checkpoints, an optimizer other than DeepSpeed's ZeRO ones) is DeepSpeed's own
``load_checkpoint``, with one warning saying why."""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from . import _C, _dropin
from ._comm import all_reduce_ints
from ._common import TORCH_DTYPES, dtype_name
from ._dropin import log, round_robin_offsets, stats
from ._errors import InvalidArgument, NoFeasiblePlan
from ._progress import Watch

# The loader's door for each placement a resume plan names (zeroflat/resume.h).
_LOADS = {"slice": _C.load_slice, "partitions": _C.load_partitions}


# --- which calls zeroflat serves ----------------------------------------------------------------

def _optimizer_kind(engine) -> Optional[str]:
    name = type(getattr(engine, "optimizer", None)).__name__
    if name in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"):
        return name
    return None


def _is_true(engine, method: str) -> bool:
    fn = getattr(engine, method, None)
    return bool(fn()) if callable(fn) else False


def why_not(engine, load_dir, custom_load_fn) -> Optional[str]:
    """Why this call is DeepSpeed's own, or None when zeroflat serves it (this rank's view)."""
    if custom_load_fn is not None:
        return "a custom_load_fn is DeepSpeed's to call"
    if not _is_true(engine, "zero_optimization"):
        return "the engine does not use ZeRO"
    if _optimizer_kind(engine) is None:
        return (f"its optimizer is {type(getattr(engine, 'optimizer', None)).__name__} (zeroflat "
                "resumes DeepSpeedZeroOptimizer and DeepSpeedZeroOptimizer_Stage3)")
    if getattr(engine, "has_moe_layers", False):
        return "MoE layers keep expert files of their own"
    if type(engine.module).__name__ == "PipelineModule" or getattr(engine, "mp_world_size", 1) > 1:
        return "pipeline and model parallelism keep files per stage and model-parallel rank"
    if _is_true(engine, "zero_nvme_offload_optimizer"):
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
        return f"{os.fspath(load_dir)} is not a folder"
    return None


# --- the ranks' agreement -----------------------------------------------------------------------

def _agree(error: Optional[BaseException], group, what: str) -> None:
    """Collective: raises on every rank when any rank's ``error`` is set (this rank its own, the
    others naming the lowest rank that failed), before anything is written."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    failing = all_reduce_ints([world - rank if error is not None else 0], group, "max",
                              f"the ranks' agreement on {what} (an all-reduce)",
                              f"resume-{what}")[0]
    if failing == 0:
        return
    if error is not None:
        raise error
    raise InvalidArgument(f"resuming from a DeepSpeed checkpoint: {what} failed on rank "
                          f"{world - failing} (its own error says why); nothing of the engine "
                          "was changed")


# --- the checkpoint's small values --------------------------------------------------------------

def _segment(key: Any) -> str:
    """A dict key as a path segment (torch_file.h's torch_path_segment, for str and int keys)."""
    if isinstance(key, str):
        return key.replace("%", "%25").replace("/", "%2F")
    return str(key)


class _Files:
    """The checkpoint's files by role, and the small values of the ones this rank reads."""

    def __init__(self, ck, rank: int, stage3: bool):
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
        self.stage3 = stage3

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

class _Resume:
    """One rank's resume of one checkpoint: what it reads (``read``), then what it writes
    (``write``); nothing of the engine changes before ``write``."""

    def __init__(self, engine, ck, *, load_module_strict: bool, load_optimizer_states: bool,
                 load_lr_scheduler_states: bool, load_module_only: bool):
        self.engine = engine
        self.ck = ck
        self.opt = engine.optimizer
        self.stage3 = _optimizer_kind(engine) == "DeepSpeedZeroOptimizer_Stage3"
        self.group = self.opt.dp_process_group
        self.dp = dist.get_world_size(self.group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        self.strict = bool(load_module_strict)
        self.module_only = bool(load_module_only)
        self.with_states = bool(load_optimizer_states) and not self.module_only
        self.with_scheduler = bool(load_lr_scheduler_states)
        self.load_optimizer_states = bool(load_optimizer_states)
        self.from_fp32 = _is_true(engine, "zero_load_from_fp32_weights")
        self.names: Dict[Any, str] = dict(engine.param_names)
        self.files = _Files(ck, self.rank, self.stage3)
        self.small: Dict[str, Any] = {}
        self.values: Dict[str, List[torch.Tensor]] = {}
        self.frozen: Dict[str, torch.Tensor] = {}
        self.buffers: Dict[str, torch.Tensor] = {}
        self.bytes_read = 0
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
        if ck.format != "universal" and (ck.zero_stage == 3) != self.stage3:
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
                shape = tuple(p.ds_shape) if self.stage3 else tuple(p.shape)
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
        """The optimizer's flat partitions' parameters: ZeRO-1/2's groups (group order), ZeRO-3's
        sub-groups."""
        if self.stage3:
            return [list(g) for g in self.opt.fp16_groups]
        return [list(g) for g in self.opt.bit16_groups]

    def _offsets(self, i: int) -> List[int]:
        """ZeRO-1/2 group i's parameters' offsets in its flat buffer, in group order."""
        opt = self.opt
        rr = list(opt.round_robin_bit16_groups[i])
        paddings = getattr(opt, "round_robin_bit16_padding", None)
        pads = list(paddings[i]) if paddings is not None else [0] * len(rr)
        rr_offsets = round_robin_offsets(opt, i, [p.numel() for p in rr], pads)
        indices = opt.round_robin_bit16_indices[i]
        return [rr_offsets[indices[k]] for k in range(len(rr))]

    # - reading ----------------------------------------------------------------------------------

    def targets(self) -> List[str]:
        """What this rank reads per partition: "fp32" (the master), "module" (ZeRO-1/2's 16-bit
        weights), and each partitioned optimizer state."""
        if self.stage3:
            weights = "fp32"
        else:
            weights = "fp32" if (self.with_states and self.from_fp32) else "module"
        if self.ck.format == "universal" and weights == "module":
            weights = "fp32"  # universal files hold no 16-bit weights; fp32 rounds to the same
        return [weights] + (list(self.ck.partitioned_states()) if self.with_states else [])

    def read_small(self) -> None:
        """The small values (module file's bookkeeping, the optimizer's scalars and
        param_groups, frozen parameters and buffers under ZeRO-1/2): local reads."""
        f = self.files
        keys = f.module_keys()
        module_keys = set(self.ck.keys(f.model, "module")) if "module" in keys else set()
        small = {}
        for key in keys:
            if key in ("module", "optimizer"):
                continue
            if key == "frozen_param_fragments" and self.stage3 and self.dp != self.ck.world:
                continue  # another world's fragments: the new partitions are read below
            small[key] = f.module_value(key)
        self.small = small
        self.module_keys = module_keys
        # Buffers from the module file (ZeRO-3 saves them whole in every rank's file).
        for name in self._persistent_buffers():
            if name in module_keys:
                self.buffers[name] = f.value(f.model, "module/" + _segment(name))
        # ZeRO-1/2's frozen parameters, whole (the module file's, else its fragments).
        trained = {p for params in self._sub_groups() for p in params}
        for p, name in self.names.items():
            if p in trained or self.stage3:
                continue
            fragments = small.get("frozen_param_fragments") or {}
            if name in fragments and fragments[name].numel() == p.numel():
                self.frozen[name] = fragments[name]
            elif name in module_keys:
                self.frozen[name] = f.value(f.model, "module/" + _segment(name))
            elif self.strict:
                raise InvalidArgument(f"{self.ck.dir}: no values of frozen parameter {name!r}")
        for name, t in self.frozen.items():
            self.bytes_read += t.numel() * t.element_size()
        # The optimizer's scalars.
        if self.with_states:
            self.small["optimizer"] = self._optimizer_small()
        self._check_small()

    # - what write() takes, checked before anything is written ----------------------------------

    def _where(self, file: Optional[int], entry: str) -> str:
        path = self.ck.files[file][0] if file is not None else self.ck.dir
        return f"{path}: entry '{entry}'"

    def _check_small(self) -> None:
        """Everything write() will hand the engine, checked against what the engine holds, so
        that a checkpoint it cannot take is refused before the first write (DeepSpeed's own load
        fails on each of these midway, the engine half written)."""
        f, small = self.files, self.small
        if not self.module_only:
            # DeepSpeed's _load_checkpoint reads these with [] (a KeyError there).
            for key in ("global_steps", "skipped_steps", "mp_world_size"):
                value = small.get(key)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    found = "nothing" if key not in small else type(value).__name__
                    raise InvalidArgument(f"{self._where(f.model, key)}: expected a count "
                                          f"(an int >= 0), found {found}")
            scheduler = getattr(self.engine, "lr_scheduler", None)
            if self.with_scheduler and scheduler is not None:
                saved = small.get("lr_scheduler")
                if not isinstance(saved, dict):
                    raise InvalidArgument(
                        f"{self._where(f.model, 'lr_scheduler')}: expected the scheduler's state "
                        f"(a dict), found {type(saved).__name__}; load_lr_scheduler_states=False "
                        "keeps the engine's own scheduler")
                # DeepSpeed's schedulers read each key of their state back (a KeyError midway);
                # torch's take whatever dict they are given.
                want = getattr(scheduler, "state_dict", None)
                ours = type(scheduler).__module__.startswith("deepspeed.") and callable(want)
                missing = sorted(set(want()) - set(saved)) if ours else []
                if missing:
                    raise InvalidArgument(
                        f"{self._where(f.model, 'lr_scheduler')}: no {', '.join(missing[:5])} "
                        f"(the engine's {type(scheduler).__name__} keeps them): a checkpoint of "
                        "another scheduler")
        # Frozen parameters and buffers: their element counts.
        for p, name in self.names.items():
            value = self.frozen.get(name)
            if value is not None and value.numel() != p.numel():
                raise InvalidArgument(f"{self._where(f.model, 'module/' + name)}: "
                                      f"{value.numel()} elements, the model's {name!r} "
                                      f"{p.numel()}")
        for name, buf in self._persistent_buffers().items():
            value = self.buffers.get(name)
            if value is not None and (not torch.is_tensor(value) or value.numel() != buf.numel()):
                found = f"{value.numel()} elements" if torch.is_tensor(value) else \
                    type(value).__name__
                raise InvalidArgument(f"{self._where(f.model, 'module/' + name)}: {found}, the "
                                      f"model's buffer {name!r} {buf.numel()} elements")
        if self.with_states:
            self._check_optimizer()

    def _check_optimizer(self) -> None:
        """The saved optimizer against the running one: its group count, the states it keeps per
        element, the types of its other values."""
        f, small = self.files, self.small["optimizer"]
        base = f.base_state_path()
        own_groups = self.opt.optimizer.param_groups
        groups = small["param_groups"]
        where_groups = self._where(f.optim, (base or "optimizer_state") + "/param_groups")
        if groups is not None:
            if not isinstance(groups, (list, tuple)) or \
                    not all(isinstance(g, dict) for g in groups):
                raise InvalidArgument(f"{where_groups}: expected a list of dicts, found "
                                      f"{type(groups).__name__}")
            if len(groups) != len(own_groups):
                raise InvalidArgument(f"{where_groups}: {len(groups)} parameter groups, the "
                                      f"engine's optimizer has {len(own_groups)}")
        # The states the running optimizer keeps per element of a partition (Adam's exp_avg and
        # exp_avg_sq), from its state of the first partition, when it has one yet.
        saved = set(self.ck.partitioned_states())
        inner = self.opt.optimizer
        kept = self._kept_states()
        if kept is not None:
            running, others = kept
            if running != saved:
                raise InvalidArgument(
                    f"{self._where(f.optim, (base or 'zero') + '/state')}: the optimizer states "
                    f"saved per element are {sorted(saved) or 'none'}, the engine's "
                    f"{type(inner).__name__} keeps {sorted(running) or 'none'}: a checkpoint of "
                    "another optimizer")
            for index, values in small["state_scalars"].items():
                for key, value in values.items():
                    if key not in others:
                        continue
                    numeric = torch.is_tensor(value) or (isinstance(value, (int, float)) and
                                                         not isinstance(value, bool))
                    if not numeric:
                        raise InvalidArgument(
                            f"{self._where(f.optim, f'{base}/state/{index}/{key}')}: expected a "
                            f"number or a tensor, as the engine's optimizer keeps it; found "
                            f"{type(value).__name__}")
            step = small.get("step")
            if step is not None and not (torch.is_tensor(step) or isinstance(step, (int, float))):
                raise InvalidArgument(f"{self._where(f.optim, 'step')}: expected a number or a "
                                      f"tensor, found {type(step).__name__}")

    def _kept_states(self):
        """The state the running optimizer keeps for a partition: (the names it keeps per
        element, the names of its other values); None where that cannot be told. From its
        state where it has stepped, else from one step of a copy of its class, with its first
        group's options, on two elements (DeepSpeed builds the optimizer's state lazily)."""
        inner = self.opt.optimizer
        for t in self._partition_tensors():
            state = inner.state.get(t) if hasattr(inner.state, "get") else None
            if state:
                return self._split_state(state, t.numel())
        try:
            options = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
            probe = torch.zeros(2, dtype=torch.float32, requires_grad=True)
            probe.grad = torch.zeros(2, dtype=torch.float32)
            copy_of = type(inner)([dict(options, params=[probe])])
            copy_of.step()
            return self._split_state(copy_of.state[probe], probe.numel())
        except Exception:  # noqa: BLE001 - an optimizer that cannot be copied so: not checked
            return None

    @staticmethod
    def _split_state(state, numel: int):
        per_element = {k for k, v in state.items()
                       if torch.is_tensor(v) and v.dim() > 0 and v.numel() == numel}
        return per_element, {k for k in state if k not in per_element}

    def _partition_tensors(self) -> List[torch.Tensor]:
        """The fp32 partitions the inner optimizer steps (its state's keys)."""
        if self.stage3:
            return list(getattr(self.opt, "fp32_partitioned_groups_flat", []))
        return list(self.opt.single_partition_of_fp32_groups)

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
        opt, subs = self.opt, self._sub_groups()
        targets = self.targets()
        trained = {p for params in subs for p in params}
        kw = dict(world=self.dp, stage=3 if self.stage3 else 2, states=targets[1:],
                  module_weights=targets[0] == "module",
                  groups=[[self.names[p] for p in params] for params in subs])
        if self.stage3:
            kw["group_numels"] = [[int(p.ds_numel) for p in params] for params in subs]
            frozen = [p for p in self.names if p not in trained]
            if frozen:
                dtypes = {p.ds_tensor.dtype for p in frozen}
                kw["frozen"] = [self.names[p] for p in frozen]
                kw["frozen_numels"] = [int(p.ds_numel) for p in frozen]
                kw["frozen_dtype"] = (dtype_name(dtypes.pop(), "frozen dtype")
                                      if len(dtypes) == 1 else "fp32")
            self._frozen_params = frozen
        else:
            kw["group_numels"] = [[p.numel() for p in params] for params in subs]
            kw["round_robin"] = bool(getattr(opt, "round_robin_gradients", False))
            kw["parameter_alignment"] = bool(getattr(opt, "parameter_alignment", False))
            kw["alignment_factor"] = int(getattr(opt, "nccl_start_alignment_factor", 2))
            kw["weights_dtype"] = dtype_name(opt.bit16_groups_flat[0].dtype, "16-bit dtype")
        return _C.plan_resume(self.ck, **kw)

    def read(self, threads: Optional[int]) -> None:
        """Every buffer this rank keeps, read into fresh tensors on the host, as the library's
        plan says (one load per buffer: its placement's). Collective. The ranks compare their
        checkpoint's headers in every load, not samples of its bytes (copies="off"): each reads
        bytes no other rank reads."""
        from ._load import engine_and_comm

        plan = self.plan()
        subs = self._sub_groups()
        must_match = [f"resume {self.ck.dir} tag {self.ck.tag}", f"format {self.ck.format}",
                      f"saved world {self.ck.world} release {self.ck.ds_version}",
                      f"targets {plan.targets}", f"partitions {len(subs)}",
                      f"stage3 {self.stage3}", f"world {self.dp}"]
        engine, nthreads, comm, _ = engine_and_comm(torch.device("cpu"), threads, self.dp,
                                                    self.group if self.dp > 1 else None)
        self._comm = comm
        _, _, expected = plan.rank_bytes(self.rank)
        watch = Watch(f"resume from {self.ck.dir}", self.rank, self.dp, _dropin.progress,
                      expected)
        with watch:
            for i, b in enumerate(plan.buffers):
                self._read_buffer(b, must_match if i == 0 else [], engine, nthreads, comm,
                                  watch.counts)

    def _read_buffer(self, b, must_match, engine, nthreads, comm, counts) -> None:
        """One buffer of the plan: its load, then its partitions as the optimizer keeps them
        (ZeRO-1/2: the group's slice; ZeRO-3: each sub-group's partitions, or the frozen
        parameters')."""
        from ._load import call_loader

        what = b.target if b.group is None else f"{b.target} of group {b.group}"
        options = _C.FlattenOptions(threads=nthreads, master=False, copies="off")
        options.progress = counts
        options.layout = b.layout
        options.must_match = must_match + [f"target {b.target}", f"group {b.group}",
                                           f"parameters {len(b.numels)}"]
        if b.placement == "slice":
            # Checked against the optimizer's own bookkeeping: the offsets of its flat buffer.
            options.expected_offsets = self._offsets(b.group)
            options.expected_flat_numel = self.opt.bit16_groups_flat[b.group].numel()
        report, buffer, _, lay = call_loader(
            _LOADS[b.placement], engine, comm if self.dp > 1 else None, b.index, b.params,
            options, None, f"resuming {what} from {self.ck.dir}")
        if report["outcome"] == "infeasible":
            raise NoFeasiblePlan(f"resuming {what}: {report['reason']}", report)
        self.bytes_read += int(report.get("bytes_read") or 0)
        dtype = TORCH_DTYPES[b.layout.dtype]
        if b.placement == "slice":
            n = lay["partition_numel"]
            want = self.opt.single_partition_of_fp32_groups[b.group].numel()
            if n != want:
                raise InvalidArgument(f"resuming group {b.group}: zeroflat's partition holds {n} "
                                      f"elements, DeepSpeed's {want}")
            esize = torch.tensor([], dtype=dtype).element_size()
            self.values.setdefault(b.target, []).append(buffer[: n * esize].view(dtype))
            return
        flat = buffer[: lay["flat_bytes"]].view(dtype)
        subs = [self._frozen_params] if b.target == "frozen" else self._sub_groups()
        parts, k = [], 0
        for sub in subs:
            pieces = []
            for p in sub:
                n, off = int(lay["numels"][k]), int(lay["offsets"][k])
                if n != p.ds_tensor.numel():
                    raise InvalidArgument(f"resuming {self.names[p]!r}: zeroflat's partition "
                                          f"holds {n} elements, DeepSpeed's {p.ds_tensor.numel()}")
                pieces.append((off, n))
                k += 1
            # The buffer packs the partitions back to back: a sub-group is a view of it (a copy
            # into fresh memory cost seconds of page faults at a few hundred MB).
            start = pieces[0][0] if pieces else 0
            packed = all(a + n == c for (a, n), (c, _) in zip(pieces, pieces[1:]))
            if packed:
                end = pieces[-1][0] + pieces[-1][1] if pieces else 0
                parts.append(flat[start:end])
            else:
                parts.append(torch.cat([flat[a:a + n] for a, n in pieces]))
        if b.target != "frozen":
            self.values[b.target] = parts
            return
        at = 0
        for p in self._frozen_params:
            n = p.ds_tensor.numel()
            self.frozen[self.names[p]] = parts[0][at:at + n]
            at += n

    # - writing ----------------------------------------------------------------------------------

    def _state_dict(self) -> Dict[str, Any]:
        """This rank's optimizer state as the running release's own state_dict() would have
        saved it at this world size (its rigid form), from what was read."""
        opt, small = self.opt, self.small["optimizer"]
        weights = self.values[self.targets()[0]]
        states = [s for s in self.targets()[1:]]
        own = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
        groups = small["param_groups"]
        if groups is None:
            groups = own  # elastic checkpoints keep none: the engine's own (count checked before)
        # Which new partition belongs to which group, and each group's saved state values.
        if self.stage3:
            owner = [int(opt.sub_group_to_group_id[k]) for k in range(len(weights))]
        else:
            owner = list(range(len(weights)))
        state, new_groups = {}, []
        for g, group in enumerate(groups):
            entry = {k: v for k, v in group.items() if k != "params"}
            members = [k for k in range(len(weights)) if owner[k] == g]
            entry["params"] = members
            new_groups.append(entry)
        scalars = small["state_scalars"]
        for k in range(len(weights)):
            # Its own saved values where the partitions are the saved ones, else its group's
            # first partition's (Adam's step is the same in every partition of a group). Each
            # partition gets its own copy: the optimizer steps them in place.
            saved_ids = groups[owner[k]].get("params") or [owner[k]]
            index = k if (len(scalars) == len(weights) and k in scalars) else int(saved_ids[0])
            values = {key: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v))
                      for key, v in scalars.get(index, {}).items()}
            if not values and small["step"] is not None:
                step = small["step"]
                values["step"] = step.clone() if torch.is_tensor(step) else step
            for s in states:
                values[s] = self.values[s][k]
            state[k] = values
        base = {"state": state, "param_groups": new_groups}
        sd: Dict[str, Any] = {}
        for key in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad"):
            if small.get(key) is not None:
                sd[key] = small[key]
        sd.setdefault("loss_scaler", opt.loss_scaler)
        sd.setdefault("dynamic_loss_scale", opt.dynamic_loss_scale)
        sd.setdefault("overflow", opt.overflow)
        sd["ds_version"] = small.get("ds_version") or self.ck.ds_version
        sd["partition_count"] = opt.partition_count
        if self.stage3:
            from deepspeed.runtime.zero.config import ZeroStageEnum

            sd["zero_stage"] = ZeroStageEnum.weights
            sd["optimizer_state_dict"] = base
            sd["fp32_flat_groups"] = weights
        else:
            sd.setdefault("clip_grad", opt.clip_grad)
            sd["zero_stage"] = small.get("zero_stage") or (
                2 if getattr(opt, "partition_gradients", False) else 1)
            sd["base_optimizer_state"] = base
            sd["single_partition_of_fp32_groups"] = weights
            sd["group_paddings"] = list(opt.groups_padding)
            if hasattr(opt, "round_robin_bit16_padding"):
                sd["param_alignment_paddings"] = opt.round_robin_bit16_padding
            if hasattr(opt, "_param_slice_mappings"):
                sd["param_slice_mappings"] = opt._param_slice_mappings
        return sd

    def _load_optimizer(self, sd: Dict[str, Any]) -> None:
        import inspect

        opt = self.opt
        states = [None] * self.dp
        states[self.rank] = sd
        kwargs = {"load_optimizer_states": True, "load_from_fp32_weights": self.from_fp32}
        accepted = inspect.signature(opt.load_state_dict).parameters
        opt.load_state_dict(states, **{k: v for k, v in kwargs.items() if k in accepted})

    def _set_weights_zero3(self, fp32: List[torch.Tensor]) -> None:
        """ZeRO-3 without the optimizer's states: the 16-bit partitions from the fp32 master read,
        then the master from them (DeepSpeed's _restore_from_bit16_weights)."""
        opt = self.opt
        for k, part in enumerate(fp32):
            flat = opt.fp16_partitioned_groups_flat[k]
            if flat is not None and flat.numel() == part.numel():
                flat.data.copy_(part)
                for p, q in zip(opt.fp16_partitioned_groups[k],
                                opt.unflatten(flat, opt.fp16_partitioned_groups[k])):
                    p.data = q.data
            else:
                at = 0
                for p in opt.fp16_groups[k]:
                    n = p.ds_tensor.numel()
                    p.ds_tensor.data.copy_(part[at:at + n])
                    at += n
        opt._restore_from_bit16_weights()

    def _update_16bit(self) -> None:
        """DeepSpeed's update_lp_params: each rank's 16-bit partition from its fp32 master, then
        one all-gather per group. Where the buffers are host memory, the all-gather is
        zeroflat's (ranks of one host meet in shared memory; gloo's sockets took seconds for a
        few hundred MB), else DeepSpeed's own."""
        opt, comm = self.opt, getattr(self, "_comm", None)
        flats = list(opt.bit16_groups_flat)
        groups = list(opt.real_dp_process_group)
        mine = dist.get_process_group_ranks(self.group) if comm is not None else None
        if (comm is None or any(f.device.type != "cpu" or not f.is_contiguous() for f in flats)
                or any(dist.get_process_group_ranks(g) != mine for g in groups)):
            opt.update_lp_params()
            return
        for i, flat in enumerate(flats):
            part = opt.parallel_partitioned_bit16_groups[i][self.rank]
            part.data.copy_(opt.single_partition_of_fp32_groups[i].data)
            comm.all_gather_tensor(flat.view(-1).view(torch.uint8),
                                   part.numel() * flat.element_size(),
                                   f"the all-gather of group {i}'s 16-bit weights")

    def write(self) -> None:
        """The engine takes what was read. Runs only after every rank has read everything."""
        opt = self.opt
        # The optimizer's state dict first: whatever could fail, fails before the first write.
        sd = self._state_dict() if self.with_states else None
        if hasattr(opt, "checkpoint_event_prologue"):
            opt.checkpoint_event_prologue()
        # Frozen parameters and buffers.
        for p, name in self.names.items():
            value = self.frozen.get(name)
            if value is None:
                continue
            target = p.ds_tensor if self.stage3 else p
            with torch.no_grad():
                target.data.copy_(value.reshape(target.shape))
        for name, buf in self._persistent_buffers().items():
            value = self.buffers.get(name)
            if value is not None:
                with torch.no_grad():
                    buf.copy_(value.reshape(buf.shape))
        weights = self.values[self.targets()[0]]
        if self.stage3:
            if sd is not None:
                self._load_optimizer(sd)
            else:
                self._set_weights_zero3(weights)
                persistent = getattr(opt, "persistent_parameters", None)
                if persistent:
                    persistent[0].partition(persistent)
        else:
            # The 16-bit buffers first: from the fp32 master read, or from the 16-bit slice
            # read (its fp32 copy rounds back to the same bits), and one all-gather.
            for k, part in enumerate(weights):
                opt.single_partition_of_fp32_groups[k].data.copy_(part)
            self._update_16bit()
            if sd is not None:
                self._load_optimizer(sd)
        if hasattr(opt, "checkpoint_event_epilogue"):
            opt.checkpoint_event_epilogue()
        self._write_engine()

    def _write_engine(self) -> None:
        """The engine's bookkeeping, as DeepSpeed's _load_checkpoint restores it."""
        engine, small = self.engine, self.small
        engine.loaded_checkpoint_dp_world_size = small.get("dp_world_size", self.ck.world)
        if self.module_only:
            return
        if self.with_scheduler and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(small["lr_scheduler"])
        if (_is_true(engine, "random_ltd_enabled") and
                getattr(engine, "random_ltd_scheduler", None) is not None and
                "random_ltd" in small):
            engine.random_ltd_scheduler.load_state_dict(small["random_ltd"])
        if (getattr(engine, "training_dataloader", None) is not None and
                _is_true(engine, "curriculum_learning_enabled") and "data_sampler" in small):
            engine.training_dataloader.data_sampler.load_state_dict(small["data_sampler"])
        if hasattr(engine, "sparse_tensor_module_names"):
            names = small.get("sparse_tensor_module_names", small.get("csr_tensor_module_names"))
            if names is not None:
                if self.strict:
                    engine.sparse_tensor_module_names = names
                else:
                    params = dict(engine.module.named_parameters())
                    kept = {n for n in engine.sparse_tensor_module_names
                            if not (n in self.module_keys and n not in names)}
                    engine.sparse_tensor_module_names = kept | {n for n in names if n in params}
        engine.global_steps = small["global_steps"]
        engine.global_samples = small.get("global_samples",
                                          engine.global_steps * engine.train_batch_size())
        engine.skipped_steps = small["skipped_steps"]
        engine.loaded_checkpoint_mp_world_size = small["mp_world_size"]

    def client_state(self) -> Dict[str, Any]:
        """What DeepSpeed's load_checkpoint returns as client_state: the module file's keys it
        does not restore itself."""
        if self.module_only:
            skip = {"module"}
        else:
            skip = {"module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size",
                    "data_sampler", "random_ltd"}
            if hasattr(self.engine, "sparse_tensor_module_names"):
                skip.add("sparse_tensor_module_names")
        if self.with_scheduler:
            skip.add("lr_scheduler")
        if self.load_optimizer_states:
            skip.add("optimizer")
        out = {}
        for key in self.files.module_keys():
            if key in skip:
                continue
            out[key] = None if key == "optimizer" else self.small.get(key)
        return out


def _tag(engine, load_dir) -> Optional[str]:
    """The tag DeepSpeed's load_checkpoint would take without one: the 'latest' file's (or
    'latest_universal' when the config loads universal checkpoints)."""
    universal = _is_true(engine, "load_universal_checkpoint")
    name = "latest_universal" if universal else "latest"
    path = os.path.join(os.fspath(load_dir), name)
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
    reason = why_not(engine, load_dir, custom_load_fn)
    group = engine.optimizer.dp_process_group if _optimizer_kind(engine) else None
    served = all_reduce_ints([int(reason is None)], group, "min",
                             "the ranks' agreement on serving load_checkpoint (an all-reduce)",
                             "resume-serve")[0]
    if not served:
        why = reason or "another rank cannot serve it (its warning says why)"
        stats["resume_fallbacks"].append(why)
        log.warning("zeroflat: load_checkpoint(%s) is DeepSpeed's own: %s", load_dir, why)
        return original(engine, load_dir, **args)
    if tag is None:
        tag = _tag(engine, load_dir)
        if tag is None:
            log.warning("zeroflat: no 'latest' file in %s: pass the tag of the checkpoint to load "
                        "(DeepSpeed's own load_checkpoint returns (None, None) too)", load_dir)
            return None, None
    start = time.perf_counter()
    plan, error = None, None
    try:
        ck = _C.DeepSpeedCheckpoint(os.fspath(load_dir), str(tag))
        plan = _Resume(engine, ck, load_module_strict=load_module_strict,
                       load_optimizer_states=load_optimizer_states,
                       load_lr_scheduler_states=load_lr_scheduler_states,
                       load_module_only=load_module_only)
        plan.read_small()
    except Exception as e:  # noqa: BLE001 - every rank must learn of it before anything is read
        error = e
    _agree(error, group, f"opening {os.fspath(load_dir)} tag {tag}")
    assert plan is not None
    threads = getattr(engine, "_zeroflat_threads", None)
    plan.read(threads)  # collective: an error on any rank is raised on every rank
    plan.write()
    seconds = time.perf_counter() - start
    stats["resumes"].append({"dir": os.fspath(load_dir), "tag": str(tag), "format": ck.format,
                             "saved_world": ck.world, "world": plan.dp,
                             "bytes_read": plan.bytes_read, "seconds": seconds})
    load_path = engine._get_ckpt_name(load_dir, tag)
    if not os.path.exists(load_path):
        load_path = ck.files[plan.files.model][0]
    return load_path, plan.client_state()
