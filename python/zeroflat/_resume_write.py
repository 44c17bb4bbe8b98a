"""The writing half of a resume (``_resume._Resume`` inherits it): everything the engine will take,
checked against the running engine before the first write, then the engine written as DeepSpeed's
own load writes it (the optimizer's state dict in the running release's form, the 16-bit weights
from the fp32 master, frozen parameters, buffers, the scheduler and the counters)."""

from __future__ import annotations

import copy
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ._errors import InvalidArgument
from ._resume_family import is_true
from ._resume_undo import Undo


# Testing aid: the write fails at its step FAIL_AT (1, 2, ...: each step one change to the engine
# or a call that may change it), as an exception from DeepSpeed, torch or a scheduler there
# would; STEPS: how many steps the last write took.
FAIL_AT: Optional[int] = None
STEPS = 0

def _step(what: str) -> None:
    """One step of the write done: where the testing aid FAIL_AT makes it fail."""
    global STEPS
    STEPS += 1
    if FAIL_AT is not None and STEPS == FAIL_AT:
        raise RuntimeError(f"injected failure at step {STEPS} of the write ({what}; testing aid)")


class EngineWriter:
    """Methods of ``_Resume`` that check and write the engine; they read its attributes (engine,
    family, opt, ck, files, small, values, frozen, buffers, names, ...). What differs between
    optimizer families is the family's (_resume_family)."""

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
            # A checkpoint saved before any step keeps no state at all (DeepSpeed takes it and
            # the optimizer starts its states afresh): only states that differ are refused.
            if saved and running != saved:
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
        # What the running optimizer's load_state_dict stops at, after the engine is written:
        # its arguments; ZeRO-1/2's and BF16_Optimizer's the saving release's version.
        self._load_call_checked = self._load_call()
        if self.family.checks_release():
            from packaging.version import InvalidVersion, parse

            version = self._saved_version()
            try:
                readable = bool(version) and parse(str(version)) is not None
            except InvalidVersion:
                readable = False
            if not readable:
                raise InvalidArgument(
                    f"{self._where(f.optim, 'ds_version')}: {version!r}, no DeepSpeed release a "
                    "version can be read from (DeepSpeed's own load stops at it)")
        clip = small.get("clip_grad")
        clip = getattr(self.opt, "clip_grad", None) if clip is None else clip
        if (getattr(self.opt, "compute_grad_norm", True) is False
                and isinstance(clip, (int, float)) and clip > 0.0):
            raise InvalidArgument(f"{self._where(f.optim, 'clip_grad')}: {clip}, a checkpoint "
                                  "with gradient clipping, and the engine runs "
                                  "zero_optimization.compute_grad_norm=false (DeepSpeed's own "
                                  "load refuses it too)")

    def _saved_version(self) -> Any:
        """The release that saved the checkpoint: the optimizer file's, else the module file's."""
        return self.small["optimizer"].get("ds_version") or self.ck.ds_version

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
        return self.family.masters()

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
        owner = [self.family.owner(k) for k in range(len(weights))]
        state, new_groups = {}, []
        for g, group in enumerate(groups):
            entry = {k: v for k, v in group.items() if k != "params"}
            if small["param_groups"] is None and small["step"] is not None:
                # An elastic checkpoint's one step, which DeepSpeed puts in every group.
                entry["step"] = small["step"]
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
        sd["ds_version"] = self._saved_version()
        sd["partition_count"] = opt.partition_count
        self.family.state_dict(sd, small, weights, base)
        return sd

    def _load_call(self):
        """The running optimizer's load_state_dict and the keywords it takes (the release's:
        0.14's BF16_Optimizer requires checkpoint_folder; a signature with ``**kwargs`` takes
        them all), bound to its signature: refused here, before anything is read or written,
        where it takes other arguments."""
        import inspect

        fn = self.opt.load_state_dict
        kwargs = {"load_optimizer_states": True, "load_from_fp32_weights": self.from_fp32,
                  "checkpoint_folder": None}
        try:
            signature = inspect.signature(fn)
            params = signature.parameters.values()
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
                kwargs = {k: v for k, v in kwargs.items() if k in signature.parameters}
            signature.bind([None] * self.dp, **kwargs)
        except (TypeError, ValueError) as e:
            name = type(self.engine.optimizer).__name__
            raise InvalidArgument(f"{name}.load_state_dict of this DeepSpeed release takes other "
                                  f"arguments ({e}); nothing of the engine was changed") from None
        return fn, kwargs

    def load_optimizer(self, sd: Dict[str, Any]) -> None:
        """The running optimizer's load_state_dict of this rank's state dict (checked first)."""
        fn, kwargs = self._load_call_checked
        states = [None] * self.dp
        states[self.rank] = sd
        fn(states, **kwargs)

    def write(self) -> None:
        """The engine takes what was read. Runs only after every rank has read everything.
        All or nothing: what the write may change is recorded first (Undo), and a failure at
        any point puts it all back, then the tensors read into (put_back), and raises; then,
        where several ranks resume, they agree, and a rank whose write succeeded puts its engine
        back too and raises naming the rank that failed."""
        global STEPS
        STEPS = 0
        undo = Undo(put_back=getattr(self, "_lent_tensors", []))
        self.family.gathered = False
        error: Optional[BaseException] = None
        try:
            t0 = time.perf_counter()
            self._record(undo)
            self.record_seconds = time.perf_counter() - t0
            self._write()
        except BaseException as e:  # noqa: BLE001 - put back, then raised (below or agreed)
            error = e
        if error is not None:
            undo.restore()
            self.put_back()  # the tensors read into, as they were
            if not isinstance(error, Exception) or self.dp <= 1 or self.group is None:
                raise error
        if self.dp > 1 and self.group is not None:
            # One all-reduce: the lowest rank that failed, and whether any rank's write reached
            # the 16-bit weights' all-gather (each rank recorded only its own partition of them:
            # the others' parts come back by the same all-gather, once every rank put back).
            from ._comm import all_reduce_ints

            me = dist.get_rank()
            failed, gathered = all_reduce_ints(
                [me + 1 if error is not None else 0, int(self.family.gathered)], self.group,
                "max",
                "the ranks' agreement on the written engine", "resume-written")
            if failed:
                if error is None:  # this rank's write succeeded: put back too
                    undo.restore()
                    self.put_back()
                self.family.gathered = bool(gathered)
                self.family.after_failure()
                if error is not None:
                    raise error
                raise InvalidArgument(
                    f"resuming from {self.ck.dir}: rank {failed - 1} failed to write its engine "
                    "(its error says why); this rank's engine was put back as it was")
        self._lent, self._lent_tensors = [], []

    def _record(self, undo: Undo) -> None:
        """Everything the write may change, recorded (Undo) before the first change."""
        engine, real = self.engine, self.family.real  # the optimizer itself (not ZeroNames)
        undo.state(real)
        undo.state(getattr(real, "optimizer", None))
        self.family.record(undo, self.names)
        for buf in self._persistent_buffers().values():
            undo.tensor(buf)
        for name in ("lr_scheduler", "random_ltd_scheduler"):
            undo.state(getattr(engine, name, None))
        loader = getattr(engine, "training_dataloader", None)
        undo.state(getattr(loader, "data_sampler", None) if loader is not None else None)
        for name in ("loaded_checkpoint_dp_world_size", "loaded_checkpoint_mp_world_size",
                     "sparse_tensor_module_names", "global_steps", "global_samples",
                     "skipped_steps"):
            undo.attr(engine, name)

    def _write(self) -> None:
        opt = self.opt
        # The optimizer's state dict first: whatever it finds, it finds before the first write.
        sd = self._state_dict() if self.with_states else None
        _step("the optimizer's state dict")
        if hasattr(opt, "checkpoint_event_prologue"):
            opt.checkpoint_event_prologue()
            _step("the checkpoint prologue")
        # Frozen parameters and buffers.
        for p, name in self.names.items():
            value = self.frozen.get(name)
            if value is None:
                continue
            target = self.family.frozen_tensor(p)
            with torch.no_grad():
                target.data.copy_(value.reshape(target.shape))
            _step(f"frozen parameter {name}")
        for name, buf in self._persistent_buffers().items():
            value = self.buffers.get(name)
            if value is not None:
                with torch.no_grad():
                    buf.copy_(value.reshape(buf.shape))
                _step(f"buffer {name}")
        self.family.write_weights(self, self.values[self.targets()[0]], sd, _step)
        if hasattr(opt, "checkpoint_event_epilogue") and not self.family.epilogue():
            opt.checkpoint_event_epilogue()
        _step("the checkpoint epilogue")
        self._write_engine()

    def _write_engine(self) -> None:
        """The engine's bookkeeping, as DeepSpeed's _load_checkpoint restores it."""
        engine, small = self.engine, self.small
        engine.loaded_checkpoint_dp_world_size = small.get("dp_world_size", self.ck.world)
        if self.module_only:
            return
        _step("the loaded world size")
        if self.with_scheduler and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(small["lr_scheduler"])
            _step("the scheduler's load_state_dict")
        if (is_true(engine, "random_ltd_enabled") and
                getattr(engine, "random_ltd_scheduler", None) is not None and
                "random_ltd" in small):
            engine.random_ltd_scheduler.load_state_dict(small["random_ltd"])
        if (getattr(engine, "training_dataloader", None) is not None and
                is_true(engine, "curriculum_learning_enabled") and "data_sampler" in small):
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
        _step("global_steps")
        engine.global_samples = small.get("global_samples",
                                          engine.global_steps * engine.train_batch_size())
        engine.skipped_steps = small["skipped_steps"]
        engine.loaded_checkpoint_mp_world_size = small["mp_world_size"]
        _step("the counters")

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
