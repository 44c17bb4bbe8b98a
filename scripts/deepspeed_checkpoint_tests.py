#!/usr/bin/env python3
"""Runs DeepSpeed's own ``tests/unit/checkpoint`` tests on the CPU twice, plainly and with
``zeroflat.deepspeed.install()`` in every process, and compares the outcomes test by test.

    .venv/bin/python scripts/deepspeed_checkpoint_tests.py --source DEEPSPEED_SRC [TEST_ID ...]
        [-k EXPR] [--timeout 600] [--batch file|class|test] [--modes plain,dropin]
        [--workdir DIR [--resume]] [--json OUT] [--list]

``--source``: an extracted DeepSpeed source tree holding ``tests/`` (a checkout or a
``git archive`` of the release's tag; only its ``tests/`` folder is used, copied into the work
folder, so the tree's own ``deepspeed/`` package never shadows the installed one), or such a tree
as a .tar.gz/.zip. ``--git REPO --ref TAG`` takes ``tests/`` from a git repository instead.
Without either, the script downloads the installed release's sdist from PyPI (``pip download
--no-deps --no-binary :all: deepspeed==X``) into ``--cache`` and uses its ``tests/``, where it has
one: DeepSpeed's sdists up to at least 0.19.8 do not ship ``tests/`` (checked for 0.19.8: only
deepspeed/, csrc/, op_builder/, accelerator/, requirements/, bin/, benchmarks/), so for them it
stops and says so.

TEST_ID: node ids or paths relative to ``tests/`` (``unit/checkpoint/test_sparse.py``,
``unit/checkpoint/test_zero_optimizer.py::TestZeROElasticCheckpoint``; a leading ``tests/`` is
accepted), default ``unit/checkpoint``; ``-k`` and ``--pytest-arg`` are passed to the collection.

How it runs
-----------
- Tests are collected once; then each batch (by default one test file) runs plainly, then with
  the drop-in, one pytest at a time (no xdist), with the venv's python (``--python``), in the
  patched copy. ``DS_ACCELERATOR=cpu`` (DeepSpeed's CPU accelerator: the gloo backend without
  oneCCL), ``OMP_NUM_THREADS=1`` (``--threads``): a 4-rank test on a 2-core machine.
- ``scripts/deepspeed_tests/sitecustomize.py`` is first on PYTHONPATH, so every process (pytest,
  the forkserver the tests' pools fork from, every rank, spawned or forked) runs it: in the
  drop-in run it calls ``zeroflat.deepspeed.install()``; in both it records each
  ``DeepSpeedEngine.load_checkpoint`` and ``save_checkpoint`` call (test, rank, served / handed
  back / raised) and the process's ``zeroflat.deepspeed.stats`` into the run's events folder,
  and arms faulthandler on SIGUSR1. The zeroflat package is a snapshot (taken at start) of ``--zeroflat``
  (default build/python), so a rebuild during the run changes nothing.
- ``scripts/deepspeed_tests/zf_ds_pytest_plugin.py`` records each test's start, phase reports and
  finish as they happen. A test running longer than ``--timeout`` seconds (setup, call and
  teardown together; default 600) is a timeout: every process of the pytest session is dumped
  (``py-spy dump`` where py-spy is installed beside the python or on PATH, and faulthandler's
  traceback of every thread), the session is killed, and pytest starts again with the batch's
  remaining tests. DeepSpeed's own hang timeout (DS_UNITTEST_TIMEOUT, which ends the whole
  session) is set past ours.
- The table: test id, plain outcome, drop-in outcome, then for ``load_checkpoint`` and for
  ``save_checkpoint``: the calls in the plain run, and in the drop-in run the calls zeroflat
  served / handed back to DeepSpeed (and raised, if any), as ``plain: served/back``; a call
  counts once, as rank 0 (or the one process without torch.distributed) saw it. The drop-in
  saves as it does by default, in the background (the next load of the process waits for it),
  or with ``--save-in-background no`` as ``install(save_in_background=False)`` makes it: the
  call returns once the checkpoint is published. A test that reads the checkpoint's files right
  after ``save_checkpoint`` returned (zero_to_fp32 in the same process) differs on purpose in the
  first way only (``INTENDED_BACKGROUND``). ``test_universal_checkpoint.py``'s fixture converts
  its checkpoint (``ds_to_universal``) on rank 0 right after ``save_checkpoint``, the other
  ranks waiting at a barrier: under background saves rank 0 fails and the others wait until the
  test's timeout, so that file is run with ``--save-in-background no``. Every
  collected test is listed; those ``-k`` or pytest.ini's ``-m`` deselect are counted below it.
  Exit status 1 when any test's outcome differs between the two runs (but for the differences
  zeroflat makes on purpose, ``INTENDED``, each listed with its reason), 2 when the run could
  not be made.

The fixes applied to the copy of DeepSpeed's test helpers (never to the source tree)
----------------------------------------------------------------------------------------
Each is a textual replacement checked to apply; one that does not (another release's helpers)
is reported and the run goes on without it.

1. ``tests/unit/common.py``, ``DistributedExec._launch_procs``: DeepSpeed skips a test whose
   world size exceeds ``get_accelerator().device_count()``; the CPU accelerator counts NUMA
   nodes (one here) unless LOCAL_SIZE is set, so every 2- and 4-rank test would be skipped
   ("not enough GPUs are available: 2 required, 1 available"). The gate is left out for the CPU
   accelerator, whose ranks are processes (as DeepSpeed's own CPU-only
   ``TestRealCheckpointUniversalConversionTPxPP`` does by overriding ``_launch_procs``).
2. ``tests/unit/common.py``, ``DistributedFixture``: the helpers declare a distributed fixture as
   a class carrying ``_pytestfixturefunction`` and run it from conftest's
   ``pytest_fixture_setup``; pytest 8.4 and later only register fixtures that are
   ``FixtureFunctionDefinition`` objects (DeepSpeed pins ``pytest<8.4``), so every test using one
   errors at setup with "fixture 'baseline_ws2' not found" (all of TestZeROUniversalCheckpointDP,
   ...). An ``__init_subclass__`` also registers each subclass, in its module, as a plain
   function-scoped ``pytest.fixture`` of the class's name that runs it the way the hook did
   (``cls()(request)``); with an older pytest it does nothing.
3. ``tests/unit/common.py``, ``DistributedExec._dist_run``: a rank whose test fails through
   pytest's ``Failed`` (``pytest.fail``, or ``pytest.raises(...)`` that saw nothing raised) raises
   a BaseException, which ``multiprocessing.Pool``'s worker does not catch: the worker process
   ends, the pool starts another in its place, the task's result never comes, and the test hangs
   in ``starmap_async(...).get`` until DeepSpeed's exec_timeout, whose ``pytest.exit`` ends the
   whole session. In the daemonic (pool) launch it is raised again as a RuntimeError naming it
   (the original chained), which the pool hands to pytest as the test's failure.
4. ``tests/unit/checkpoint/common.py``, ``compare_deepspeed_states``: compares the engines'
   ``sparse_tensor_module_names``, an attribute the installed DeepSpeed (0.19.8) no longer has
   (its sparse-gradient support was removed after 0.19.5, the newest tag whose tests were at
   hand), so every ``checkpoint_correctness_verification`` failed with AttributeError after the
   load, before any of its comparisons. The attribute is compared only where the engines have
   it (``getattr(..., None)`` on both sides).

What stays skipped or failing the same way both ways on a CPU with DeepSpeed 0.19.8 and the
v0.19.5 tests (the newest 0.19.x tag at hand): the bf16 variants of TestZeROUniversalCheckpointDP
skip (``bf16_required_version_check`` wants CUDA and NCCL); every fp16 variant errors or fails
with "Type fp16 is not supported on your device" (this CPU's oneDNN has no fp16); test_sparse.py
fails at ``deepspeed.initialize`` (0.19.8 removed the ``sparse_gradients`` option:
DeepSpeedConfigError); the tests that say "CPU accelerator does not support this test", lamb's
and the other ops' that need a built op skip.

A killed run goes on with ``--workdir DIR --resume`` (the tests that finished are kept, from the
events files); pytest's temporary folders are under the work folder (PYTEST_DEBUG_TEMPROOT), the
logs, each hang's dump (logs/hang-*.txt), results.json and summary.json too.

Past 700 lines on purpose: one file run against any DeepSpeed source tree, without the package
of this project on the path of the tests it runs."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
HELPERS = REPO / "scripts" / "deepspeed_tests"
MODES = ("plain", "dropin")


def die(message: str) -> None:
    """The run could not be made: exit status 2."""
    print(message, file=sys.stderr)
    sys.exit(2)


# --- the fixes to DeepSpeed's test helpers (see the docstring) -----------------------------------

_FIXTURE_REGISTRATION = '''
    def __init_subclass__(cls, **kwargs):
        # Added by zeroflat's scripts/deepspeed_checkpoint_tests.py: pytest >= 8.4 finds
        # fixtures only as FixtureFunctionDefinition objects, so each DistributedFixture subclass
        # is also registered as a plain fixture of its module, named after the class, that runs
        # it as conftest's pytest_fixture_setup hook did.
        super().__init_subclass__(**kwargs)
        import sys as _sys
        import _pytest.fixtures as _fixtures
        if not hasattr(_fixtures, "FixtureFunctionDefinition"):
            return  # an older pytest finds the class itself

        def _run_distributed_fixture(request):
            instance = cls()
            instance(request)
            return instance

        _run_distributed_fixture.__name__ = cls.__name__
        _run_distributed_fixture.__qualname__ = cls.__qualname__
        module = _sys.modules.get(cls.__module__)
        if module is not None:
            setattr(module, "_zeroflat_dist_fixture_" + cls.__name__,
                    pytest.fixture(name=cls.__name__)(_run_distributed_fixture))
'''

FIXES = [
    {
        "name": "cpu-device-count-gate",
        "file": "unit/common.py",
        "old": "if get_accelerator().is_available() and get_accelerator().device_count() < num_procs:",
        "new": ("if get_accelerator().is_available() and get_accelerator().device_name() != 'cpu' "
                "and get_accelerator().device_count() < num_procs:"),
    },
    {
        "name": "distributed-fixture-pytest-8.4",
        "file": "unit/common.py",
        "old": ('        _pytestfixturefunction = FixtureFunctionMarker(scope="function", params=None, '
                'name=self.__name__)\n'),
        "new": ('        _pytestfixturefunction = FixtureFunctionMarker(scope="function", params=None, '
                'name=self.__name__)\n' + _FIXTURE_REGISTRATION),
    },
    {
        "name": "rank-failure-not-a-hang",
        "file": "unit/common.py",
        "old": ("                else:\n"
                "                    skip_msg = e.msg\n"
                "            else:\n"
                "                raise e\n"),
        "new": ("                else:\n"
                "                    skip_msg = e.msg\n"
                "            elif not isinstance(e, Exception) and not self.non_daemonic_procs:\n"
                "                # zeroflat's runner: a pool worker dies of a BaseException (pytest's\n"
                "                # Failed) and its result never comes: raise one the pool passes on.\n"
                "                raise RuntimeError(f'{type(e).__module__}.{type(e).__name__}: {e}') from e\n"
                "            else:\n"
                "                raise e\n"),
    },
    {
        "name": "sparse-tensor-module-names",
        "file": "unit/checkpoint/common.py",
        "old": ("    assert saved_model.sparse_tensor_module_names == "
                "loaded_model.sparse_tensor_module_names\n"),
        "new": ("    assert getattr(saved_model, 'sparse_tensor_module_names', None) == "
                "getattr(loaded_model, 'sparse_tensor_module_names', None)\n"),
    },
]


def apply_fixes(tests: Path) -> List[str]:
    notes = []
    for fix in FIXES:
        path = tests / fix["file"]
        text = path.read_text() if path.exists() else None
        if text is None or text.count(fix["old"]) != 1:
            found = "missing" if text is None else f"{text.count(fix['old'])} matches"
            notes.append(f"fix {fix['name']} NOT applied ({fix['file']}: {found})")
            continue
        path.write_text(text.replace(fix["old"], fix["new"]))
        notes.append(f"fix {fix['name']} applied to {fix['file']}")
    return notes


# --- the source ----------------------------------------------------------------------------------

def _tests_dir(root: Path) -> Optional[Path]:
    for cand in (root / "tests", root):
        if (cand / "unit" / "checkpoint").is_dir() and (cand / "conftest.py").exists():
            return cand
    subdirs = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    if len(subdirs) == 1:  # an archive's one top folder
        return _tests_dir(subdirs[0])
    return None


def _extract(archive: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            z.extractall(dest)
    else:
        with tarfile.open(archive) as t:
            try:
                t.extractall(dest, filter="data")
            except TypeError:  # Python without extraction filters
                t.extractall(dest)
    return dest


def _installed_deepspeed(python: str) -> str:
    out = subprocess.run([python, "-c", "import importlib.metadata as m; "
                          "print(m.version('deepspeed'))"], capture_output=True, text=True)
    if out.returncode != 0:
        die(f"error: deepspeed is not installed for {python}: {out.stderr.strip()}")
    return out.stdout.strip()


def resolve_source(args, python: str) -> Path:
    cache = Path(args.cache).expanduser()
    if args.source:
        src = Path(args.source).expanduser().resolve()
        if src.is_file():
            src = _extract(src, cache / ("archive-" + src.name.split(".")[0]))
        found = _tests_dir(src) if src.is_dir() else None
        if found is None:
            die(f"error: {args.source} holds no DeepSpeed tests/ folder "
                     "(tests/conftest.py and tests/unit/checkpoint)")
        return found
    if args.git:
        dest = cache / f"git-{re.sub(r'[^A-Za-z0-9._-]', '_', args.ref)}"
        if _tests_dir(dest) is None:
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            archive = subprocess.run(["git", "-C", args.git, "archive", args.ref, "tests"],
                                     capture_output=True)
            if archive.returncode != 0:
                die(f"error: git archive {args.ref} tests: {archive.stderr.decode().strip()}")
            with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as t:
                t.extractall(dest)
        found = _tests_dir(dest)
        if found is None:
            die(f"error: {args.ref} of {args.git} has no tests/unit/checkpoint")
        return found
    version = args.deepspeed_version or _installed_deepspeed(python)
    dest = cache / f"sdist-{version}"
    found = _tests_dir(dest) if dest.is_dir() else None
    if found is not None:
        return found
    dl = cache / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    name = f"deepspeed-{version}.tar.gz"
    if not (dl / name).exists():
        print(f"downloading the sdist of deepspeed {version} from PyPI ...", flush=True)
        got = subprocess.run([python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                              f"deepspeed=={version}", "-d", str(dl)])
        if got.returncode != 0 or not (dl / name).exists():
            die(f"error: could not download {name}; pass --source")
    shutil.rmtree(dest, ignore_errors=True)
    _extract(dl / name, dest)
    found = _tests_dir(dest)
    if found is None:
        die(f"error: the PyPI sdist of deepspeed {version} has no tests/ folder (DeepSpeed's "
                 "sdists ship only the package and its sources); pass --source with a DeepSpeed "
                 f"checkout of tag v{version} (or the nearest), or --git REPO --ref TAG")
    return found


# --- processes -----------------------------------------------------------------------------------

def _proc_children() -> Dict[int, List[int]]:
    children = defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        children[int(fields[1])].append(int(entry))
    return children


def _pgid(pid: int) -> Optional[int]:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def session_pids(root: int) -> List[int]:
    """The pytest process, its descendants and every process of its process group."""
    children = _proc_children()
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo.extend(children.get(pid, []))
    for pids in children.values():
        for pid in pids:
            if _pgid(pid) == root:
                out.add(pid)
    return sorted(out)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def kill_session(proc: subprocess.Popen) -> None:
    pids = session_pids(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass


def find_py_spy(python: str) -> Optional[str]:
    beside = Path(python).parent / "py-spy"
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


def dump_hang(proc: subprocess.Popen, events: Path, py_spy: Optional[str], nodeid: str,
              calls: Dict[int, dict]) -> str:
    """Where every process of the session is: py-spy's dump and faulthandler's, per process."""
    pids = session_pids(proc.pid)
    parts = [f"timeout of {nodeid}: {len(pids)} processes"]
    fh_files = {pid: events / f"faulthandler-{pid}.txt" for pid in pids}
    sizes = {pid: (p.stat().st_size if p.exists() else None) for pid, p in fh_files.items()}
    for pid in pids:
        if sizes[pid] is not None:
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(3)
    for pid in pids:
        info = calls.get(pid)
        who = (f"rank {info.get('rank')} of {info.get('world')}, in "
               f"{info.get('call', 'load')}_checkpoint({info.get('dir')}) since "
               f"{time.time() - info['start']:.0f} s" if info else
               "in no load_checkpoint or save_checkpoint")
        parts.append(f"\n===== pid {pid} ({who}): {_cmdline(pid)[:300]}")
        if py_spy:
            for extra in (["--native"], []):
                try:
                    out = subprocess.run([py_spy, "dump", "--pid", str(pid)] + extra,
                                         capture_output=True, text=True, timeout=60)
                    text = (out.stdout + out.stderr).strip()
                except subprocess.TimeoutExpired:
                    text = "py-spy dump timed out"
                if out.returncode == 0 or not extra:
                    parts.append(f"--- py-spy dump{' --native' if extra else ''}:\n{text}")
                    break
        if sizes[pid] is not None:
            try:
                with open(fh_files[pid], errors="replace") as f:
                    f.seek(sizes[pid])
                    parts.append("--- faulthandler:\n" + f.read().strip())
            except OSError:
                pass
    return "\n".join(parts)


# --- one pytest session at a time ----------------------------------------------------------------

class Events:
    """pytest-events.jsonl of one mode, read as it grows."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.partial = b""

    def new(self):
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


