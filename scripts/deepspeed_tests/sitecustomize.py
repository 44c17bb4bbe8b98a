"""Per-process instrumentation for scripts/deepspeed_checkpoint_tests.py (every Python process
that runner starts: pytest, multiprocessing's forkserver, each rank).

It does nothing unless ZF_DS_MODE ("plain" or "dropin") and ZF_DS_EVENTS (a folder) are set; the
runner puts this folder first on PYTHONPATH so that every process, forked or spawned, runs it.

- ZF_DS_MODE=dropin: ``zeroflat.deepspeed.install()`` is called here, at interpreter start, so
  every rank runs with the drop-in (a rank forked by the forkserver inherits the patched classes);
  ZF_DS_SAVE_BACKGROUND=0 installs it with ``save_in_background=False``.
- Both modes: ``DeepSpeedEngine.load_checkpoint`` and ``save_checkpoint`` (zeroflat's patches
  of them, in dropin mode) are wrapped once more, outermost, to record each call: load or save,
  the test running (ZF_DS_EVENTS/current_test, written by the runner's pytest plugin), the rank,
  and what became of it: served by zeroflat (``stats["resumes"]`` / ``stats["saves"]`` grew, or
  a save is being written in the background),
  handed back to DeepSpeed (``stats["resume_fallbacks"]`` / ``stats["save_fallbacks"]`` grew),
  raised, or plain. One line per call in ZF_DS_EVENTS/calls-<pid>.jsonl; the process's whole
  ``zeroflat.deepspeed.stats`` in ZF_DS_EVENTS/stats-<pid>.json after each call and at exit.
- faulthandler on SIGUSR1 (all threads) into ZF_DS_EVENTS/faulthandler-<pid>.txt, re-armed in
  each forked child, so the runner can see where every process of a hung test is.

Debian's own sitecustomize (the apport hook) is run after this one, as it would have been.
"""

import os

_MODE = os.environ.get("ZF_DS_MODE")
_DIR = os.environ.get("ZF_DS_EVENTS")


def _chain_next_sitecustomize():
    """Runs the sitecustomize this one shadows (the next one on sys.path), if any."""
    import importlib.machinery
    import importlib.util
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - as site.py treats a failing sitecustomize
        pass


