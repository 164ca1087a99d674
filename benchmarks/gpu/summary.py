"""$OUT/summary.json for benchmarks/gpu/run.sh: every stage with its status, seconds, limit and note, rewritten
after each stage (atomically), so a run cut off anywhere leaves a summary that says how far it came.

Usage (run.sh calls it; plain Python, no torch, ~50 ms):
    summary.py init FILE --mode device|rehearse STAGE=LIMIT_S ...   every stage listed as "pending"
               [--set STAGE=STATUS --final]                     (one call: a run that stops at once)
    summary.py set FILE STAGE STATUS [--note TEXT] [--seconds S]     a stage's status as said
    summary.py done FILE STAGE RC SECONDS [--rows F] [--junit F] [--json F] [--note TEXT]
    summary.py final FILE [--gpu NAME]                               overall status; exit 0 when every stage is ok
`done` reads the status from what the stage left: the rows it appended to --rows (each row's "status", from
gpu_step.py or peers.py), a pytest junit file, or a JSON object's "status" (--json: depth_throughput.py's, which
rewrites it after each run); an exit status of 124 or 137 is "cut off at its limit".
A status is ok when it starts with passed, measured, rehearsed or skipped (a skip says why, as a row does):
pending, running, failed, error and cut off are not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import xml.etree.ElementTree as ET

OK = ("passed", "measured", "rehearsed", "skipped")


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def save(path: str, data: dict) -> None:
    data["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _stage(data: dict, name: str) -> dict:
    for s in data["stages"]:
        if s["name"] == name:
            return s
    data["stages"].append(s := {"name": name, "limit_s": None, "status": "pending", "seconds": None, "note": ""})
    return s


def junit_status(path: str) -> tuple[str, str]:
    """(status, note) of a pytest junit file: the counts, and the names of the tests that failed."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return "failed", f"no junit report ({type(e).__name__})"
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    bad = [f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name')}" for s in suites for c in s.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    counts = f"{passed} passed, {n['failures'] + n['errors']} failed, {n['skipped']} skipped"
    if n["tests"] == 0:
        return "failed", "no test ran"
    return ("failed" if bad else "passed"), counts + (f"; failed: {', '.join(bad)[:600]}" if bad else "")


def rows_status(path: str, stage: str) -> list[str]:
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []
    return [r.get("status", "error: the row has no status") for r in rows if r.get("stage") == stage]


def json_status(path: str, rc: int, limit) -> str:
    """The status a stage's JSON result states (cut off: what it had measured by then)."""
    try:
        said = load(path).get("status") or "error: the result has no status"
    except (OSError, ValueError):
        said = None
    if rc in (124, 137):
        return f"cut off at {limit} s" + (f" ({said})" if said else " before its result was written")
    if said is None:
        return f"failed: exit {rc} and no result written"
    return said if rc == 0 or not ok(said) else f"failed: exit {rc} ({said})"


def done(data: dict, name: str, rc: int, seconds: float, rows: str | None, junit: str | None, note: str,
         result: str | None = None) -> None:
    s = _stage(data, name)
    s["seconds"] = round(seconds, 1)
    rehearse = data.get("mode") == "rehearse"
    if junit:
        status, counts = junit_status(junit)
        if rc in (124, 137):
            status = f"cut off at {s['limit_s']} s"
        elif rc and status == "passed":  # pytest stopped before the end (its session timeout): not all ran
            status = f"failed: exit {rc}, the session stopped early"
        s["status"] = f"rehearsed: {counts}" if rehearse and status == "passed" else f"{status}: {counts}"
    elif result:
        s["status"] = json_status(result, rc, s["limit_s"])
    elif rows:
        got = rows_status(rows, name)
        if got:
            s["status"] = got[0] if len(got) == 1 else "; ".join(got)
        elif rc in (124, 137):
            s["status"] = f"cut off at {s['limit_s']} s before its row was written"
        else:
            s["status"] = f"failed: exit {rc} and no row written"
    elif rc in (124, 137):
        s["status"] = f"cut off at {s['limit_s']} s"
    else:
        s["status"] = ("rehearsed" if rehearse else "passed") if rc == 0 else f"failed: exit {rc}"
    s["note"] = note or s["note"]


def ok(status: str) -> bool:
    return status.startswith(OK)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["init", "set", "done", "final"])
    ap.add_argument("file")
    ap.add_argument("args", nargs="*")
    ap.add_argument("--mode", default="device")
    ap.add_argument("--rows")
    ap.add_argument("--junit")
    ap.add_argument("--json", dest="result")
    ap.add_argument("--note", default="")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--gpu", default="")
    ap.add_argument("--set", action="append", default=[], help="with init: STAGE=STATUS")
    ap.add_argument("--final", action="store_true", help="with init: the final verdict too")
    a = ap.parse_intermixed_args(argv)
    if a.cmd == "init":
        stages = []
        for spec in a.args:
            name, _, limit = spec.partition("=")
            stages.append({"name": name, "limit_s": int(limit) if limit else None, "status": "pending",
                           "seconds": None, "note": ""})
        data = {"mode": a.mode, "status": "running", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages": stages}
        for spec in a.set:
            name, _, status = spec.partition("=")
            stage = _stage(data, name)
            stage["status"], stage["seconds"] = status, 0.0  # said at once: no time of its own
        save(a.file, data)
        return final(a.file, data, a.gpu) if a.final else 0
    data = load(a.file)
    if a.cmd == "set":
        s = _stage(data, a.args[0])
        s["status"] = a.args[1]
        s["note"] = a.note or s["note"]
        if a.seconds is not None:
            s["seconds"] = round(a.seconds, 1)
    elif a.cmd == "done":
        name, rc, seconds = a.args[0], int(a.args[1]), float(a.args[2])
        done(data, name, rc, seconds, a.rows, a.junit, a.note, a.result)
    else:
        return final(a.file, data, a.gpu)
    save(a.file, data)
    return 0


def final(path: str, data: dict, gpu: str) -> int:
    """The overall status (ok when every stage is), saved and printed with each stage's line; 0 when ok."""
    if gpu:
        data["gpu"] = gpu
    bad = [s["name"] for s in data["stages"] if not ok(s["status"])]
    unrun = [n for n in bad if _stage(data, n)["status"] in ("pending", "running")]
    said = [", ".join(n for n in bad if n not in unrun)] + ([f"not run: {', '.join(unrun)}"] if unrun else [])
    data["status"] = "ok" if not bad else "not ok: " + "; ".join(x for x in said if x)
    save(path, data)
    for s in data["stages"]:
        secs = "" if s["seconds"] is None else f"{s['seconds']:.0f}/{s['limit_s']} s"
        print(f"  {s['name']:<22} {secs:>10}  {s['status']}" + (f"  ({s['note']})" if s["note"] else ""))
    print(f"summary: {data['status']}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
