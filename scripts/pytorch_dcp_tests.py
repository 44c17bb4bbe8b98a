#!/usr/bin/env python3
"""Runs PyTorch's own distributed-checkpoint tests (``test/distributed/checkpoint``) twice,
plainly and with ``zeroflat.dcp.install(writer=True)`` in every process, and compares the
outcomes test id by test id.

    .venv/bin/python scripts/pytorch_dcp_tests.py --tests DIR [TEST_ID_OR_FILE ...] [-k EXPR]
        [--modes plain,swapped] [--timeout 900] [--batch file|all] [--json OUT] [--workdir DIR]

``--tests DIR``: a folder holding PyTorch's ``test/distributed/checkpoint`` test files, a
checkout's folder or a copy. Take it from the release of the installed torch (a checkout of the
pytorch repository at the tag ``v<torch version>``): newer tests may call APIs the installed
torch lacks. Its files are copied into the work folder and run there, so nothing else of the
source tree (its ``torch/``, its ``conftest.py`` and ``pytest.ini``) is imported or read.

TEST_ID_OR_FILE: files or pytest node ids relative to DIR (``test_hf_storage.py``,
``test_planner.py::TestPlannerHelpers::test_create_read_item_from_chunks``; a leading
``test/distributed/checkpoint/`` is accepted); default: every ``test_*.py`` in DIR and its
subfolders. ``-k`` and ``--pytest-arg`` are passed to every pytest run.

The two modes
-------------
- ``plain``: PyTorch's DCP readers and writers as shipped.
- ``swapped``: ``zeroflat.dcp.install(writer=True)`` in every Python process of the run: DCP's
  ``FileSystemReader`` (in ``torch.distributed.checkpoint``, ``.filesystem``,
  ``._storage_utils``, ``.format_utils``) and ``HuggingFaceStorageReader`` are zeroflat's
  subclasses, which read through ``zeroflat.dcp.Reader`` ("served") or hand a checkpoint they do
  not serve (one saved through DCP's stream transforms) back to DCP's own reader ("handed
  back"); ``FileSystemWriter`` (the same modules) is zeroflat's subclass, which writes through
  ``zeroflat.dcp.Writer`` or hands a save it does not serve (several files per rank, stream
  transforms, safetensors, ``overwrite=False``, no collectives) back to DCP's own writer. The
  tests construct the readers and writers themselves, so each of their loads and saves is
  zeroflat's or counted as handed back.

Both modes run the same interpreter (``--python``, default the venv's) with the same
PYTHONPATH: first a generated folder holding a ``sitecustomize.py``, then a snapshot of the
zeroflat package (``--zeroflat``, default build/python, copied at start so that a rebuild during
the run changes nothing), then, where ``expecttest`` (which torch.testing._internal imports) is
not importable, a folder into which the script installed it with ``pip install --target`` (the
venv is left as it is; no other package is installed). The ``sitecustomize.py`` runs at the
start of every Python process, pytest's and every rank's that torch's MultiProcessTestCase
spawns (its start method is spawn: an import in pytest's process alone would not reach them).
It does nothing unless ZEROFLAT_DCP_SWAP=1, which only the swapped mode sets; then it calls
``zeroflat.dcp.install(writer=True)`` and writes, into the folder ZEROFLAT_DCP_STATS names, one
small JSON file per process: whether install() ran (or its error), and ``zeroflat.dcp.stats``'
served and handed-back counts of loads and of saves with the reasons, by test (pytest's
PYTEST_CURRENT_TEST, which spawned ranks inherit), rewritten after each load and save and at
exit. Any sitecustomize it shadows (Debian's) runs
after it.

How it runs
-----------
One pytest per batch and mode (``--batch file``, the default: each test file, plainly then
swapped; ``--batch all``: one pytest per mode for everything), each a fresh process group with
``-p no:cacheprovider``, ``-v -rA`` (its log: ``WORK/logs``) and a junit XML report (xunit1, which
names each test's file) from which each test id's outcome comes: passed, failed, error, skipped
(xfailed, xpassed). A batch still running after ``--timeout`` seconds is killed; its tests that
the log shows finished keep their outcome, the one then running is ``timeout``; the batch's
tests that never started are missing from the table (a test id seen in one mode only shows
``-`` in the other, a difference).
OMP_NUM_THREADS is ``--threads`` (default 1); pytest's temporary folders are under WORK/tmp.

The report
----------
A table, one row per test id: the outcome in each mode, the loads and the saves zeroflat served /
handed back during that test in the swapped run (each counts once per rank), and a mark:
``DIFF`` where the outcomes differ, ``known`` where the difference is one of KNOWN_DIFFERENCES
(in this file: differences zeroflat makes on purpose, each with its reason). Then the counts
per mode, the swapped run's totals (processes, in how many install() ran, loads and saves
served and handed back, why each was handed back), and every difference with the key line of each failure
(the innermost exception's line: a rank's own error, not MultiProcessTestCase's "Process 0
exited with error code 10").

A swapped run in which zeroflat served no load, or no save, proves nothing about zeroflat's reader
or writer: it is said in so many words and counts as a failure.

Exit status: 0 when every test id has the same outcome in both modes (or differs as
KNOWN_DIFFERENCES says) and the swapped run served at least one load and one save with install()
in place in every process; 1 when a difference is not in KNOWN_DIFFERENCES, install() failed in
some process, or the swapped run served no load or no save; 2 when the run could not be made (bad arguments, a
--tests folder without test files, expecttest not installable, no zeroflat package). With one
mode only, the outcomes are listed and the status says whether that run could be made (and, for
``swapped`` alone, whether it served anything).

The work folder (``--workdir``, default a new temporary folder, kept): ``tests/`` (the copy
run), ``site/``, ``zeroflat/``, ``deps/``, ``logs/``, ``junit/``, ``stats/<mode>/<batch>/`` and
``summary.json`` (what ``--json`` writes too).

Past 700 lines on purpose: one file, run against any copy of PyTorch's tests, holding the
sitecustomize it generates for every process of the runs."""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
MODES = ("plain", "swapped")
SWAP_VAR = "ZEROFLAT_DCP_SWAP"      # "1": the sitecustomize installs zeroflat's readers
STATS_VAR = "ZEROFLAT_DCP_STATS"    # the folder each swapped process writes its record into
PREFIX = "test/distributed/checkpoint/"

