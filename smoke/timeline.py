#!/usr/bin/env python3
"""The smoke run's record: every version of the ImpVMs and Events as the API server had them. The
per-phase timeline computed from it is kubectl-imp's (`kubectl-imp timeline VM --impvms FILE ...`,
kubectl-imp/src/timeline.rs), the same computation as `kubectl imp timeline VM` on a cluster.

    timeline.py watch FILE -- COMMAND...   run COMMAND (a `kubectl get --raw ...?watch=1`) and append
                                           each watch event it prints to FILE as one JSON line with
                                           the time it was seen ("t", Unix seconds); SIGTERM stops both
    timeline.py field FILE NAME PATH [VALUE]
                                           exit 0 once an object NAME recorded in FILE had the dotted
                                           PATH set (equal to VALUE when given); print the value
    timeline.py replacement FILE NAME PATH print the name of another object of FILE with PATH set

The watch stream records every version of an ImpVM, so a field is seen the moment the API server
has it, also for a VM the pool deletes moments later.
"""
import json
import signal
import subprocess
import sys
import time
from datetime import datetime


def watch(path: str, cmd: list) -> int:
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def stop(*_):
        child.terminate()

    signal.signal(signal.SIGTERM, stop)
    with open(path, "a", encoding="utf-8") as out:
        for line in child.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            event["t"] = time.time()
            out.write(json.dumps(event) + "\n")
            out.flush()
    return child.wait()


def records(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return


def dig(obj, dotted: str):
    for key in dotted.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def first_seen(path: str, name: str, dotted: str, value=None):
    """(time seen, value) of the first recorded version of NAME with PATH set (to VALUE)."""
    for r in records(path):
        obj = r.get("object", {})
        if dig(obj, "metadata.name") != name:
            continue
        v = dig(obj, dotted)
        if v is None or (value is not None and str(v) != value):
            continue
        return r["t"], v
    return None


def parse_time(s):
    if not s:
        return None
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "watch":
        if len(sys.argv) < 5 or sys.argv[3] != "--":
            print("usage: timeline.py watch FILE -- COMMAND...", file=sys.stderr)
            return 2
        return watch(sys.argv[2], sys.argv[4:])
    if len(sys.argv) >= 2 and sys.argv[1] == "field":
        if len(sys.argv) not in (5, 6):
            print("usage: timeline.py field FILE NAME PATH [VALUE]", file=sys.stderr)
            return 2
        seen = first_seen(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] if len(sys.argv) == 6 else None)
        if seen is None:
            return 1
        print(seen[1])
        return 0
    if len(sys.argv) == 5 and sys.argv[1] == "replacement":
        for r in records(sys.argv[2]):
            name = dig(r.get("object", {}), "metadata.name")
            if name != sys.argv[3] and dig(r.get("object", {}), sys.argv[4]) is not None:
                print(name)
                return 0
        return 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
