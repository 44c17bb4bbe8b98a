"""The optimizer families a resume serves, behind one interface (``Family``): ZeRO-1/2's
``DeepSpeedZeroOptimizer``, ``BF16_Optimizer`` (the same layout under other names: read through
``ZeroNames``), and ZeRO-3's ``DeepSpeedZeroOptimizer_Stage3``. What differs between them is here
and only here: which parameters each optimizer partition holds, what the resume asks the
library's plan for, how a buffer read becomes the optimizer's tensors, which tensors the write
records and changes, and how the 16-bit weights follow the fp32 master. ``_resume`` (reading)
and ``_resume_write`` (writing) ask the family and never the stage."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ._comm import collective
from ._common import dtype_name
from ._dropin import round_robin_offsets
from ._errors import InvalidArgument


# The optimizers a resume serves, and the family each belongs to (family_of).
_SERVED = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer")


def optimizer_kind(engine) -> Optional[str]:
    name = type(getattr(engine, "optimizer", None)).__name__
    return name if name in _SERVED else None


def is_true(engine, method: str) -> bool:
    fn = getattr(engine, method, None)
    return bool(fn()) if callable(fn) else False


class ZeroNames:
    """BF16_Optimizer under DeepSpeedZeroOptimizer's names, as a resume reads and writes it:
    the same layout (each group's trainable parameters in order in one flat buffer, padded to
    a multiple of 2 x dp elements, cut into equal partitions; no round-robin, no loss scaler)
    kept under other names. Everything else is the optimizer's own."""

    _NAMES = {"bit16_groups": "bf16_groups", "round_robin_bit16_groups": "bf16_groups",
              "bit16_groups_flat": "bf16_groups_flat",
              "single_partition_of_fp32_groups": "fp32_groups_flat_partition",
              "parallel_partitioned_bit16_groups": "bf16_partitioned_groups",
              "groups_padding": "group_paddings"}
    loss_scaler = None
    dynamic_loss_scale = False
    overflow = False

    def __init__(self, opt):
        self._opt = opt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._opt, self._NAMES.get(name, name))

    @property
    def round_robin_bit16_indices(self) -> List[List[int]]:
        return [list(range(len(g))) for g in self._opt.bf16_groups]


def family_of(engine, rank: int, dp: int, group) -> "Family":
    """The running engine's optimizer as a resume reads and writes it."""
    kind = optimizer_kind(engine)
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        return Zero3(engine.optimizer, rank, dp, group)
    if kind == "BF16_Optimizer":
        return Zero12(ZeroNames(engine.optimizer), rank, dp, group)
    return Zero12(engine.optimizer, rank, dp, group)