def _setup():
    import atexit
    import faulthandler
    import json
    import signal
    import sys
    import time
    import traceback

    state = {"fh": None, "calls": []}

    def arm_faulthandler():
        state["calls"] = []  # a forked child starts its own record
        try:
            f = open(os.path.join(_DIR, f"faulthandler-{os.getpid()}.txt"), "a")
            faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
            old, state["fh"] = state["fh"], f
            if old is not None:
                old.close()
        except Exception as e:  # noqa: BLE001 - instrumentation must not break the process
            print(f"zeroflat test runner: faulthandler not armed in {os.getpid()}: {e}",
                  file=sys.stderr)

    arm_faulthandler()
    os.register_at_fork(after_in_child=arm_faulthandler)

    def current_test():
        try:
            with open(os.path.join(_DIR, "current_test")) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def rank_world():
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                return dist.get_rank(), dist.get_world_size()
        except Exception:  # noqa: BLE001
            pass
        return None, None

    def zf_stats():
        if _MODE != "dropin":
            return None
        try:
            from zeroflat._dropin import stats
            return stats
        except Exception:  # noqa: BLE001
            return None

    def dump_stats(reason):
        stats = zf_stats()
        if not state["calls"] and not (stats and any(stats[k] for k in (
                "resumes", "resume_fallbacks", "saves", "save_fallbacks"))):
            return
        rank, world = rank_world()
        doc = {"pid": os.getpid(), "mode": _MODE, "rank": rank, "world": world, "when": reason,
               "calls": state["calls"], "stats": stats}
        path = os.path.join(_DIR, f"stats-{os.getpid()}.json")
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(doc, f, default=str, indent=1)
            os.replace(path + ".tmp", path)
        except Exception:  # noqa: BLE001
            pass

    def record(entry):
        state["calls"].append(entry)
        try:
            with open(os.path.join(_DIR, f"calls-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(entry, default=str) + "\n")
        except Exception:  # noqa: BLE001
            pass

    atexit.register(dump_stats, "atexit")
    # A process forked by multiprocessing (a pool worker from the forkserver) ends in os._exit:
    # no atexit, but multiprocessing's finalizers run (re-registered in each child).
    try:
        from multiprocessing import util as mp_util

        class _Anchor:
            pass

        anchor = _Anchor()
        state["anchor"] = anchor

        def after_fork(_):
            mp_util.Finalize(None, dump_stats, args=("exit",), exitpriority=100)

        mp_util.register_after_fork(anchor, after_fork)
    except Exception:  # noqa: BLE001
        pass

    if _MODE == "dropin":
        try:
            import zeroflat.deepspeed
            zeroflat.deepspeed.install(
                save_in_background=os.environ.get("ZF_DS_SAVE_BACKGROUND", "1") != "0")
        except BaseException as e:  # noqa: BLE001 - said loudly; the runner checks for it
            with open(os.path.join(_DIR, f"install-error-{os.getpid()}.txt"), "w") as f:
                f.write(traceback.format_exc())
            print(f"zeroflat test runner: zeroflat.deepspeed.install() failed: {e!r}",
                  file=sys.stderr)
            return
    from deepspeed.runtime.engine import DeepSpeedEngine

    def started(call):
        """Whether the drop-in's save now being written in the background is this call's (the
        save's record joins stats["saves"] once it is written)."""
        if call != "save":
            return False
        return getattr(sys.modules.get("zeroflat._save"), "_pending", None) is not None

    def wrap(name, call, served_key, fallback_key):
        """DeepSpeedEngine.<name>, wrapped outermost: each call recorded with what became of it
        (served: stats[served_key] grew; handed back: stats[fallback_key] grew)."""
        inner = getattr(DeepSpeedEngine, name)
        if getattr(inner, "__zf_test_runner__", False):
            return

        def method(self, *args, **kwargs):
            # The folder is the first argument, positional or by its name (save_dir, load_dir:
            # DeepSpeed's own tests pass it either way).
            folder = args[0] if args else kwargs.get("save_dir", kwargs.get("load_dir"))
            stats = zf_stats()
            before = (len(stats[served_key]), len(stats[fallback_key])) if stats else None
            rank, world = rank_world()
            base = {"pid": os.getpid(), "mode": _MODE, "call": call, "test": current_test(),
                    "rank": rank, "world": world, "dir": os.fspath(folder) if folder is not None else None,
                    "tag": kwargs.get("tag"), "start": time.time()}
            enter = dict(base, event="enter")
            try:
                with open(os.path.join(_DIR, f"calls-{os.getpid()}.jsonl"), "a") as f:
                    f.write(json.dumps(enter, default=str) + "\n")
            except Exception:  # noqa: BLE001
                pass
            entry = dict(base, event="call")
            try:
                result = method.__wrapped__(self, *args, **kwargs)
            except BaseException as e:
                entry.update(outcome="raised", error=f"{type(e).__name__}: {e}",
                             traceback=traceback.format_exc()[-6000:])
                if stats is not None and len(stats[fallback_key]) > before[1]:
                    # handed back, and DeepSpeed's own call raised (as some tests expect)
                    entry.update(outcome="handed_back", reason=stats[fallback_key][-1],
                                 raised_by_deepspeed=True)
                elif stats is None:
                    entry["outcome"] = "plain"
                    entry["raised_by_deepspeed"] = True
                raise
            else:
                if stats is None:
                    entry["outcome"] = "plain"
                elif len(stats[fallback_key]) > before[1]:
                    entry.update(outcome="handed_back", reason=stats[fallback_key][-1])
                elif len(stats[served_key]) > before[0] or started(call):
                    entry.update(outcome="served", detail=(stats[served_key] or [None])[-1])
                else:
                    entry["outcome"] = "returned"  # e.g. no 'latest' file: (None, None)
                return result
            finally:
                entry["seconds"] = time.time() - entry["start"]
                record(entry)
                dump_stats(f"after {name}")

        method.__zf_test_runner__ = True
        method.__wrapped__ = inner
        method.__doc__ = inner.__doc__
        method.__name__ = name
        setattr(DeepSpeedEngine, name, method)

    wrap("load_checkpoint", "load", "resumes", "resume_fallbacks")
    wrap("save_checkpoint", "save", "saves", "save_fallbacks")


if _MODE in ("plain", "dropin") and _DIR:
    try:
        _setup()
    except Exception as _e:  # noqa: BLE001
        import sys as _sys
        import traceback as _tb
        try:
            with open(os.path.join(_DIR, f"install-error-{os.getpid()}.txt"), "w") as _f:
                _f.write(_tb.format_exc())
        except OSError:
            pass
        print(f"zeroflat test runner: instrumentation failed: {_e!r}", file=_sys.stderr)

_chain_next_sitecustomize()