# Differences zeroflat makes on purpose: fnmatch pattern of a test id -> why. A differing test
# id that no pattern matches makes the exit status 1. Only differences observed and explained by
# zeroflat's documented behaviour (docs/python.md, "zeroflat.dcp.Reader") belong here. Empty:
# the one difference seen on 2026-12-06 (torch 2.15) is not one zeroflat makes on purpose
# (docs/pytorch-dcp-tests.md).
KNOWN_DIFFERENCES: Dict[str, str] = {
}


def die(message: str) -> None:
    """The run could not be made: exit status 2."""
    print(message, file=sys.stderr)
    sys.exit(2)


# --- the sitecustomize every process of the run starts with -------------------------------------

SITECUSTOMIZE = r'''"""Generated by zeroflat's scripts/pytorch_dcp_tests.py: first on
PYTHONPATH of every process of its runs. With ZEROFLAT_DCP_SWAP=1 it calls
zeroflat.dcp.install(writer=True) and records, in the folder ZEROFLAT_DCP_STATS names, whether
install() ran and what the installed readers and writer did (served / handed back, by test).
Otherwise it does nothing. The sitecustomize it shadows, if any, runs after it."""

import os


def _chain_next_sitecustomize():
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


def _swap():
    import atexit
    import json
    import sys
    import time
    import traceback

    out = os.environ.get("ZEROFLAT_DCP_STATS")
    rec = {"pid": os.getpid(), "argv": list(getattr(sys, "orig_argv", sys.argv))[:4],
           "install_ran": False, "error": None, "served": 0, "handed_back": 0,
           "handed_back_reasons": [], "saves_served": 0, "saves_handed_back": 0,
           "saves_handed_back_reasons": [], "by_test": {}}
    keys = ("served", "handed_back", "saves_served", "saves_handed_back")
    state = {"path": None, "base": {}, "stats": None}

    def new_path():
        if out:
            state["path"] = os.path.join(out, f"proc-{os.getpid()}-{time.time_ns()}.json")

    def write():
        if not state["path"]:
            return
        stats = state["stats"]
        if stats is not None:
            base = state["base"]
            for key in keys + ("handed_back_reasons", "saves_handed_back_reasons"):
                if key in stats:
                    value = stats[key]
                    rec[key] = value[len(base.get(key, ())):] if isinstance(value, list) \
                        else value - base.get(key, 0)
        try:
            with open(state["path"] + ".tmp", "w") as f:
                json.dump(rec, f, default=str)
            os.replace(state["path"] + ".tmp", state["path"])
        except Exception:  # noqa: BLE001 - the record must not break the process
            pass

    def note(key):
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or "(no test)"
        counts = rec["by_test"].setdefault(test, {k: 0 for k in keys})
        counts[key] += 1
        write()

    new_path()
    try:
        import zeroflat.dcp as zdcp
        zdcp.install(writer=True)
        rec["install_ran"] = bool(zdcp.is_installed())
        state["stats"] = zdcp.stats
    except BaseException as e:  # noqa: BLE001 - recorded; the runner reports it
        rec["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        write()
        print(f"zeroflat DCP test runner: zeroflat.dcp.install() failed: {e!r}", file=sys.stderr)
        return

    # Count each load by test as it happens: the installed readers' _serve / _hand_back; each
    # save: the installed writer's set_up_storage_writer, which decides.
    try:
        import torch.distributed.checkpoint as dcp
        cls = dcp.FileSystemWriter
        inner = cls.__dict__.get("set_up_storage_writer")
        if cls.__module__ == "zeroflat.dcp" and inner is not None \
                and not getattr(inner, "__zf_dcp_tests__", False):

            def set_up(self, *args, _inner=inner, **kwargs):
                result = _inner(self, *args, **kwargs)
                note("saves_served" if self._served else "saves_handed_back")
                return result

            set_up.__zf_dcp_tests__ = True
            cls.set_up_storage_writer = set_up
    except Exception:  # noqa: BLE001 - totals still come from zeroflat.dcp.stats at exit
        pass
    try:
        import torch.distributed.checkpoint as dcp
        classes = [dcp.FileSystemReader]
        try:
            from torch.distributed.checkpoint import hf_storage
            classes.append(hf_storage.HuggingFaceStorageReader)
        except ImportError:
            pass
        for cls in classes:
            if cls.__module__ != "zeroflat.dcp":
                continue
            for name, key in (("_serve", "served"), ("_hand_back", "handed_back")):
                inner = cls.__dict__.get(name)
                if inner is None or getattr(inner, "__zf_dcp_tests__", False):
                    continue

                def wrapper(self, *args, _inner=inner, _key=key, **kwargs):
                    result = _inner(self, *args, **kwargs)
                    note(_key)
                    return result

                wrapper.__zf_dcp_tests__ = True
                setattr(cls, name, wrapper)
    except Exception:  # noqa: BLE001 - totals still come from zeroflat.dcp.stats at exit
        pass

    def after_fork_in_child():
        # A forked child inherits the parent's counts: it records only its own.
        stats = state["stats"]
        state["base"] = {k: (list(v) if isinstance(v, list) else v) for k, v in stats.items()}
        rec["pid"] = os.getpid()
        rec["by_test"] = {}
        new_path()
        write()

    os.register_at_fork(after_in_child=after_fork_in_child)
    atexit.register(write)
    write()


if os.environ.get("ZEROFLAT_DCP_SWAP") == "1":
    _swap()
_chain_next_sitecustomize()
'''