class Family:
    """One optimizer family. ``opt``: the optimizer under DeepSpeedZeroOptimizer's or ZeRO-3's
    names; ``real``: the object itself (what the write records); rank, dp, group: this rank's
    place in the data-parallel group. A partition here is what the inner torch optimizer steps
    as one tensor: a ZeRO-1/2 group's slice of its flat buffer, a ZeRO-3 sub-group's."""

    stage = 0  # the ZeRO stage of the library's plan (2 covers ZeRO-1 too)

    def __init__(self, opt, rank: int, dp: int, group):
        self.opt = opt
        self.real = getattr(opt, "_opt", opt)
        self.rank, self.dp, self.group = rank, dp, group
        self.comm = None      # the loads' communicator, set by the read (zeroflat's all-gather)
        self.gathered = False  # whether the write reached the 16-bit weights' all-gather

    # - reading ----------------------------------------------------------------------------------

    def partitions(self) -> List[List[torch.nn.Parameter]]:
        """Each partition's parameters, in the optimizer's order."""
        raise NotImplementedError

    def masters(self) -> List[torch.Tensor]:
        """Each partition's fp32 master (the inner optimizer's state keys)."""
        raise NotImplementedError

    def bit16(self, k: int) -> Optional[torch.Tensor]:
        """This rank's 16-bit values of partition k, element for element with its master."""
        raise NotImplementedError

    def shape(self, p) -> Tuple[int, ...]:
        """A parameter's whole shape (ZeRO-3 keeps only a partition in p.data)."""
        return tuple(p.shape)

    def weights_target(self, with_states: bool, from_fp32: bool) -> str:
        """Where the weights come from: "fp32" (the master) or "module" (the 16-bit file)."""
        return "fp32"

    def plan_options(self, r) -> Dict[str, Any]:
        """The family's part of plan_resume's arguments (r: the resume)."""
        raise NotImplementedError

    def reads_frozen_whole(self) -> bool:
        """Whether frozen parameters are read whole (small values), not as partitions."""
        return True

    def keeps_small(self, key: str, world: int) -> bool:
        """Whether the module file's value ``key`` is kept (saved at ``world`` ranks)."""
        return True

    def load_checks(self, b, options) -> None:
        """Checks of buffer b's load against the optimizer's own bookkeeping."""

    def take(self, r, b, buffer: torch.Tensor, lay: Dict[str, Any], dtype) -> None:
        """Buffer b, read, as the optimizer keeps it: into r.values (or r.frozen)."""
        raise NotImplementedError

    # - writing ----------------------------------------------------------------------------------

    def owner(self, k: int) -> int:
        """The optimizer group partition k belongs to."""
        return k

    def state_dict(self, sd: Dict[str, Any], small: Dict[str, Any], weights, base) -> None:
        """The family's keys of the state dict its load_state_dict takes."""
        raise NotImplementedError

    def checks_release(self) -> bool:
        """Whether the optimizer's load_state_dict reads the saving release's version."""
        return True

    def record(self, undo, names) -> None:
        """The tensors the write may change in place, recorded before the first change."""
        raise NotImplementedError

    def frozen_tensor(self, p) -> torch.Tensor:
        """The tensor a frozen parameter's values are copied into."""
        return p

    def write_weights(self, r, weights: List[torch.Tensor], sd, step) -> None:
        """The weights and the optimizer's state dict written (step: the write's step)."""
        raise NotImplementedError

    def epilogue(self) -> bool:
        """The checkpoint's epilogue done here (True), or DeepSpeed's to run (False)."""
        return False

    def after_failure(self) -> None:
        """What the ranks' restored partitions need after a failed write was put back."""


