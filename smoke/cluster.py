#!/usr/bin/env python3
"""imp-smoke --cluster: one real job through an installed Imp, followed phase by phase.

    smoke/imp-smoke.sh --cluster --repo OWNER/REPO [--context CTX] [--github-api URL]
        [--token-file FILE] [--workflow imp-smoke.yaml] [--ref main]
        [--pool-namespace default] [--pool imp] [--pool-manifest FILE]
        [--timeout SECS] [--report FILE] [--record FILE] [--kubectl PATH]

The token comes from --token-file or the environment (IMP_SMOKE_GITHUB_TOKEN, else GITHUB_TOKEN),
never from argv; it is sent only in the Authorization header and never printed. It needs
`actions: write` on the repository (a fine-grained PAT, or `repo` scope for a classic one).

Phases, in order (a failure or timeout names its phase and exits 1; bad usage exits 2):
  preflight       kubectl reaches the context's cluster, Imp's CRDs exist, the token reads the
                  repository's workflow (copy smoke/workflow.yaml to .github/workflows/imp-smoke.yaml)
  pool ready      the pool exists (or is created from --pool-manifest, and deleted at the end), its
                  labels cover the workflow's runs-on, its credentials are not refused, and minIdle
                  runners are idle with their runner started
  dispatch        POST .../actions/workflows/{id}/dispatches (workflow_dispatch)
  job queued      the dispatched run and its job, through the runs and jobs API
  job picked up   the job in progress on a runner of the pool (its ImpVM, by runner name)
  job done        the job completed with conclusion success
  torn down       the job's ImpVM and its JIT Secret are gone
  replaced        the pool replenished: minIdle idle started runners again, a new VM among them
  timeline        the per-phase table and JSON report of `kubectl-imp timeline` (same as --local)

The ImpVMs and Events of the pool's namespace are recorded from `kubectl get --raw ...?watch=1`
(timeline.py watch), so the job's VM is on record after the pool deletes it.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # no __pycache__ in the checkout
sys.path.insert(0, HERE)
import timeline  # noqa: E402

# Labels GitHub gives every Imp runner (self-hosted, the OS, the architecture: guests are x86_64), so a
# pool need not list them. The operator routes by the same rule (operator/src/runnerpool/labels.rs, whose
# test runs pool_serves on its table).
DEFAULT_RUNNER_LABELS = {"self-hosted", "linux", "x64"}


def pool_serves(job_labels, pool_labels) -> bool:
    """A pool's runners take the job: every job label is the pool's or a default (case-insensitive)."""
    have = {x.lower() for x in pool_labels} | DEFAULT_RUNNER_LABELS
    return bool(job_labels) and all(x.lower() in have for x in job_labels)


class Failed(Exception):
    def __init__(self, phase: str, why: str):
        super().__init__(f"{phase}: {why}")
        self.phase = phase
        self.why = why


def say(kind: str, text: str):
    print(f"{kind:<5} {text}", flush=True)


class GitHub:
    def __init__(self, api: str, repo: str, token: str):
        self.api = api.rstrip("/")
        self.repo = repo
        self._token = token

    def call(self, method: str, path: str, body=None):
        """(status, parsed JSON or None). Network errors raise OSError."""
        url = f"{self.api}/repos/{self.repo}{path}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self._token}")
        req.add_header("Accept", "application/vnd.github+json")
        req.add_header("X-GitHub-Api-Version", "2022-11-28")
        req.add_header("User-Agent", "imp-smoke")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            raw = e.read()
            status = e.code
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, None

    def get(self, path: str):
        status, v = self.call("GET", path)
        if status != 200:
            raise OSError(f"GET {path}: HTTP {status} {message(v)}")
        return v


def message(v) -> str:
    return (v or {}).get("message", "") if isinstance(v, dict) else ""


class Kube:
    def __init__(self, kubectl: str, context, namespace: str):
        self.base = [kubectl] + (["--context", context] if context else [])
        self.ns = namespace

    def run(self, *args, stdin=None, check=True, namespaced=True):
        cmd = self.base + (["-n", self.ns] if namespaced else []) + list(args)
        p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)
        if check and p.returncode != 0:
            raise OSError(f"kubectl {' '.join(args)}: {p.stderr.strip()}")
        return p

    def json(self, *args):
        p = self.run(*args, "-o", "json", check=False)
        if p.returncode != 0:
            if "NotFound" in p.stderr or "not found" in p.stderr:
                return None
            raise OSError(f"kubectl get {' '.join(args)}: {p.stderr.strip()}")
        return json.loads(p.stdout)


def wait(phase: str, timeout: float, probe, explain):
    """Calls probe() every 0.5 s until it returns something truthy; Failed(phase) after timeout."""
    deadline = time.monotonic() + timeout
    last_error = None
    while True:
        try:
            got = probe()
            if got:
                return got
        except OSError as e:  # a transient API error: try again until the deadline
            last_error = e
        if time.monotonic() >= deadline:
            why = f"timed out after {timeout:.0f}s: {explain()}"
            if last_error:
                why += f" (last error: {last_error})"
            raise Failed(phase, why)
        time.sleep(0.5)


def read_token(a) -> str:
    if a.token_file:
        try:
            with open(a.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise Failed("preflight", f"--token-file {a.token_file}: {e.strerror}")
        if not token:
            raise Failed("preflight", f"--token-file {a.token_file} is empty")
        return token
    for var in ("IMP_SMOKE_GITHUB_TOKEN", "GITHUB_TOKEN"):
        if os.environ.get(var):
            return os.environ[var].strip()
    raise Failed("preflight", "no GitHub token: pass --token-file FILE or set IMP_SMOKE_GITHUB_TOKEN")


def workflow_labels(path: str):
    """The runs-on labels of the local workflow file's jobs (a flow list or one label per job)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in re.finditer(r"^\s*runs-on:\s*(.+?)\s*$", text, re.M):
        v = m.group(1)
        if v.startswith("["):
            out.append([x.strip().strip("'\"") for x in v.strip("[]").split(",") if x.strip()])
        else:
            out.append([v.strip("'\"")])
    return out