# --- selection ---------------------------------------------------------------------------------

def find_test_files(root: Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                  if "__pycache__" not in p.parts
                  and (p.name.startswith("test_") or p.name.endswith("_test.py")))


def parse_selection(root: Path, items: List[str], files: List[str]) -> Dict[str, List[str]]:
    """{test file: [node ids or the file]} for the run, in the order given."""
    if not items:
        return {f: [f] for f in files}
    out: Dict[str, List[str]] = {}
    for item in items:
        p = Path(item.split("::", 1)[0])
        if p.is_absolute():
            try:
                rel = str(p.resolve().relative_to(root))
            except ValueError:
                die(f"error: {item}: not inside --tests {root}")
        else:
            rel = str(p)
            if rel.startswith(PREFIX):
                rel = rel[len(PREFIX):]
        if not (root / rel).is_file():
            die(f"error: {item}: no such test file in {root}")
        rest = item.split("::", 1)[1:] if "::" in item else []
        nodeid = "::".join([rel] + rest)
        out.setdefault(rel, [])
        if nodeid not in out[rel]:
            out[rel].append(nodeid)
    return out


# --- a batch -------------------------------------------------------------------------------------

_VERBOSE = re.compile(r"^(\S+::\S+?)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_STARTED = re.compile(r"^(\S+::\S+)\s*$")
_KEY = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Failure|Exit|Interrupt|Warning)"
                  r"|Failed|AssertionError|SkipTest)\b(?::.*)?$")