def _entered_calls(events: Path) -> Dict[int, dict]:
    """pid -> the last load_checkpoint or save_checkpoint entry (pid, rank, world, start) not yet
    returned."""
    open_calls: Dict[int, dict] = {}
    for path in events.glob("calls-*.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "enter":
                open_calls[rec["pid"]] = rec
            elif rec.get("event") == "call":
                open_calls.pop(rec["pid"], None)
    return open_calls


def save_results(work: Path, results: dict) -> None:
    path = work / "results.json"
    path.with_suffix(".tmp").write_text(json.dumps(results, indent=1))
    os.replace(path.with_suffix(".tmp"), path)


def results_from_events(work: Path) -> dict:
    """Every test that finished, as the events files of both runs have it (what --resume keeps
    when results.json was not written after it: a runner that was killed)."""
    results: dict = {}
    for mode in MODES:
        path = work / mode / "pytest-events.jsonl"
        if not path.exists():
            continue
        recs: dict = {}
        for line in path.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev["event"] == "start":
                recs[ev["nodeid"]] = {"phases": [], "outcome": None, "start": ev["t"]}
            elif ev["event"] == "report" and ev["nodeid"] in recs:
                recs[ev["nodeid"]]["phases"].append(
                    {k: ev.get(k) for k in ("when", "outcome", "duration", "text", "wasxfail",
                                            "sections")})
            elif ev["event"] == "finish" and ev["nodeid"] in recs:
                rec = recs[ev["nodeid"]]
                rec["outcome"] = outcome_of(rec["phases"])
                rec["seconds"] = ev["t"] - rec["start"]
                results.setdefault(ev["nodeid"], {})[mode] = rec
    return results


def outcome_of(phases: List[dict]) -> str:
    by = {p["when"]: p for p in phases}
    for when, label in (("setup", "error"), ("call", "failed"), ("teardown", "error")):
        p = by.get(when)
        if p and p["outcome"] == "failed":
            return label if when != "teardown" else "error(teardown)"
    for when in ("setup", "call"):
        p = by.get(when)
        if p and p["outcome"] == "skipped":
            return "xfailed" if p.get("wasxfail") is not None else "skipped"
    call = by.get("call")
    if call and call["outcome"] == "passed":
        return "xpassed" if call.get("wasxfail") is not None else "passed"
    return "incomplete"


def run_batch(args, mode: str, nodeids: List[str], env: dict, work: Path, tests: Path,
              py_spy: Optional[str], results: dict) -> None:
    events_dir = work / mode
    events = Events(events_dir / "pytest-events.jsonl")
    log_path = work / "logs" / f"{mode}.log"
    remaining = list(nodeids)
    while remaining:
        cmd = [args.python, "-m", "pytest", "-p", "zf_ds_pytest_plugin", "-p", "no:cacheprovider",
               "-rA", *args.pytest_arg, *remaining]
        with open(log_path, "a") as log:
            log.write(f"\n\n##### {time.strftime('%H:%M:%S')} {mode}: {len(remaining)} tests\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        current, started, done_at, progressed = None, None, None, False
        finished = set()
        timed_out = None
        try:
            while True:
                for ev in events.new():
                    rec = results.setdefault(ev["nodeid"], {}).setdefault(
                        mode, {"phases": [], "outcome": None})
                    if ev["event"] == "start":
                        current, started, progressed = ev["nodeid"], time.time(), True
                        rec["phases"], rec["start"] = [], ev["t"]
                        print(f"  [{mode}] {ev['nodeid']} ...", end="", flush=True)
                    elif ev["event"] == "report":
                        rec["phases"].append({k: ev.get(k) for k in
                                              ("when", "outcome", "duration", "text", "wasxfail",
                                               "sections")})
                    elif ev["event"] == "finish":
                        rec["outcome"] = outcome_of(rec["phases"])
                        rec["seconds"] = ev["t"] - rec.get("start", ev["t"])
                        print(f" {rec['outcome']} ({rec['seconds']:.0f} s)", flush=True)
                        finished.add(ev["nodeid"])
                        current = None
                        save_results(work, results)
                if proc.poll() is not None:
                    break
                now = time.time()
                if current is not None and now - started > args.timeout:
                    timed_out = current
                    print(f" TIMEOUT after {args.timeout} s: dumping the processes", flush=True)
                    report = dump_hang(proc, events_dir, py_spy, current,
                                       _entered_calls(events_dir))
                    name = re.sub(r"[^A-Za-z0-9._-]+", "_", current)[-150:]
                    hang_file = work / "logs" / f"hang-{mode}-{name}.txt"
                    hang_file.write_text(report)
                    rec = results[current][mode]
                    rec.update(outcome="timeout", seconds=now - started, hang=str(hang_file))
                    finished.add(current)
                    kill_session(proc)
                    save_results(work, results)
                    break
                if current is None and set(remaining) <= finished:
                    done_at = done_at or now
                    if now - done_at > 180:  # every test reported; the session does not end
                        kill_session(proc)
                        break
                time.sleep(1)
        except BaseException:
            kill_session(proc)
            raise
        for ev in events.new():  # what the session wrote before it ended
            rec = results.setdefault(ev["nodeid"], {}).setdefault(
                mode, {"phases": [], "outcome": None})
            if ev["event"] == "report":
                rec["phases"].append({k: ev.get(k) for k in ("when", "outcome", "duration", "text",
                                                              "wasxfail", "sections")})
            elif ev["event"] == "finish":
                rec["outcome"] = outcome_of(rec["phases"])
                finished.add(ev["nodeid"])
                if ev["nodeid"] == current:
                    print(f" {rec['outcome']}", flush=True)
                    current = None
        rc = proc.wait()
        if current is not None and current != timed_out:
            rec = results[current][mode]
            rec["outcome"] = f"crashed(rc={rc})"
            rec["seconds"] = time.time() - started
            tail = log_path.read_text(errors="replace")[-4000:]
            rec["phases"].append({"when": "session", "outcome": "failed", "text": tail})
            finished.add(current)
            print(f" session ended during the test (rc={rc})", flush=True)
        remaining = [n for n in remaining if n not in finished]
        if remaining and not progressed:
            for n in remaining:
                results.setdefault(n, {})[mode] = {
                    "phases": [], "outcome": f"not-run(rc={rc})", "seconds": 0}
            print(f"  [{mode}] pytest ended (rc={rc}) without running {len(remaining)} tests; "
                  f"see {log_path}", flush=True)
            remaining = []


# --- load_checkpoint and save_checkpoint calls ----------------------------------------------------

def _calls(work: Path, mode: str, results: dict, call: str):
    """The ``call`` ("load", "save") calls of one run, each once (rank 0's record), of each
    test's last attempt (a test run again after its runner was killed also has calls of the
    first)."""
    for path in (work / mode).glob("calls-*.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") != "call" or rec.get("rank") not in (0, None) \
                    or rec.get("call", "load") != call:
                continue
            began = (results.get(rec.get("test"), {}).get(mode) or {}).get("start")
            if began is not None and rec.get("start", began) < began - 1:
                continue
            yield rec


CALLS = ("load", "save")


def call_counts(work: Path, results: dict, call: str) -> Dict[str, Dict[str, Counter]]:
    """test -> mode -> Counter of the outcomes of ``call`` (each call once: rank 0's record)."""
    out: Dict[str, Dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for mode in MODES:
        for rec in _calls(work, mode, results, call):
            out[rec.get("test") or "?"][mode][rec["outcome"]] += 1
    return out


def call_reasons(work: Path, results: dict) -> Dict[str, List[str]]:
    """test -> the drop-in's hand-back reasons and raised errors (rank 0's), loads and saves."""
    out: Dict[str, List[str]] = defaultdict(list)
    for call in CALLS:
        for rec in _calls(work, "dropin", results, call):
            if rec["outcome"] == "handed_back":
                out[rec.get("test") or "?"].append(
                    f"{call}_checkpoint handed back: {rec.get('reason')}")
            elif rec["outcome"] == "raised":
                out[rec.get("test") or "?"].append(f"{call}_checkpoint raised: {rec.get('error')}")
    return out


# --- main ----------------------------------------------------------------------------------------

def _short(nodeid: str) -> str:
    return nodeid[len("unit/checkpoint/"):] if nodeid.startswith("unit/checkpoint/") else nodeid


def _batch_key(nodeid: str, how: str) -> str:
    if how == "test":
        return nodeid
    parts = nodeid.split("::")
    if how == "class":
        return "::".join(parts[:2]) if len(parts) > 2 else parts[0]
    return parts[0]


def _tail(text: Optional[str], lines: int) -> str:
    if not text:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _excerpt(text: Optional[str], lines: int) -> str:
    """A failure's text, short: the ranks' own traceback (the pool's RemoteTraceback block) where
    there is one, its last ``lines`` lines, then the last lines of pytest's report."""
    if not text:
        return ""
    all_lines = text.rstrip().splitlines()
    start = next((i for i, line in enumerate(all_lines) if "RemoteTraceback" in line), None)
    if start is None:
        return "\n".join(all_lines[-lines:])
    end = next((i for i in range(start + 2, len(all_lines)) if all_lines[i].strip() == '"""'),
               len(all_lines) - 1)
    block = all_lines[start:end + 1]
    if len(block) > lines:
        block = [all_lines[start], "    ..."] + block[-lines:]
    return "\n".join(block + ["    ..."] + all_lines[-6:])


# Differences zeroflat makes on purpose: (test id prefix, text the drop-in's failure must hold,
# why). A test counts as one only where both match; any other difference fails the run.
INTENDED = [
    ("unit/checkpoint/test_zero_optimizer.py::TestZeROElasticCheckpoint::"
     "test_elastic_checkpoint_change_dp[True-False-",
     "DID NOT RAISE",
     "a ZeRO-2 checkpoint saved at 4 ranks, its optimizer states loaded at 2 by an engine "
     "without elastic_checkpoint: DeepSpeed refuses (ZeRORuntimeException, its partitioning "
     "cannot follow a new world size); zeroflat resumes it, each rank reading its new "
     "partition, equal to DeepSpeed's universal path (python/tests/test_resume.py)"),
]


# The same, for the drop-in's default save (--save-in-background yes): tests that read the files
# of a checkpoint right after save_checkpoint returned, in the process that saved it.
_WRITTEN_LATER = (
    "the test reads the checkpoint's files right after save_checkpoint returned, in the process "
    "that saved it, without zeroflat.deepspeed.wait(): the drop-in's save returns once the state "
    "is snapshotted and publishes the tag once it is written (docs/python.md, 'Saving a "
    "DeepSpeed checkpoint'); with --save-in-background no the drop-in's outcome is plain's")
INTENDED_BACKGROUND = [
    ("unit/checkpoint/test_convert_checkpoint.py::TestCheckpointConvert::"
     "test_convert_zero_checkpoint_to_fp32_state_dict", "Unable to find 'latest' file",
     "zero_to_fp32's convert_zero_checkpoint_to_fp32_state_dict: " + _WRITTEN_LATER),
    ("unit/checkpoint/test_shared_weights.py::TestCheckpointSharedWeights::"
     "test_checkpoint_shared_weights", "doesn't exist",
     "zero_to_fp32's get_fp32_state_dict_from_zero_checkpoint: " + _WRITTEN_LATER),
    ("unit/checkpoint/test_autotp_uc_checkpoint.py::TestRealCheckpointUniversalConversionTPxPP::"
     "test", "mp_rank files, got 0", "a listing of the tag's files: " + _WRITTEN_LATER),
    ("unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpointFrozenWeights::"
     "test_save_exclude_frozen_weights[", "model_states.pt'",
     "torch.load of the tag's model file: " + _WRITTEN_LATER),
    ("unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpointFrozenWeights::"
     "test_save_exclude_custom_frozen_weights[", "model_states.pt'",
     "torch.load of the tag's model file: " + _WRITTEN_LATER),
]


def intended(nodeid: str, rec: dict, background: bool = True) -> str:
    """Why the drop-in's outcome of this test differs on purpose, or ""."""
    text = "\n".join(p.get("text") or "" for p in rec.get("phases", []))
    for prefix, holds, why in INTENDED + (INTENDED_BACKGROUND if background else []):
        if nodeid.startswith(prefix) and holds in text:
            return why
    return ""


def print_report(args, work: Path, order: List[str], deselected: List[str], results: dict,
                 notes: List[str]) -> int:
    counts = {call: call_counts(work, results, call) for call in CALLS}
    reasons = call_reasons(work, results)
    rows, differ, meant = [], [], []
    totals = {call: Counter() for call in CALLS}
    for nodeid in order:
        res = results.get(nodeid, {})
        plain = (res.get("plain") or {}).get("outcome") or "-"
        dropin = (res.get("dropin") or {}).get("outcome") or "-"
        cells = []
        for call in CALLS:
            c = counts[call].get(nodeid, {})
            pc, dc = c.get("plain", Counter()), c.get("dropin", Counter())
            cell = f"{sum(pc.values())}: {dc['served']}/{dc['handed_back']}"
            if dc["raised"]:
                cell += f" +{dc['raised']} raised"
            if dc["returned"]:
                cell += f" +{dc['returned']} returned"
            cells.append(cell)
            totals[call].update(dc)
            totals[call]["plain_calls"] += sum(pc.values())
        ran_both = "plain" in args.modes and "dropin" in args.modes
        mark = "DIFF" if ran_both and plain != dropin else ""
        background = (res.get("dropin") or {}).get("save_in_background", True)
        if mark and intended(nodeid, res.get("dropin") or {}, background):
            mark = "intended"
            meant.append(nodeid)
        elif mark:
            differ.append(nodeid)
        rows.append((_short(nodeid), plain, dropin, *cells, mark))
    # "loads"/"saves": the calls in the plain run: those the drop-in served / handed back.
    header = ("test", "plain", "drop-in", "loads: served/back", "saves: served/back", "")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    widths[0] = min(widths[0], 110)
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    per_mode = {m: Counter((results.get(n, {}).get(m) or {}).get("outcome") or "-" for n in order)
                for m in MODES}
    print()
    print(f"{len(order)} tests (ids relative to tests/unit/checkpoint/ where they lie there); "
          f"{len(deselected)} more deselected (-k, or tests/pytest.ini's -m addopts)")
    for m in MODES:
        print(f"  {m}: " + ", ".join(f"{v} {k}" for k, v in sorted(per_mode[m].items())))
    ways = Counter("in the background" if (results.get(n, {}).get("dropin") or {}).get(
        "save_in_background", True) else "waited for (--save-in-background no)"
        for n in order if (results.get(n, {}).get("dropin") or {}).get("outcome"))
    if ways:
        print("  the drop-in's saves: " + ", ".join(f"{v} tests {k}" for k, v in ways.items()))
    for call in CALLS:
        t = totals[call]
        print(f"  {call}_checkpoint calls: plain {t['plain_calls']}; drop-in: {t['served']} "
              f"served by zeroflat, {t['handed_back']} handed back to DeepSpeed, "
              f"{t['raised']} raised, {t['returned']} returned without either")
    for n in notes:
        print(f"  {n}")
    if meant:
        print(f"\n{len(meant)} tests differ on purpose (not counted as differing):")
        for nodeid in meant:
            rec = results[nodeid].get("dropin") or {}
            why = intended(nodeid, rec, rec.get("save_in_background", True))
            print(f"  {_short(nodeid)}: {why}")
    if differ:
        print(f"\n{len(differ)} tests differ:")
        for nodeid in differ:
            res = results.get(nodeid, {})
            print(f"\n=== {nodeid}")
            for m in MODES:
                rec = res.get(m) or {}
                print(f"--- {m}: {rec.get('outcome')} ({rec.get('seconds', 0):.0f} s)")
                for p in rec.get("phases", []):
                    if p["outcome"] == "failed":
                        print(f"[{p['when']}]\n{_excerpt(p.get('text'), args.tail)}")
                if rec.get("hang"):
                    print(f"(where each process was: {rec['hang']})")
            for why in reasons.get(nodeid, []):
                print(f"drop-in {why}")
    return 1 if differ else 0


def main() -> int:
    default_python = REPO / ".venv" / "bin" / "python"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="*", help="test ids or paths relative to tests/ "
                    "(default: unit/checkpoint)")
    ap.add_argument("--source", help="a DeepSpeed source tree (or .tar.gz/.zip of one) holding "
                    "tests/")
    ap.add_argument("--git", help="a DeepSpeed git repository to take tests/ from (with --ref)")
    ap.add_argument("--ref", default=None, help="the tag or commit for --git")
    ap.add_argument("--deepspeed-version", help="the sdist to fetch without --source (default: "
                    "the installed release)")
    ap.add_argument("--cache", default="~/.cache/zeroflat/deepspeed-tests",
                    help="where fetched sources are kept")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--pytest-arg", action="append", default=[],
                    help="one more pytest argument, for collection and runs (repeatable)")
    ap.add_argument("--python", default=str(default_python if default_python.exists()
                                             else sys.executable))
    ap.add_argument("--zeroflat", default=str(REPO / "build" / "python"),
                    help="the folder holding the built zeroflat package")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per test (default 600)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    ap.add_argument("--batch", choices=("file", "class", "test"), default="file",
                    help="tests run plainly then with the drop-in, this many at a time")
    ap.add_argument("--modes", default="plain,dropin")
    ap.add_argument("--workdir", help="the work folder (default: a new temporary one, kept)")
    ap.add_argument("--resume", action="store_true",
                    help="reuse --workdir's results: run only tests without an outcome")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--tail", type=int, default=40,
                    help="lines of each differing failure to print")
    ap.add_argument("--list", action="store_true", help="only list the collected tests")
    ap.add_argument("--save-in-background", choices=("yes", "no"), default="yes",
                    help="the drop-in's save_checkpoint returns once snapshotted (yes, its "
                    "default) or once published (no: install(save_in_background=False))")
    args = ap.parse_args()
    args.background = args.save_in_background == "yes"
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(args.modes) <= set(MODES) or not args.modes:
        ap.error(f"--modes: some of {','.join(MODES)}")
    if args.git and not args.ref:
        ap.error("--git needs --ref")

    tests_src = resolve_source(args, args.python)
    work = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(
        prefix="zeroflat-ds-checkpoint-"))
    results_path = work / "results.json"
    results: dict = {}
    if args.resume:
        results = results_from_events(work)
        if results_path.exists():  # timeouts and crashes are only there
            for nodeid, modes in json.loads(results_path.read_text()).items():
                for mode, rec in modes.items():
                    if (rec or {}).get("outcome"):
                        results.setdefault(nodeid, {})[mode] = rec
    elif work.exists() and any(work.iterdir()) and args.workdir:
        if not args.resume:
            die(f"error: {work} is not empty (pass --resume to go on with it)")
    for sub in ("logs", "collect", *MODES):
        (work / sub).mkdir(parents=True, exist_ok=True)
    tests = work / "src" / "tests"
    if not tests.exists():
        shutil.copytree(tests_src, tests, ignore=shutil.ignore_patterns("__pycache__"))
        notes = apply_fixes(tests)
        (work / "fixes.txt").write_text("\n".join(notes) + "\n")
    notes = (work / "fixes.txt").read_text().splitlines()
    zf = work / "zeroflat"
    if not zf.exists():
        if not (Path(args.zeroflat) / "zeroflat" / "__init__.py").exists():
            die(f"error: no zeroflat package in {args.zeroflat} (build it, or --zeroflat)")
        shutil.copytree(Path(args.zeroflat) / "zeroflat", zf / "zeroflat",
                        ignore=shutil.ignore_patterns("__pycache__"))
    print(f"DeepSpeed tests: {tests_src} (copied to {tests})")
    print(f"work folder: {work}")
    for n in notes:
        print(f"  {n}")

    base_env = dict(os.environ)
    for var in ("ZF_DS_MODE", "ZF_DS_EVENTS", "ZF_DS_COLLECT", "ZF_DS_SAVE_BACKGROUND",
                "PYTEST_ADDOPTS"):
        base_env.pop(var, None)
    base_env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(args.threads),
                    MKL_NUM_THREADS=str(args.threads), PYTHONDONTWRITEBYTECODE="1",
                    DS_UNITTEST_TIMEOUT=str(int(args.timeout) + 600), PYTHONUNBUFFERED="1")
    # pytest's temporary folders of this run, apart from any other pytest on the machine.
    (work / "tmp").mkdir(exist_ok=True)
    base_env["PYTEST_DEBUG_TEMPROOT"] = str(work / "tmp")
    old_pp = base_env.get("PYTHONPATH")

    def env_for(mode: Optional[str], events: Path) -> dict:
        env = dict(base_env)
        path = [str(HELPERS)] + ([str(zf)] if mode == "dropin" else [])
        env["PYTHONPATH"] = os.pathsep.join(path + ([old_pp] if old_pp else []))
        env["ZF_DS_EVENTS"] = str(events)
        if mode:
            env["ZF_DS_MODE"] = mode
        env["ZF_DS_SAVE_BACKGROUND"] = "1" if args.background else "0"
        return env

    # Collection, once.
    selection = [t[len("tests/"):] if t.startswith("tests/") else t for t in args.tests] \
        or ["unit/checkpoint"]
    collect_file = work / "collect" / "collected.json"
    cmd = [args.python, "-m", "pytest", "--collect-only", "-q", "-p", "zf_ds_pytest_plugin",
           "-p", "no:cacheprovider", *args.pytest_arg]
    if args.keyword:
        cmd += ["-k", args.keyword]
    env = env_for(None, work / "collect")
    env["ZF_DS_COLLECT"] = str(collect_file)
    collect_file.unlink(missing_ok=True)
    got = subprocess.run(cmd + selection, cwd=tests, env=env, capture_output=True, text=True,
                         timeout=900)
    (work / "logs" / "collect.log").write_text(got.stdout + got.stderr)
    if not collect_file.exists():
        print(_tail(got.stdout + got.stderr, 40))
        die(f"error: collection failed (rc={got.returncode})")
    collected = json.loads(collect_file.read_text())
    order, deselected = collected["selected"], collected["deselected"]
    if got.returncode not in (0, 5):
        print(_tail(got.stdout + got.stderr, 40))
        print(f"warning: collection exited {got.returncode} (errors above)")
    print(f"{len(order)} tests collected, {len(deselected)} deselected")
    if args.list:
        for n in order:
            print(n)
        return 0
    if not order:
        return 0

    py_spy = find_py_spy(args.python)
    if py_spy is None:
        print("py-spy not found (pip install py-spy): a hang is shown by faulthandler only")
    batches: Dict[str, List[str]] = {}
    for n in order:
        batches.setdefault(_batch_key(n, args.batch), []).append(n)
    start = time.time()
    try:
        for key, ids in batches.items():
            for mode in args.modes:
                todo = [n for n in ids if not (results.get(n, {}).get(mode) or {}).get("outcome")]
                if not todo:
                    continue
                print(f"[{time.strftime('%H:%M:%S')}] {mode}: {key} ({len(todo)} tests)",
                      flush=True)
                run_batch(args, mode, todo, env_for(mode, work / mode), work, tests, py_spy,
                          results)
                if mode == "dropin":  # how its saves ran, kept with each result (--resume)
                    for n in todo:
                        if (results.get(n, {}).get(mode) or {}).get("outcome"):
                            results[n][mode]["save_in_background"] = args.background
                save_results(work, results)
                for path in (work / mode).glob("faulthandler-*.txt"):
                    if path.stat().st_size == 0:  # nothing was dumped from that process
                        path.unlink(missing_ok=True)
                errors = sorted((work / mode).glob("install-error-*.txt"))
                if errors:
                    print(errors[0].read_text())
                    die(f"error: the instrumentation or zeroflat.deepspeed.install() failed "
                             f"in {len(errors)} processes ({work / mode})")
    finally:
        save_results(work, results)
    print(f"\nran for {(time.time() - start) / 60:.1f} min")
    rc = print_report(args, work, order, deselected, results, notes)
    summary = {"source": str(tests_src), "work": str(work), "fixes": notes, "order": order,
               "deselected": deselected, "results": results,
               **{f"{call}s": {k: {m: dict(c) for m, c in v.items()}
                               for k, v in call_counts(work, results, call).items()}
                  for call in CALLS}}
    (work / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