class Zero12(Family):
    """DeepSpeedZeroOptimizer (ZeRO-1/2), and BF16_Optimizer under its names: each group one
    flat 16-bit buffer; this rank keeps a slice of it and that slice's fp32 master."""

    stage = 2

    def partitions(self):
        return [list(g) for g in self.opt.bit16_groups]

    def masters(self):
        return list(self.opt.single_partition_of_fp32_groups)

    def bit16(self, k):
        parts = self.opt.parallel_partitioned_bit16_groups[k]
        return parts[self.rank] if self.rank < len(parts) else None

    def weights_target(self, with_states, from_fp32):
        return "fp32" if (with_states and from_fp32) else "module"

    def plan_options(self, r):
        opt, subs = self.opt, self.partitions()
        return dict(group_numels=[[p.numel() for p in params] for params in subs],
                    round_robin=bool(getattr(opt, "round_robin_gradients", False)),
                    parameter_alignment=bool(getattr(opt, "parameter_alignment", False)),
                    alignment_factor=int(getattr(opt, "nccl_start_alignment_factor", 2)),
                    weights_dtype=dtype_name(opt.bit16_groups_flat[0].dtype, "16-bit dtype"))

    def _offsets(self, i: int) -> List[int]:
        """Group i's parameters' offsets in its flat buffer, in group order."""
        opt = self.opt
        rr = list(opt.round_robin_bit16_groups[i])
        paddings = getattr(opt, "round_robin_bit16_padding", None)
        pads = list(paddings[i]) if paddings is not None else [0] * len(rr)
        rr_offsets = round_robin_offsets(opt, i, [p.numel() for p in rr], pads)
        indices = opt.round_robin_bit16_indices[i]
        return [rr_offsets[indices[k]] for k in range(len(rr))]

    def load_checks(self, b, options):
        # The slice's layout against the optimizer's own: the offsets of its flat buffer.
        options.expected_offsets = self._offsets(b.group)
        options.expected_flat_numel = self.opt.bit16_groups_flat[b.group].numel()

    def take(self, r, b, buffer, lay, dtype):
        n = lay["partition_numel"]
        want = self.opt.single_partition_of_fp32_groups[b.group].numel()
        if n != want:
            raise InvalidArgument(f"resuming group {b.group}: zeroflat's partition holds {n} "
                                  f"elements, DeepSpeed's {want}")
        esize = torch.tensor([], dtype=dtype).element_size()
        # In its group's place, never by arrival order (DeepSpeed 0.19 refuses a ZeRO-1/2 group
        # with nothing trained; should one come, the others keep their places).
        values = r.values.setdefault(
            b.target, [torch.zeros(0, dtype=dtype) for _ in self.opt.bit16_groups])
        values[int(b.group)] = buffer[: n * esize].view(dtype)

    def state_dict(self, sd, small, weights, base):
        opt = self.opt
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

    def record(self, undo, names):
        opt = self.opt
        # This rank's partition of each group's 16-bit weights: the rest of the flat buffer is
        # the other ranks' partitions, which the all-gather brings back (after_failure).
        for parts in opt.parallel_partitioned_bit16_groups:
            undo.tensor(parts[self.rank])
        for master in opt.single_partition_of_fp32_groups:
            undo.tensor(master)
        grouped = {id(p) for g in opt.bit16_groups for p in g}
        for p in names:
            if id(p) not in grouped:  # else in its group's flat buffer
                undo.tensor(p.data)

    def write_weights(self, r, weights, sd, step):
        opt = self.opt
        # The 16-bit buffers first: from the fp32 master read, or from the 16-bit slice read
        # (its fp32 copy rounds back to the same bits), and one all-gather.
        for k, part in enumerate(weights):
            master = opt.single_partition_of_fp32_groups[k]
            if part.data_ptr() != master.data_ptr():  # else read straight into it
                master.data.copy_(part)
            step(f"the fp32 master of group {k}")
        self.update_16bit()
        step("the 16-bit weights")
        if sd is not None:
            r.load_optimizer(sd)
            step("the optimizer's load_state_dict")

    def after_failure(self):
        if self.gathered:
            self.update_16bit()  # every rank's restored partition, to every rank

    def update_16bit(self) -> None:
        """DeepSpeed's update_lp_params: each rank's 16-bit partition from its fp32 master, then
        one all-gather per group. Where the buffers are host memory, the all-gather is
        zeroflat's (ranks of one host meet in shared memory; gloo's sockets took seconds for a
        few hundred MB), else DeepSpeed's own."""
        opt, comm = self.opt, self.comm
        self.gathered = True
        flats = list(opt.bit16_groups_flat)
        groups = list(opt.real_dp_process_group)
        mine = dist.get_process_group_ranks(self.group) if comm is not None else None
        if (comm is None or any(f.device.type != "cpu" or not f.is_contiguous() for f in flats)
                or any(dist.get_process_group_ranks(g) != mine for g in groups)):
            opt.update_lp_params()
            return
        items = []
        for i, flat in enumerate(flats):
            part = opt.parallel_partitioned_bit16_groups[i][self.rank]
            part.data.copy_(opt.single_partition_of_fp32_groups[i].data)
            items.append((flat.view(-1).view(torch.uint8), part.numel() * flat.element_size()))
        comm.all_gather_tensors(items, "the all-gather of the groups' 16-bit weights")


# The most bytes zeroflat's one all-gather of ZeRO-3's persistent parameters takes (every rank's
# partitions of all of them): what it saves is latency, which larger gathers do not need, and
# their bytes are held twice while copied out.
_PERSISTENT_GATHER_BYTES = 64 << 20