def key_line(text: str) -> str:
    """The innermost exception's line of a failure's text: the last line naming an exception,
    leaving out MultiProcessTestCase's own wrapper of a rank's error."""
    found = ""
    for raw in (text or "").splitlines():
        line = raw.strip()
        if line.startswith("E "):
            line = line[1:].strip()
        if not _KEY.match(line):
            continue
        if re.match(r"RuntimeError: Process \d+ (exited|terminated|timed out)", line):
            continue
        if line.startswith("Exception: Caught exception"):
            continue
        found = line
    # A message repr()'d into the line (torch's "To execute this test, run ..." appended).
    return found.split("\\n", 1)[0][:300]


def parse_junit(path: Path) -> Dict[str, dict]:
    """{test id: {outcome, message, key, seconds}} from pytest's junit XML (xunit1)."""
    out: Dict[str, dict] = {}
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        name = case.get("name", "")
        classname = case.get("classname", "")
        file = case.get("file")
        if file and not classname:  # a collection error: the file's own id
            nodeid = file
        elif file:
            module = file[:-3].replace("/", ".").replace("\\", ".") if file.endswith(".py") \
                else file
            cls = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
            nodeid = "::".join([file] + ([cls] if cls else []) + [name])
        else:  # a collection error: the name is the module's dotted path
            nodeid = name.replace(".", "/") + ".py" if name else classname
        outcome, message, text = "passed", "", ""
        tags = {child.tag: child for child in case}
        if "failure" in tags:
            outcome, el = "failed", tags["failure"]
        elif "error" in tags:
            outcome, el = "error", tags["error"]
        elif "skipped" in tags:
            el = tags["skipped"]
            outcome = "xfailed" if el.get("type") == "pytest.xfail" else "skipped"
        else:
            el = None
        if el is not None:
            message = el.get("message", "") or ""
            text = el.text or ""
        rec = {"outcome": outcome, "message": message.strip().splitlines()[0][:300]
               if message.strip() else "", "seconds": float(case.get("time") or 0)}
        if outcome in ("failed", "error"):
            rec["key"] = key_line(text) or key_line(message) or rec["message"]
        prev = out.get(nodeid)
        if prev is None or prev["outcome"] == "passed":
            out[nodeid] = rec
    return out


def parse_verbose_log(text: str) -> Tuple[Dict[str, dict], Optional[str]]:
    """Outcomes from pytest -v's log of a killed run, and the test then running."""
    out, running = {}, None
    for line in text.splitlines():
        m = _VERBOSE.match(line)
        if m:
            outcome = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error",
                       "SKIPPED": "skipped", "XFAIL": "xfailed", "XPASS": "xpassed"}[m.group(2)]
            out.setdefault(m.group(1), {"outcome": outcome, "message": "", "seconds": 0.0})
            running = None
            continue
        m = _STARTED.match(line)
        if m and m.group(1) not in out:
            running = m.group(1)
    return out, running


