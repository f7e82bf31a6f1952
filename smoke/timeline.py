#!/usr/bin/env python3
"""The smoke run's record and its per-phase timeline, read from Imp's status fields, Events and
metrics (never from log text).

    timeline.py watch FILE -- COMMAND...   run COMMAND (a `kubectl get --raw ...?watch=1`) and append
                                           each watch event it prints to FILE as one JSON line with
                                           the time it was seen ("t", Unix seconds); SIGTERM stops both
    timeline.py field FILE NAME PATH [VALUE]
                                           exit 0 once an object NAME recorded in FILE had the dotted
                                           PATH set (equal to VALUE when given); print the value
    timeline.py replacement FILE NAME PATH print the name of another object of FILE with PATH set
    timeline.py report --out JSON ...      print the timeline table and write the JSON report

The watch stream records every version of an ImpVM, so a field is seen the moment the API server
has it, also for a VM the pool deletes moments later. Kubernetes' own timestamps have one-second
resolution; each phase keeps that value ("api") beside the time the smoke saw it ("at").
"""
import argparse
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


def condition_true(path: str, name: str, ctype: str):
    for r in records(path):
        obj = r.get("object", {})
        if dig(obj, "metadata.name") != name:
            continue
        for c in dig(obj, "status.conditions") or []:
            if c.get("type") == ctype and c.get("status") == "True":
                return r["t"], c.get("lastTransitionTime")
    return None


def deleted(path: str, name: str):
    for r in records(path):
        if r.get("type") == "DELETED" and dig(r.get("object", {}), "metadata.name") == name:
            return r["t"], dig(r["object"], "metadata.deletionTimestamp")
    return None


def parse_time(s):
    if not s:
        return None
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def metric(path: str, name: str):
    """Sum of the samples of one metric (all label sets) in a Prometheus text exposition."""
    total, found = 0.0, False
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("#"):
                    continue
                head, _, value = line.rpartition(" ")
                if head.split("{")[0] == name:
                    total += float(value)
                    found = True
    except FileNotFoundError:
        return None
    return total if found else None