class Zero3(Family):
    """DeepSpeedZeroOptimizer_Stage3: each sub-group's partitions back to back in tensors of the
    optimizer's own (16-bit and fp32); every parameter keeps only its partition (p.ds_tensor),
    frozen ones too."""

    stage = 3

    def __init__(self, opt, rank, dp, group):
        super().__init__(opt, rank, dp, group)
        self.frozen: List[Any] = []  # the frozen parameters whose partitions are read

    def partitions(self):
        return [list(g) for g in self.opt.fp16_groups]

    def masters(self):
        return list(getattr(self.opt, "fp32_partitioned_groups_flat", []) or [])

    def bit16(self, k):
        flats = getattr(self.opt, "fp16_partitioned_groups_flat", None) or []
        return flats[k] if k < len(flats) else None

    def shape(self, p):
        return tuple(p.ds_shape)

    def reads_frozen_whole(self):
        return False

    def keeps_small(self, key, world):
        # Another world's fragments: the new partitions are read (the "frozen" buffer).
        return not (key == "frozen_param_fragments" and self.dp != world)

    def plan_options(self, r):
        subs = self.partitions()
        trained = {p for params in subs for p in params}
        kw: Dict[str, Any] = dict(group_numels=[[int(p.ds_numel) for p in params]
                                                for params in subs],
                                  buffer_per_group=True)  # each sub-group's own tensors
        frozen = [p for p in r.names if p not in trained]
        if not r.strict and r.ck.format != "universal":
            # As DeepSpeed's load_module_strict=False: a frozen parameter the checkpoint does
            # not hold (saved with exclude_frozen_parameters) keeps its values.
            held = r.module_keys | {name for name, *_ in r.ck.frozen}
            frozen = [p for p in frozen if r.names[p] in held]
        if frozen:
            dtypes = {p.ds_tensor.dtype for p in frozen}
            kw["frozen"] = [r.names[p] for p in frozen]
            kw["frozen_numels"] = [int(p.ds_numel) for p in frozen]
            kw["frozen_dtype"] = (dtype_name(dtypes.pop(), "frozen dtype")
                                  if len(dtypes) == 1 else "fp32")
        self.frozen = frozen
        return kw

    def take(self, r, b, buffer, lay, dtype):
        flat = buffer[: lay["flat_bytes"]].view(dtype)
        if b.target == "frozen":
            subs = [self.frozen]
        elif b.group is not None:
            subs = [self.partitions()[int(b.group)]]  # one sub-group's buffer
        else:
            subs = self.partitions()
        parts, k = [], 0
        for sub in subs:
            pieces = []
            for p in sub:
                n, off = int(lay["numels"][k]), int(lay["offsets"][k])
                if n != p.ds_tensor.numel():
                    raise InvalidArgument(f"resuming {r.names[p]!r}: zeroflat's partition "
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
        if b.target == "frozen":
            at = 0
            for p in self.frozen:
                n = p.ds_tensor.numel()
                r.frozen[r.names[p]] = parts[0][at:at + n]
                at += n
        elif b.group is not None:
            # In its sub-group's place (a sub-group with nothing trained has no buffer).
            values = r.values.setdefault(
                b.target, [torch.zeros(0, dtype=dtype) for _ in self.opt.fp16_groups])
            values[int(b.group)] = parts[0]
        else:
            r.values[b.target] = parts

    def owner(self, k):
        return int(self.opt.sub_group_to_group_id[k])

    def state_dict(self, sd, small, weights, base):
        from deepspeed.runtime.zero.config import ZeroStageEnum

        sd["zero_stage"] = ZeroStageEnum.weights
        sd["optimizer_state_dict"] = base
        sd["fp32_flat_groups"] = weights

    def checks_release(self):
        return False

    def record(self, undo, names):
        opt = self.opt
        for flat in list(getattr(opt, "fp16_partitioned_groups_flat", []) or []):
            undo.tensor(flat)  # first: the parameters' views of them are not recorded again
        for flat in self.masters():
            undo.tensor(flat)
        for p in names:
            undo.tensor(p.ds_tensor)
            undo.data(p)

    def frozen_tensor(self, p):
        return p.ds_tensor

    def write_weights(self, r, weights, sd, step):
        if sd is not None:
            r.load_optimizer(sd)
            step("the optimizer's load_state_dict")
            return
        self._set_weights(weights)
        step("the 16-bit partitions")
        persistent = getattr(self.opt, "persistent_parameters", None)
        if persistent:
            persistent[0].partition(persistent)
            step("the persistent parameters partitioned")

    def _set_weights(self, fp32: List[torch.Tensor]) -> None:
        """Without the optimizer's states: the 16-bit partitions from the fp32 master read, then
        the master from them (DeepSpeed's _restore_from_bit16_weights)."""
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

    def epilogue(self) -> bool:
        """The checkpoint epilogue (the persistent parameters whole again from every rank's
        16-bit partition) in one all-gather, where DeepSpeed's runs one per parameter (on gloo,
        each a few milliseconds of latency). The same values in the same places: each parameter's
        data its ranks' partitions end to end, cut to its elements, in storage of its own. While
        they are copied out, the gathered bytes are held twice: at most _PERSISTENT_GATHER_BYTES
        (DeepSpeed's epilogue runs for more).
        False, nothing done, where DeepSpeed's own epilogue must run (_plain_persistent). Every
        rank decides alike (the same engine configuration)."""
        todo = self._plain_persistent()
        if todo is None:
            return False
        if not todo:
            return True  # the epilogue has nothing to gather (and no secondary tensors)
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        device = todo[0].ds_tensor.device
        sizes = [p.ds_tensor.numel() * p.ds_tensor.element_size() for p in todo]
        slot = sum(sizes)
        out = torch.empty(slot * self.dp, dtype=torch.uint8, device=device)
        part = torch.cat([p.ds_tensor.detach().reshape(-1).view(torch.uint8) for p in todo])
        collective("the all-gather of ZeRO-3's persistent parameters", self.group,
                   "resume-persistent",
                   lambda: dist.all_gather_into_tensor(out, part, group=self.group))
        rows = out.view(self.dp, slot)
        at = 0
        for p, n in zip(todo, sizes):
            # A tensor of the parameter's own (its partitions of every rank, in rank order).
            whole = torch.empty(self.dp * p.ds_tensor.numel(), dtype=p.ds_tensor.dtype,
                                device=device)
            whole.view(torch.uint8).view(self.dp, n).copy_(rows[:, at:at + n])
            p.data = whole.narrow(0, 0, p.ds_numel).view(p.ds_shape).data
            p.ds_status = ZeroParamStatus.AVAILABLE
            at += n
        return True

    def _plain_persistent(self) -> Optional[List[Any]]:
        """The persistent parameters the epilogue would gather, where zeroflat's one all-gather
        can: None for secondary (hpZ) or quantized partitions, partitions on NVMe or on another
        device than the parameter, another process group than the engine's, a backend/device
        pair other than gloo with host tensors or nccl with GPU ones, more than
        _PERSISTENT_GATHER_BYTES gathered, or anything unexpected of the release (DeepSpeed's
        own epilogue then runs)."""
        opt = self.opt
        if not dist.is_initialized():
            return None
        try:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            if any(getattr(p, "ds_secondary_tensor", None) is not None
                   for group in opt.fp16_groups for p in group):
                return None
            todo = [p for p in list(opt.persistent_parameters or [])
                    if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            if not todo:
                return todo
            backend = str(dist.get_backend(self.group))
            mine = dist.get_process_group_ranks(self.group)
            device = todo[0].ds_tensor.device
            if backend not in ("gloo", "nccl") or (device.type == "cpu") == (backend == "nccl"):
                return None
            for p in todo:
                t = p.ds_tensor
                if (t.device != device or p.data.device != device or not t.is_contiguous()
                        or hasattr(t, "ds_quant_scale") or t.numel() != t.ds_numel
                        or _on_nvme(getattr(t, "final_location", None))
                        or dist.get_process_group_ranks(p.ds_process_group) != mine):
                    return None
            gathered = self.dp * sum(p.ds_tensor.numel() * p.ds_tensor.element_size()
                                     for p in todo)
            return todo if gathered <= _PERSISTENT_GATHER_BYTES else None
        except Exception:  # noqa: BLE001 - a release unlike those known: its own epilogue
            return None


def _on_nvme(location: Any) -> bool:
    """Whether a ZeRO-3 partition's final_location is NVMe (OffloadDeviceEnum.nvme; DeepSpeed
    marks partitions that are not with the string 'not-nvme')."""
    return getattr(location, "value", location) == "nvme"