def run_batch(args, mode: str, name: str, ids: List[str], env: dict, work: Path) -> dict:
    """One pytest for ``ids`` in ``mode``: {"results": {...}, "rc", "seconds", "note"}."""
    slug = re.sub(r"[^\w.-]+", "_", name)
    junit = work / "junit" / f"{mode}-{slug}.xml"
    log = work / "logs" / f"{mode}-{slug}.log"
    stats = work / "stats" / mode / slug
    stats.mkdir(parents=True, exist_ok=True)
    env = dict(env)
    if mode == "swapped":
        env[SWAP_VAR] = "1"
        env[STATS_VAR] = str(stats)
    cmd = [args.python, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA",
           f"--junitxml={junit}", "-o", "junit_family=xunit1", *args.pytest_arg]
    if args.keyword:
        cmd += ["-k", args.keyword]
    cmd += ids
    start = time.time()
    note = ""
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=work / "tests", env=env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            rc = None
            note = f"killed after {args.timeout:.0f} s (--timeout)"
        except BaseException:
            kill_group(proc)
            raise
    seconds = time.time() - start
    results: Dict[str, dict] = {}
    if rc is not None and junit.exists():
        try:
            results = parse_junit(junit)
        except ET.ParseError as e:
            note = f"junit XML unreadable: {e}"
    if not results:
        results, running = parse_verbose_log(log.read_text(errors="replace"))
        if rc is None and running:
            results[running] = {"outcome": "timeout", "message": note, "seconds": 0.0}
    # 2: interrupted, as by a collection error (then that file's "error" outcome says it all).
    if rc not in (0, 1, 5) and not note and not (rc == 2 and results):
        note = f"pytest exited {rc} (see {log})"
    return {"results": results, "rc": rc, "seconds": seconds, "note": note}


def kill_group(proc: subprocess.Popen) -> None:
    """Ends the batch's own process group (pytest and the ranks it started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            if sig == signal.SIGKILL:
                return
        except subprocess.TimeoutExpired:
            continue
    try:  # ranks that left the group die with the pipes; reap pytest itself
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


# --- the swapped run's records ----------------------------------------------------------------

def read_stats(folder: Path) -> dict:
    """The swapped run's process records, summed."""
    total = {"processes": 0, "installed": 0, "install_errors": [], "served": 0,
             "handed_back": 0, "saves_served": 0, "saves_handed_back": 0,
             "reasons": Counter(), "save_reasons": Counter(), "by_test": defaultdict(Counter)}
    if not folder.exists():
        return total
    for path in sorted(folder.rglob("proc-*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        total["processes"] += 1
        if rec.get("install_ran"):
            total["installed"] += 1
        else:
            total["install_errors"].append(f"pid {rec.get('pid')}: {rec.get('error')}")
        for key in ("served", "handed_back", "saves_served", "saves_handed_back"):
            total[key] += int(rec.get(key) or 0)
        for key, into in (("handed_back_reasons", "reasons"),
                          ("saves_handed_back_reasons", "save_reasons")):
            for reason in rec.get(key) or []:
                # The checkpoints' folders (temporary ones) left out, so like reasons add up.
                total[into][re.sub(r"(?<![\w.])/[^\s:'\"]+", "<path>", reason)] += 1
        for test, counts in (rec.get("by_test") or {}).items():
            total["by_test"][test].update(counts)
    return total


def known_reason(nodeid: str) -> str:
    for pattern, why in KNOWN_DIFFERENCES.items():
        if fnmatch.fnmatchcase(nodeid, pattern):
            return why
    return ""


# --- the environment ---------------------------------------------------------------------------

def importable(python: str, module: str, env: dict) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], env=env, capture_output=True,
                          timeout=300).returncode == 0


