"""pytest plugin of scripts/deepspeed_checkpoint_tests.py (loaded with ``-p zf_ds_pytest_plugin``).

Writes, into the folder ZF_DS_EVENTS:
- pytest-events.jsonl: one line per test start, per phase report (setup, call, teardown: outcome,
  duration, the failure or skip text) and per test finish, flushed as they happen, so that the
  runner sees which test is running and can time it out;
- current_test: the node id of the test running (read by the ranks' sitecustomize to attribute
  each load_checkpoint call to its test);
- with ZF_DS_COLLECT=<file>: the collected node ids (one a line) and the deselected ones.
"""

import json
import os
import time

_DIR = os.environ.get("ZF_DS_EVENTS")


def _write(record):
    if not _DIR:
        return
    record["t"] = time.time()
    with open(os.path.join(_DIR, "pytest-events.jsonl"), "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()


def _current(nodeid):
    if not _DIR:
        return
    path = os.path.join(_DIR, "current_test")
    with open(path + ".tmp", "w") as f:
        f.write(nodeid or "")
    os.replace(path + ".tmp", path)


_deselected = []


def pytest_deselected(items):
    _deselected.extend(item.nodeid for item in items)


def pytest_collection_finish(session):
    out = os.environ.get("ZF_DS_COLLECT")
    if not out:
        return
    with open(out, "w") as f:
        json.dump({"selected": [item.nodeid for item in session.items],
                   "deselected": list(_deselected)}, f, indent=1)


def pytest_runtest_logstart(nodeid, location):
    _current(nodeid)
    _write({"event": "start", "nodeid": nodeid, "pid": os.getpid()})


def pytest_runtest_logreport(report):
    text = None
    if report.failed or report.skipped:
        if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
            path, line, reason = report.longrepr
            text = f"{path}:{line}: {reason}"
        else:
            text = getattr(report, "longreprtext", None) or str(report.longrepr)
    sections = None
    if report.failed:
        sections = [[name, content[-20000:]] for name, content in report.sections]
    _write({"event": "report", "nodeid": report.nodeid, "when": report.when,
            "outcome": report.outcome, "duration": report.duration, "text": text,
            "wasxfail": getattr(report, "wasxfail", None), "sections": sections})


def pytest_runtest_logfinish(nodeid, location):
    _write({"event": "finish", "nodeid": nodeid})
    _current("")