def pool_vms(kube: Kube, pool: str):
    v = kube.json("get", "impvm", "-l", f"imp.dev/runner-pool={pool}")
    return (v or {}).get("items", [])


def idle_started(vms):
    """Runner VMs whose runner started and that are not being deleted (idle or, once a job is taken,
    busy: the job's VM is told apart by name)."""
    return [
        vm["metadata"]["name"]
        for vm in vms
        if not vm["metadata"].get("deletionTimestamp") and timeline.dig(vm, "status.runner.handoff") == "Started"
    ]


def condition(obj, ctype):
    for c in timeline.dig(obj, "status.conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def vm_of_runner(impvms_file: str, runner: str):
    """The name of the recorded ImpVM that registered the runner `runner`."""
    for r in timeline.records(impvms_file):
        o = r.get("object", {})
        names = {
            timeline.dig(o, "status.runner.runnerName"),
            (timeline.dig(o, "metadata.annotations") or {}).get("imp.dev/github-runner-name"),
            timeline.dig(o, "metadata.name"),
        }
        if runner in names:
            return timeline.dig(o, "metadata.name")
    return None


def main() -> int:
    p = argparse.ArgumentParser(prog="imp-smoke.sh --cluster", description=__doc__.split("\n")[0])
    p.add_argument("--cluster", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repo", required=True, help="OWNER/REPO holding the workflow")
    p.add_argument("--context", help="kube context (default: kubectl's current context)")
    p.add_argument("--github-api", default="https://api.github.com")
    p.add_argument("--token-file", help="file holding the GitHub token (else IMP_SMOKE_GITHUB_TOKEN)")
    p.add_argument("--workflow", default="imp-smoke.yaml", help="workflow file name or id in the repository")
    p.add_argument("--workflow-file", default=os.path.join(HERE, "workflow.yaml"),
                   help="local copy, read for its runs-on labels")
    p.add_argument("--ref", default="main")
    p.add_argument("--pool-namespace", default="default")
    p.add_argument("--pool", default="imp")
    p.add_argument("--pool-manifest", help="applied when the pool does not exist; deleted at the end")
    p.add_argument("--timeout", type=float, default=600, help="seconds per phase")
    p.add_argument("--report", default=None)
    p.add_argument("--record", help="also write the run as an asciicast v2 file")
    p.add_argument("--kubectl", default=os.environ.get("KUBECTL", "kubectl"))
    p.add_argument("--kubectl-imp", default=shutil.which("kubectl-imp") or os.path.join(HERE, "..", "target", "debug", "kubectl-imp"),
                   help="the kubectl-imp binary, for the timeline (default: on PATH, else target/debug)")
    p.add_argument("--work-dir", help="where the records go (default: a new temp dir, removed on success)")
    p.add_argument("--namespace", help=argparse.SUPPRESS)  # accepted for the old --cluster usage
    a = p.parse_args()
    if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", a.repo):
        print(f"imp-smoke --cluster: --repo {a.repo!r} is not OWNER/REPO", file=sys.stderr)
        return 2
    if a.record and not os.environ.get("IMP_SMOKE_RECORDING"):
        os.environ["IMP_SMOKE_RECORDING"] = "1"
        argv = [x for i, x in enumerate(sys.argv[1:]) if x != "--record" and sys.argv[i] != "--record"]
        os.execvp(sys.executable, [sys.executable, os.path.join(HERE, "asciicast.py"), a.record,
                                   sys.executable, os.path.abspath(__file__)] + argv)
    if a.report is None:
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(HERE, "..", "target"))
        a.report = os.path.join(target, "imp-smoke", "cluster-report.json")
    if a.work_dir:
        os.makedirs(a.work_dir, exist_ok=True)
    work = a.work_dir or tempfile.mkdtemp(prefix="imp-smoke-cluster.")
    run = Run(a, work)
    try:
        run.phases()
        say("PASS", f"imp-smoke --cluster: all phases passed; timeline in {a.report}")
        if not a.work_dir:
            run.cleanup()
            shutil.rmtree(work, ignore_errors=True)
        return 0
    except (Failed, OSError, subprocess.SubprocessError) as e:
        if not isinstance(e, Failed):  # kubectl missing, a hung call: the phase it happened in
            e = Failed(run.phase, f"{type(e).__name__}: {e}")
        say("FAIL", f"phase '{e.phase}': {e.why}")
        run.cleanup()
        kept = f" (records kept in {work})" if os.listdir(work) else ""
        if not kept and not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
        print(f"imp-smoke --cluster: FAILED in phase '{e.phase}'{kept}", file=sys.stderr)
        return 1
    finally:
        run.cleanup()


class Run:
    def __init__(self, a, work):
        self.a = a
        self.work = work
        self.kube = Kube(a.kubectl, a.context, a.pool_namespace)
        self.watchers = []
        self.created_pool = False
        self.cleaned = False
        self.phase = "preflight"
        self.impvms = os.path.join(work, "impvms.jsonl")
        self.events = os.path.join(work, "events.jsonl")

    def watch(self, path, out):
        cmd = [sys.executable, os.path.join(HERE, "timeline.py"), "watch", out, "--"] + self.kube.base + [
            "get", "--raw", path]
        err = open(out + ".err", "w")
        self.watchers.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err))

    def cleanup(self):
        if self.cleaned:
            return
        self.cleaned = True
        if self.created_pool:
            # The smoke's own pool goes first, and with it its VMs and Secrets (the pool's finalizer);
            # the rest of the manifest (class, network) once the VMs are gone.
            self.kube.run("delete", "imprp", self.a.pool, "--ignore-not-found", "--wait=false", check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if not pool_vms(self.kube, self.a.pool):
                        break
                except OSError:
                    pass
                time.sleep(0.5)
            else:
                print(f"imp-smoke --cluster: the pool's VMs were not gone 60 s after deleting pool {self.a.pool}",
                      file=sys.stderr)
            self.kube.run("delete", "-f", self.a.pool_manifest, "--ignore-not-found", "--wait=false", check=False)
        for w in self.watchers:
            w.send_signal(signal.SIGTERM)
        for w in self.watchers:
            try:
                w.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()

    def phases(self):
        a, kube = self.a, self.kube
        # ---- preflight
        token = read_token(a)
        gh = GitHub(a.github_api, a.repo, token)
        del token
        v = kube.run("get", "--raw", "/version", check=False, namespaced=False)
        if v.returncode != 0:
            raise Failed("preflight", f"kubectl cannot reach the cluster{' of context ' + a.context if a.context else ''}: {v.stderr.strip()}")
        for crd in ("impvmclasses", "impnetworks", "impvms", "impvmrunnerpools"):
            if kube.run("get", "crd", f"{crd}.imp.dev", check=False, namespaced=False).returncode != 0:
                raise Failed("preflight", f"CRD {crd}.imp.dev missing: helm install the chart")
        try:
            status, wf = gh.call("GET", f"/actions/workflows/{a.workflow}")
        except OSError as e:
            raise Failed("preflight", f"GitHub API {a.github_api} unreachable: {e}")
        if status in (401, 403):
            raise Failed("preflight", f"GitHub refused the token (HTTP {status} {message(wf)}): it needs actions:write on {a.repo}")
        if status == 404:
            raise Failed("preflight", f"workflow {a.workflow} not found in {a.repo} (or the token cannot see the repository): "
                         f"copy smoke/workflow.yaml to .github/workflows/{a.workflow} on {a.ref}")
        if status != 200:
            raise Failed("preflight", f"GET workflow {a.workflow}: HTTP {status} {message(wf)}")
        wf_id = wf["id"]
        say("PASS", f"preflight: cluster reachable, Imp CRDs installed, workflow {wf['path']} (id {wf_id}) in {a.repo}")

        self.watch(f"/apis/imp.dev/v1alpha1/namespaces/{a.pool_namespace}/impvms?watch=1&timeoutSeconds=3600", self.impvms)
        self.watch(f"/apis/events.k8s.io/v1/namespaces/{a.pool_namespace}/events?watch=1&timeoutSeconds=3600", self.events)

        # ---- pool ready
        phase = self.phase = "pool ready"
        pool = kube.json("get", "imprp", a.pool)
        if pool is None:
            if not a.pool_manifest:
                raise Failed(phase, f"pool {a.pool_namespace}/{a.pool} does not exist (pass --pool-manifest FILE to create one)")
            r = kube.run("apply", "-f", a.pool_manifest, check=False)
            if r.returncode != 0:
                raise Failed(phase, f"applying {a.pool_manifest}: {r.stderr.strip()}")
            self.created_pool = True
            pool = kube.json("get", "imprp", a.pool)
            if pool is None:
                raise Failed(phase, f"{a.pool_manifest} has no ImpVMRunnerPool {a.pool}")
            say("PASS", f"pool {a.pool_namespace}/{a.pool} created from {a.pool_manifest} (deleted at the end)")
        if timeline.dig(pool, "metadata.deletionTimestamp"):
            raise Failed(phase, f"pool {a.pool_namespace}/{a.pool} is being deleted")
        labels = timeline.dig(pool, "spec.github.labels") or []
        for job_labels in workflow_labels(a.workflow_file):
            if not pool_serves(job_labels, labels):
                have = {x.lower() for x in labels} | DEFAULT_RUNNER_LABELS
                missing = [x for x in job_labels if x.lower() not in have]
                raise Failed(phase, f"pool {a.pool} labels {sorted(labels)} do not cover runs-on {job_labels} of {a.workflow_file} (missing {missing})")
        min_idle = int(timeline.dig(pool, "spec.scaling.minIdle") or 0)

        def pool_state():
            p = kube.json("get", "imprp", a.pool) or {}
            c = condition(p, "CredentialsValid") or {}
            vms = pool_vms(kube, a.pool)
            return p, c, vms

        def explain_pool():
            try:
                p, c, vms = pool_state()
            except OSError as e:
                return str(e)
            st = p.get("status", {})
            return (f"pool {a.pool}: CredentialsValid={c.get('status', 'unset')} ({c.get('reason', '')}: {c.get('message', '')}), "
                    f"idle {st.get('idle', 0)}, busy {st.get('busy', 0)}, booting {st.get('booting', 0)} of minIdle {min_idle}; "
                    f"VMs: {vm_summary(vms)}; recent Events: {self.recent_events()}")

        def pool_ready():
            p, c, vms = pool_state()
            if c.get("status") == "False":
                raise Failed(phase, f"GitHub refused the pool's credentials: {c.get('reason')}: {c.get('message')}")
            idle = idle_started(vms)
            return idle if len(idle) >= min_idle and (min_idle > 0 or c) else None

        idle_before = wait(phase, a.timeout, pool_ready, explain_pool)
        known_vms = {vm["metadata"]["name"] for vm in pool_vms(kube, a.pool)}
        say("PASS", f"pool ready: {a.pool_namespace}/{a.pool} with {len(idle_before)} idle runner(s) started (minIdle {min_idle})")

        # ---- dispatch
        phase = self.phase = "dispatch"
        t_dispatch = time.time()
        body = {"ref": a.ref, "return_run_details": True}
        status, v = gh.call("POST", f"/actions/workflows/{wf_id}/dispatches", body)
        run_id = None
        if status in (400, 422) and "return_run_details" in message(v):
            # Older GitHub Enterprise Server: the classic 204, and the run is found by time below.
            del body["return_run_details"]
            status, v = gh.call("POST", f"/actions/workflows/{wf_id}/dispatches", body)
        if status == 200 and isinstance(v, dict):
            run_id = v.get("workflow_run_id")
        elif status != 204:
            raise Failed(phase, f"POST dispatches answered HTTP {status}: {message(v)}")
        say("PASS", f"dispatch: workflow_dispatch of {a.workflow} on {a.ref} accepted (HTTP {status})")

        # ---- job queued
        phase = self.phase = "job queued"

        def find_run():
            if run_id:
                return gh.get(f"/actions/runs/{run_id}")
            runs = gh.get(f"/actions/workflows/{wf_id}/runs?event=workflow_dispatch&per_page=20")
            for r in runs.get("workflow_runs", []):
                created = timeline.parse_time(r.get("created_at"))
                # GitHub's times have one-second resolution; allow for clock skew.
                if created is not None and created >= t_dispatch - 30:
                    return r
            return None

        run = wait(phase, a.timeout, find_run, lambda: f"no run of {a.workflow} created by the dispatch")
        run_id = run["id"]

        def find_job():
            jobs = gh.get(f"/actions/runs/{run_id}/jobs").get("jobs", [])
            return jobs[0] if jobs else None

        job = wait(phase, a.timeout, find_job, lambda: f"run {run_id} has no job")
        job_id = job["id"]
        say("PASS", f"job queued: run {run_id}, job {job_id} ({job.get('name')}) with labels {job.get('labels')}")

        # ---- job picked up
        phase = self.phase = "job picked up"

        def picked():
            j = gh.get(f"/actions/jobs/{job_id}")
            if j.get("status") in ("in_progress", "completed") and j.get("runner_name"):
                return j
            return None

        job = wait(phase, a.timeout, picked,
                   lambda: f"job {job_id} still {self.job_status(gh, job_id)}: no runner of the pool took it; {explain_pool()}")
        runner = job["runner_name"]
        vm = wait(phase, 30, lambda: vm_of_runner(self.impvms, runner),
                  lambda: f"runner {runner} that took job {job_id} is no ImpVM of {a.pool_namespace} (a runner outside the pool took the job)")
        secret = None
        seen = timeline.first_seen(self.impvms, vm, "spec.runnerConfigSecret")
        if seen:
            secret = seen[1]
        say("PASS", f"job picked up: job {job_id} by runner {runner} on ImpVM {vm}")

        # ---- job done
        phase = self.phase = "job done"

        def done():
            j = gh.get(f"/actions/jobs/{job_id}")
            return j if j.get("status") == "completed" else None

        job = wait(phase, a.timeout, done, lambda: f"job {job_id} still {self.job_status(gh, job_id)} on {vm} ({self.vm_state(vm)})")
        if job.get("conclusion") != "success":
            raise Failed(phase, f"job {job_id} concluded {job.get('conclusion')} on {vm} ({self.vm_state(vm)})")
        say("PASS", f"job done: job {job_id} completed with conclusion success")

        # ---- torn down
        phase = self.phase = "torn down"

        def gone():
            if kube.json("get", "impvm", vm) is not None:
                return None
            if secret and kube.json("get", "secret", secret) is not None:
                return None
            return True

        wait(phase, a.timeout, gone, lambda: f"ImpVM {vm} ({self.vm_state(vm)}) or its Secret {secret} still exists")
        say("PASS", f"torn down: ImpVM {vm} and its JIT Secret {secret or '(none recorded)'} are gone")

        # ---- replaced
        phase = self.phase = "replaced"

        def replenished():
            idle = idle_started(pool_vms(kube, a.pool))
            new = [n for n in idle if n not in known_vms]
            if len(idle) >= min_idle and (min_idle == 0 or new):
                return new or ["(minIdle 0: none needed)"]
            return None

        new = wait(phase, a.timeout, replenished, explain_pool)
        replacement = new[0] if min_idle > 0 else None
        say("PASS", f"replaced: the pool is back to minIdle {min_idle}" + (f"; new runner {replacement}" if replacement else ""))

        # ---- timeline
        phase = self.phase = "timeline"
        jobs_file = os.path.join(self.work, "jobs.json")
        with open(jobs_file, "w", encoding="utf-8") as f:
            json.dump([job], f)
        os.makedirs(os.path.dirname(os.path.abspath(a.report)), exist_ok=True)
        # The timeline is kubectl-imp's (the same computation as `kubectl imp timeline`), from the
        # recorded watch streams. The operator's and runtime's metrics are not read through the cluster
        # API: "webhook accepted" and "rootfs ready" are left out; every other phase must be there.
        cmd = [a.kubectl_imp, "timeline", vm, "--impvms", self.impvms, "--events", self.events,
               "--jobs", jobs_file, "--job", str(job_id), "--out", a.report,
               "--path", f"cluster ({a.context or 'current context'})"]
        if replacement:
            cmd += ["--replacement", replacement]
        shown = subprocess.run(cmd, capture_output=True, text=True)
        if not os.path.exists(a.report):
            raise Failed(phase, f"{a.kubectl_imp} timeline: {shown.stderr.strip()}")
        print(shown.stdout, end="")
        not_observable = {"webhook_accepted", "rootfs_ready"}
        if min_idle == 0:
            not_observable.add("replaced")
        with open(a.report, encoding="utf-8") as f:
            rep = json.load(f)
        missing = [ph["label"] for ph in rep["phases"] if ph["at"] is None and ph["phase"] not in not_observable]
        rep["not_observable_from_the_cluster"] = sorted(not_observable)
        rep["run_id"] = run_id
        with open(a.report, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=2)
        if missing:
            raise Failed(phase, "phases never seen: " + ", ".join(missing))
        print("(not observable through the cluster API: webhook accepted, rootfs ready: they are the operator's and imp-runtime's metrics)")
        say("PASS", f"timeline: every phase seen (JSON in {a.report})")

    def job_status(self, gh, job_id):
        try:
            return gh.get(f"/actions/jobs/{job_id}").get("status")
        except OSError as e:
            return f"unknown ({e})"

    def vm_state(self, vm):
        try:
            o = self.kube.json("get", "impvm", vm)
        except OSError as e:
            return str(e)
        if o is None:
            return "deleted"
        st = o.get("status", {})
        return f"{st.get('phase')}/{st.get('reason', '')}: {st.get('message', '')}; handoff {timeline.dig(st, 'runner.handoff')}"

    def recent_events(self, n=4):
        out = []
        for r in timeline.records(self.events):
            o = r.get("object", {})
            out.append(f"{timeline.dig(o, 'regarding.kind')}/{timeline.dig(o, 'regarding.name')} {o.get('reason')}: {o.get('note')}")
        return "; ".join(out[-n:]) or "none"


def vm_summary(vms):
    return " ".join(
        f"{vm['metadata']['name']}={timeline.dig(vm, 'status.phase')}/{timeline.dig(vm, 'status.runner.handoff')}"
        + ("(deleting)" if vm["metadata"].get("deletionTimestamp") else "")
        for vm in vms
    ) or "none"


if __name__ == "__main__":
    sys.exit(main())