def report(a) -> int:
    vm = a.vm
    phases = []  # (key, label, at, api value, source)

    def add(key, label, seen, source):
        if seen is None:
            phases.append({"phase": key, "label": label, "at": None, "api": None, "source": source})
        else:
            at, api = seen
            phases.append({"phase": key, "label": label, "at": at, "api": api, "source": source})

    jobs = json.load(open(a.jobs, encoding="utf-8")) if a.jobs else []
    job = next((j for j in jobs if str(j.get("id")) == str(a.job)), None) if jobs else None

    def job_time(field):
        if job is None or not job.get(field):
            return None
        return parse_time(job[field]), job[field]

    iv = a.impvms
    add("vm_created", "VM created", first_seen(iv, vm, "metadata.creationTimestamp"), "ImpVM metadata.creationTimestamp")
    add("jit_minted", "JIT config minted", first_seen(iv, vm, "spec.runnerConfigSecret"), "ImpVM spec.runnerConfigSecret")
    add("scheduled", "scheduled", first_seen(iv, vm, "status.scheduledTime"), "ImpVM status.scheduledTime")
    boot = first_seen(iv, vm, "status.bootStartTime")
    add("boot_started", "boot started", boot, "ImpVM status.bootStartTime")
    build = metric(a.runtime_metrics, "imp_rootfs_build_duration_seconds_sum") if a.runtime_metrics else None
    rootfs = (boot[0] + build, f"bootStartTime + {build:.3f}s") if boot and build is not None else None
    add("rootfs_ready", "rootfs ready", rootfs, "bootStartTime + imp_rootfs_build_duration_seconds_sum")
    add("guest_hello", "guest Hello", first_seen(iv, vm, "status.bootCompleteTime"), "ImpVM status.bootCompleteTime")
    add("runner_started", "runner started", first_seen(iv, vm, "status.runner.startedTime"), "ImpVM status.runner.startedTime")
    add("job_queued", "job queued (webhook sent)", job_time("created_at"), "GitHub job created_at")
    accepted = (a.accepted_at, "imp_webhook_deliveries_total{result=accepted} >= 1") if a.accepted_at else None
    add("webhook_accepted", "webhook accepted", accepted, "operator metric, first seen")
    add("job_picked_up", "job picked up", job_time("started_at"), "GitHub job started_at")
    add("job_done", "job done", job_time("completed_at"), "GitHub job completed_at")
    add("runner_exited", "runner exited", first_seen(iv, vm, "status.runner.exitedTime"), "ImpVM status.runner.exitedTime")
    add("torn_down", "torn down", condition_true(iv, vm, "TornDown"), "ImpVM condition TornDown=True")
    add("vm_deleted", "VM deleted", deleted(iv, vm), "ImpVM watch DELETED")
    repl = a.replacement
    add("replaced", "replaced (new runner started)",
        first_seen(iv, repl, "status.runner.startedTime") if repl else None,
        f"ImpVM {repl} status.runner.startedTime")

    known = [p for p in phases if p["at"] is not None]
    start = min(p["at"] for p in known) if known else 0.0
    known.sort(key=lambda p: p["at"])
    prev = start
    for p in known:
        p["since_start_s"] = round(p["at"] - start, 3)
        p["duration_s"] = round(p["at"] - prev, 3)
        prev = p["at"]
    queued = next((p["at"] for p in known if p["phase"] == "job_queued"), None)
    picked = next((p["at"] for p in known if p["phase"] == "job_picked_up"), None)
    events = []
    for r in records(a.events):
        o = r.get("object", {})
        if dig(o, "regarding.name") in (vm, repl) or dig(o, "regarding.kind") == "ImpVMRunnerPool":
            events.append({
                "object": f'{dig(o, "regarding.kind")}/{dig(o, "regarding.name")}',
                "reason": o.get("reason"),
                "type": o.get("type"),
                "eventTime": o.get("eventTime") or dig(o, "deprecatedLastTimestamp"),
                "note": o.get("note"),
            })
    out = {
        "path": a.path,
        "vm": vm,
        "replacement": repl,
        "job": a.job,
        "started": datetime.fromtimestamp(start).astimezone().isoformat() if known else None,
        "pickup_latency_s": round(picked - queued, 3) if queued and picked else None,
        "phases": known + [p for p in phases if p["at"] is None],
        "events": events,
    }
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
    print(f"{'phase':<30} {'at (UTC)':<13} {'since start':>11} {'duration':>9}  source")
    for p in known:
        at = datetime.utcfromtimestamp(p["at"]).strftime("%H:%M:%S.%f")[:-3]
        print(f'{p["label"]:<30} {at:<13} {p["since_start_s"]:>10.3f}s {p["duration_s"]:>8.3f}s  {p["source"]}')
    missing = [p["label"] for p in phases if p["at"] is None]
    if out["pickup_latency_s"] is not None:
        print(f'pickup latency (job queued -> picked up): {out["pickup_latency_s"]:.3f}s')
    print(f"timeline written to {a.out}")
    if missing:
        print("phases never seen: " + ", ".join(missing), file=sys.stderr)
        return 1
    return 0


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
    p = argparse.ArgumentParser(prog="timeline.py report")
    p.add_argument("cmd", choices=["report"])
    p.add_argument("--out", required=True)
    p.add_argument("--path", required=True, help="which guest path ran")
    p.add_argument("--vm", required=True)
    p.add_argument("--replacement")
    p.add_argument("--job", required=True)
    p.add_argument("--impvms", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--jobs", required=True, help="the simulator's /_admin/jobs")
    p.add_argument("--accepted-at", type=float)
    p.add_argument("--runtime-metrics")
    return report(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