def ensure_expecttest(args, env: dict, deps: Path) -> Optional[Path]:
    """None where expecttest is importable; else the folder it was installed into."""
    probe = dict(env)
    probe.pop(SWAP_VAR, None)
    if importable(args.python, "expecttest", probe):
        return None
    deps.mkdir(parents=True, exist_ok=True)
    probe["PYTHONPATH"] = os.pathsep.join([str(deps), probe.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    if importable(args.python, "expecttest", probe):
        return deps
    print(f"expecttest is not importable: pip install --target {deps} expecttest", flush=True)
    got = subprocess.run([args.python, "-m", "pip", "install", "--quiet", "--disable-pip-version-"
                          "check", "--target", str(deps), "expecttest"],
                         capture_output=True, text=True, timeout=900)
    if got.returncode != 0 or not importable(args.python, "expecttest", probe):
        print((got.stdout + got.stderr)[-3000:], file=sys.stderr)
        die("error: the package 'expecttest' (PyPI), which torch.testing._internal imports, is "
            f"not importable and could not be installed (pip install --target {deps} "
            "expecttest); install it into the interpreter's environment, or pass --deps a "
            "folder holding it")
    return deps


# --- the report ----------------------------------------------------------------------------------

def report(args, order: List[str], results: Dict[str, dict], stats: dict,
           notes: List[str]) -> Tuple[int, dict]:
    both = len(args.modes) == 2
    rows, differ, known = [], [], []
    for nodeid in order:
        res = results.get(nodeid, {})
        outs = [(res.get(m) or {}).get("outcome", "-") for m in MODES]
        by = stats["by_test"].get(nodeid, Counter())
        loads = f"{by['served']}/{by['handed_back']}" if (by["served"] or by["handed_back"]) \
            else ""
        saves = f"{by['saves_served']}/{by['saves_handed_back']}" \
            if (by["saves_served"] or by["saves_handed_back"]) else ""
        mark = ""
        if both and outs[0] != outs[1]:
            why = known_reason(nodeid)
            mark = "known" if why else "DIFF"
            (known if why else differ).append(nodeid)
        rows.append((nodeid, outs[0] if "plain" in args.modes else "",
                     outs[1] if "swapped" in args.modes else "", loads, saves, mark))
    header = ("test id", "plain", "swapped", "loads served/back", "saves served/back", "")
    widths = [max([len(r[i]) for r in rows] + [len(header[i])]) for i in range(len(header))]
    widths[0] = min(widths[0], 120)
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())

    per_mode = {m: Counter((results.get(n, {}).get(m) or {}).get("outcome", "-") for n in order)
                for m in args.modes}
    print(f"\n{len(order)} test ids")
    for m in args.modes:
        print(f"  {m}: " + ", ".join(f"{v} {k}" for k, v in sorted(per_mode[m].items())))
    rc = 0
    if "swapped" in args.modes:
        print(f"  swapped run: {stats['processes']} processes recorded, install() ran in "
              f"{stats['installed']}; zeroflat served {stats['served']} loads, handed "
              f"{stats['handed_back']} back to DCP's own reader")
        for reason, n in stats["reasons"].most_common():
            print(f"    handed back x{n}: {reason}")
        print(f"    and its writer served {stats['saves_served']} saves (a save counted once per "
              f"rank), handed {stats['saves_handed_back']} back to DCP's own writer")
        for reason, n in stats["save_reasons"].most_common():
            print(f"    save handed back x{n}: {reason}")
        unattributed = stats["by_test"].get("(no test)")
        if unattributed:
            print(f"    outside any test: {unattributed['served']} loads served, "
                  f"{unattributed['handed_back']} handed back; {unattributed['saves_served']} "
                  f"saves served, {unattributed['saves_handed_back']} handed back")
        if stats["install_errors"]:
            rc = 1
            print(f"\nzeroflat.dcp.install() did not run in {len(stats['install_errors'])} "
                  "processes of the swapped run:")
            for e in stats["install_errors"][:5]:
                print(f"  {e.strip().splitlines()[0] if e else e}")
        if stats["processes"] == 0:
            rc = 1
            print("\nNO PROCESS OF THE SWAPPED RUN RECORDED ITSELF: the sitecustomize did not run "
                  "(the swap was never in place); the comparison proves nothing.")
        elif stats["served"] == 0:
            rc = 1
            print(f"\nZEROFLAT SERVED NO LOAD in the swapped run ({stats['handed_back']} handed "
                  "back to DCP's own reader): the comparison proves nothing about zeroflat.")
        elif stats["saves_served"] == 0:
            rc = 1
            print(f"\nZEROFLAT SERVED NO SAVE in the swapped run ({stats['saves_handed_back']} "
                  "handed back to DCP's own writer): the comparison proves nothing about its "
                  "writer.")
    for n in notes:
        print(f"  note: {n}")
    if known:
        print(f"\n{len(known)} test ids differ as KNOWN_DIFFERENCES says (not counted):")
        for nodeid in known:
            print(f"  {nodeid}: {known_reason(nodeid)}")
    if differ:
        rc = 1
        print(f"\n{len(differ)} test ids differ:")
        for nodeid in differ:
            print(f"\n=== {nodeid}")
            for m in MODES:
                rec = results.get(nodeid, {}).get(m) or {}
                line = rec.get("key") or rec.get("message") or ""
                print(f"  {m}: {rec.get('outcome', '-')}" + (f": {line}" if line else ""))
    elif both:
        print("\nno unexplained difference between the modes")
    summary = {"per_mode": {m: dict(c) for m, c in per_mode.items()},
               "differ": differ, "known": {n: known_reason(n) for n in known}}
    return rc, summary


def main() -> int:
    default_python = REPO / ".venv" / "bin" / "python"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests_ids", nargs="*", metavar="TEST_ID_OR_FILE",
                    help="test files or node ids relative to --tests (default: every test file)")
    ap.add_argument("--tests", required=True, metavar="DIR",
                    help="a folder holding PyTorch's test/distributed/checkpoint test files")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--pytest-arg", action="append", default=[],
                    help="one more pytest argument for every run (repeatable)")
    ap.add_argument("--modes", default="plain,swapped", help="plain,swapped (default: both)")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds one pytest run (a batch in one mode) may take (default 900)")
    ap.add_argument("--batch", choices=("file", "all"), default="file",
                    help="one pytest per test file and mode (default), or one per mode")
    ap.add_argument("--python", default=str(default_python if default_python.exists()
                                             else sys.executable),
                    help="the interpreter the tests run with (default: the venv's)")
    ap.add_argument("--zeroflat", default=str(REPO / "build" / "python"),
                    help="the folder holding the built zeroflat package (default build/python)")
    ap.add_argument("--deps", help="where expecttest is installed when missing "
                    "(default WORK/deps)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS (default 1)")
    ap.add_argument("--workdir", help="the work folder, new or empty (default: a new temporary "
                    "one, kept)")
    ap.add_argument("--json", metavar="OUT", help="write the results here too")
    args = ap.parse_args()

    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or not set(args.modes) <= set(MODES) or len(set(args.modes)) != len(
            args.modes):
        ap.error(f"--modes: one or both of {','.join(MODES)}")
    args.modes = [m for m in MODES if m in args.modes]
    if args.timeout <= 0:
        ap.error("--timeout: seconds > 0")
    if args.threads < 1:
        ap.error("--threads: >= 1")
    src = Path(args.tests).expanduser().resolve()
    if not src.is_dir():
        die(f"error: --tests {args.tests}: not a folder")
    files = find_test_files(src)
    if not files:
        die(f"error: --tests {args.tests}: no test files (test_*.py) in it; give the folder "
            "test/distributed/checkpoint of a PyTorch checkout")
    selection = parse_selection(src, args.tests_ids, files)
    if not Path(args.python).exists():
        die(f"error: --python {args.python}: not found")
    zf_src = Path(args.zeroflat).expanduser().resolve()
    if not (zf_src / "zeroflat" / "dcp.py").exists():
        die(f"error: no zeroflat package with dcp.py in {zf_src} (build it, or pass --zeroflat)")

    if args.workdir:
        work = Path(args.workdir).expanduser().resolve()
        if work.exists() and any(work.iterdir()):
            die(f"error: --workdir {work} is not empty")
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="zeroflat-pytorch-dcp-"))
    for sub in ("logs", "junit", "stats", "site", "tmp"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    tests = work / "tests"
    shutil.copytree(src, tests, ignore=shutil.ignore_patterns(
        "__pycache__", "*.pyc", "conftest.py", "pytest.ini", "setup.cfg", "tox.ini",
        "pyproject.toml"))
    # pytest's rootdir and configuration: this file, so nothing above the copy is read.
    (tests / "pytest.ini").write_text("[pytest]\naddopts =\n")
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    shutil.copytree(zf_src / "zeroflat", work / "zeroflat" / "zeroflat",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "tests"))

    env = dict(os.environ)
    for var in (SWAP_VAR, STATS_VAR, "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONSTARTUP"):
        env.pop(var, None)
    env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1",
               PYTEST_DEBUG_TEMPROOT=str(work / "tmp"))
    path = [str(work / "site"), str(work / "zeroflat")]
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(path + ([old] if old else []))
    if not importable(args.python, "pytest", env):
        die(f"error: pytest is not importable by {args.python}")
    deps = ensure_expecttest(args, env, Path(args.deps).expanduser().resolve() if args.deps
                             else work / "deps")
    if deps is not None:
        path.append(str(deps))
        env["PYTHONPATH"] = os.pathsep.join(path + ([old] if old else []))
    torch_version = subprocess.run(
        [args.python, "-c", "import torch; print(torch.__version__)"], env=env,
        capture_output=True, text=True, timeout=300).stdout.strip() or "?"

    print(f"PyTorch DCP tests: {src} (copied to {tests})")
    print(f"work folder: {work}")
    print(f"torch {torch_version}; modes: {', '.join(args.modes)}; PYTHONPATH: "
          f"{env['PYTHONPATH']}")
    if args.batch == "all":
        batches = {"all": [i for ids in selection.values() for i in ids]}
    else:
        batches = selection
    results: Dict[str, dict] = {}
    order: List[str] = []
    notes: List[str] = []
    batch_log = []
    start = time.time()
    for name, ids in batches.items():
        for mode in args.modes:
            print(f"[{time.strftime('%H:%M:%S')}] {mode}: {name}", end="", flush=True)
            got = run_batch(args, mode, name, ids, env, work)
            outs = Counter(r["outcome"] for r in got["results"].values())
            print(f"  {got['seconds']:.0f} s, " + (", ".join(
                f"{v} {k}" for k, v in sorted(outs.items())) or "no tests") +
                (f"  ({got['note']})" if got["note"] else ""), flush=True)
            if got["note"]:
                notes.append(f"{mode} {name}: {got['note']}")
            batch_log.append({"batch": name, "mode": mode, "rc": got["rc"],
                              "seconds": round(got["seconds"], 1), "note": got["note"]})
            for nodeid, rec in got["results"].items():
                if nodeid not in results:
                    order.append(nodeid)
                results.setdefault(nodeid, {})[mode] = rec
    print(f"\nran for {(time.time() - start) / 60:.1f} min")
    stats = read_stats(work / "stats" / "swapped")
    rc, summary = report(args, order, results, stats, notes)
    doc = {"date": time.strftime("%Y-%m-%d"), "torch": torch_version, "tests": str(src),
           "work": str(work), "modes": args.modes, "selection": selection,
           "known_differences": KNOWN_DIFFERENCES, "batches": batch_log,
           "results": {n: results[n] for n in order}, **summary,
           "swapped": {"processes": stats["processes"], "installed": stats["installed"],
                       "install_errors": stats["install_errors"], "served": stats["served"],
                       "handed_back": stats["handed_back"],
                       "handed_back_reasons": dict(stats["reasons"]),
                       "saves_served": stats["saves_served"],
                       "saves_handed_back": stats["saves_handed_back"],
                       "saves_handed_back_reasons": dict(stats["save_reasons"]),
                       "by_test": {k: dict(v) for k, v in stats["by_test"].items()}}
           if "swapped" in args.modes else None,
           "exit": rc}
    (work / "summary.json").write_text(json.dumps(doc, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
