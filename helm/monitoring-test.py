#!/usr/bin/env python3
"""Proves the chart's Grafana dashboards and alert rules (`make monitoring`).

1. Every PromQL expression of every dashboard panel (helm/imp/dashboards/*.json) and alert rule
   (helm/imp/alerts/imp-alerts.yaml) parses (`promtool check rules`) and names only metrics listed in
   docs/metrics.md; the dashboards have the datasource, namespace, pool and node variables.
2. `promtool test rules helm/alerts.test.yaml`.
3. A real Prometheus (Debian's, on 127.0.0.1 of the smoke's own network namespace, data in a temp dir) scrapes the processes of a local smoke
   run (smoke/imp-smoke.sh --local with IMP_SMOKE_TARGETS_DIR); every panel must return at least one
   finite value, and every variable query at least one label value. A panel that returns nothing fails
   the test with its title. The table of panels, queries and values is printed.

Needs Debian's `prometheus` package: IMP_INSTALL_DEPS=1 installs it with apt. Without it the test prints a
SKIPPED line and exits 0, unless IMP_REQUIRE_PROMETHEUS=1 makes that a failure. IMP_MONITORING_STATIC=1 runs
steps 1 and 2 only (no smoke run).
"""

import concurrent.futures
import ctypes
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS = REPO / "helm/imp/dashboards"
ALERTS = REPO / "helm/imp/alerts/imp-alerts.yaml"
ALERT_TESTS = REPO / "helm/alerts.test.yaml"
METRICS_DOC = REPO / "docs/metrics.md"
REQUIRED_VARIABLES = ("datasource", "namespace", "pool", "node")
PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
    "unless", "inf", "nan", "atan2",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


class Failure(Exception):
    pass


# setns(2): the network namespace flag.
CLONE_NEWNET = 0x40000000


def log(msg):
    print(f"monitoring-test: {msg}", flush=True)


def require_prometheus():
    """The paths of promtool and prometheus, installing Debian's package when IMP_INSTALL_DEPS=1."""
    def found():
        return shutil.which("promtool"), shutil.which("prometheus")
    promtool, prometheus = found()
    if not (promtool and prometheus) and os.environ.get("IMP_INSTALL_DEPS") == "1":
        log("installing Debian's prometheus package (IMP_INSTALL_DEPS=1)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"],
                       check=True, env=env)
        promtool, prometheus = found()
    if promtool and prometheus:
        return promtool, prometheus
    msg = ("SKIPPED the dashboard and alert tests: promtool/prometheus not on PATH (Debian package "
           "prometheus; IMP_INSTALL_DEPS=1 installs it) (IMP_REQUIRE_PROMETHEUS=1 makes this a failure)")
    if os.environ.get("IMP_REQUIRE_PROMETHEUS") == "1":
        raise Failure(msg.replace("SKIPPED", "IMP_REQUIRE_PROMETHEUS=1 but cannot run", 1))
    print(msg, flush=True)
    sys.exit(0)


def documented_metrics():
    """Sample names docs/metrics.md lists (first column of its tables), with their types."""
    out = {}
    for line in METRICS_DOC.read_text().splitlines():
        m = re.match(r"^\| `([a-z_:][a-z0-9_:]*)` \| (\w+) \|", line)
        if m:
            out[m.group(1)] = m.group(2)
    if not out:
        raise Failure(f"{METRICS_DOC}: no metric table rows found")
    return out


def metric_names(expr):
    """The metric names an expression selects: identifiers outside label matchers, ranges, strings and
    grouping clauses that are not function calls or keywords."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_KEYWORDS:
            continue
        names.add(word)
    return names


def undocumented(expr, docs):
    bad = []
    for name in sorted(metric_names(expr)):
        if name in docs:
            continue
        base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        if base and docs.get(base) == "histogram":
            continue
        bad.append(name)
    return bad


def substitute(expr, rate_interval):
    """Grafana's variables as the dashboard's "All" selection and a rate window."""
    e = expr.replace("$__rate_interval", rate_interval)
    for v in ("namespace", "pool", "node"):
        e = e.replace(f"${v}", ".*")
    return e


def load_dashboards():
    """[(dashboard file, panel title, [(refId, expr)])] and the variable queries, per dashboard."""
    panels, variables = [], []
    files = sorted(DASHBOARDS.glob("*.json"))
    if not files:
        raise Failure(f"no dashboards in {DASHBOARDS}")
    for f in files:
        try:
            dash = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise Failure(f"{f}: {e}")
        names = [v.get("name") for v in dash.get("templating", {}).get("list", [])]
        missing = [v for v in REQUIRED_VARIABLES if v not in names]
        if missing:
            raise Failure(f"{f.name}: missing dashboard variables {missing}")
        for v in dash["templating"]["list"]:
            if v["type"] == "query":
                q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
                variables.append((f.name, v["name"], q))
        for p in dash.get("panels", []):
            if p.get("type") == "row":
                continue
            if p.get("datasource", {}).get("uid") != "${datasource}":
                raise Failure(f"{f.name}: panel {p['title']!r} does not use the $datasource variable")
            targets = [(t["refId"], t["expr"]) for t in p.get("targets", [])]
            if not targets:
                raise Failure(f"{f.name}: panel {p['title']!r} has no query")
            panels.append((f.name, p["title"], targets))
    return panels, variables


def label_values_query(q):
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip())
    if not m:
        raise Failure(f"variable query {q!r} is not label_values(selector, label)")
    return m.group(1), m.group(2)


def check_static(promtool, panels, variables, docs, work):
    errors = []
    groups = []
    for dash, title, targets in panels:
        for ref, expr in targets:
            bad = undocumented(expr, docs)
            if bad:
                errors.append(f"{dash}: panel {title!r} query {ref} names metrics not in docs/metrics.md: {bad}")
            groups.append((f"{dash}: {title} / {ref}", substitute(expr, "5m")))
    for dash, name, q in variables:
        selector, _ = label_values_query(q)
        bad = undocumented(selector, docs)
        if bad:
            errors.append(f"{dash}: variable {name} names metrics not in docs/metrics.md: {bad}")
        groups.append((f"{dash}: variable {name}", substitute(selector, "5m")))
    alert_exprs = re.findall(r"^\s+expr: (?:\|\n\s+)?(.+)$", ALERTS.read_text(), re.M)
    if not alert_exprs:
        raise Failure(f"{ALERTS}: no expr found")
    for expr in alert_exprs:
        bad = undocumented(expr, docs)
        if bad:
            errors.append(f"{ALERTS.name}: alert expression {expr!r} names metrics not in docs/metrics.md: {bad}")
    # One recording rule per query, in a group named by its panel: promtool names the group of a query
    # that does not parse.
    rules = work / "dashboard-queries.rules.json"
    rules.write_text(json.dumps({"groups": [
        {"name": name, "rules": [{"record": "imp_dashboard_query", "expr": expr}]} for name, expr in groups
    ]}))
    for path in (rules, ALERTS):
        r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        if r.returncode != 0:
            errors.append(f"promtool check rules {path.name}:\n{r.stdout}{r.stderr}")
    r = subprocess.run([promtool, "test", "rules", ALERT_TESTS.name], cwd=ALERT_TESTS.parent,
                       capture_output=True, text=True)
    if r.returncode != 0:
        errors.append(f"promtool test rules {ALERT_TESTS.name}:\n{r.stdout}{r.stderr}")
    if errors:
        raise Failure("\n".join(errors))
    log(f"{sum(len(t) for _, _, t in panels)} dashboard queries in {len(panels)} panels and "
        f"{len(alert_exprs)} alert rules parse and name only documented metrics; promtool test rules passed")


def check_chart():
    """The chart renders each dashboard into a grafana_dashboard ConfigMap by default and the alert rules
    into a PrometheusRule when asked."""
    helm = REPO / "testenv/bin/helm"
    seed = REPO / "reference/seed-examples/helm-values-seed.yaml"
    def render(*args):
        r = subprocess.run([str(helm), "template", "imp", str(REPO / "helm/imp"), "-f", str(seed), *args],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise Failure(f"helm template {' '.join(args)}: {r.stderr}")
        return r.stdout
    default = render()
    for f in sorted(DASHBOARDS.glob("*.json")):
        if f'grafana_dashboard: "1"' not in default or f"  {f.name}: |-" not in default:
            raise Failure(f"the chart does not render {f.name} into a grafana_dashboard ConfigMap by default")
    if "kind: PrometheusRule" in default:
        raise Failure("the PrometheusRule renders although metrics.prometheusRule.enabled is false by default")
    rules = render("--set", "metrics.prometheusRule.enabled=true")
    for alert in re.findall(r"- alert: (\w+)", ALERTS.read_text()):
        if f"- alert: {alert}" not in rules.split("kind: PrometheusRule", 1)[-1]:
            raise Failure(f"the PrometheusRule does not carry alert {alert}")
    if f'grafana_dashboard: "1"' in render("--set", "metrics.dashboards.enabled=false"):
        raise Failure("metrics.dashboards.enabled=false still renders dashboards")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url):
    def get():
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)
    return in_smoke_ns(get)


def query(base, expr):
    data = get_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    if data.get("status") != "success":
        raise Failure(f"query {expr!r}: {data}")
    return data["data"]["result"]


def wait_for(what, secs, pred, procs):
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        for name, p in procs.items():
            if p.poll() is not None:
                raise Failure(f"{name} exited with {p.returncode} while waiting for {what}")
        if pred():
            return
        time.sleep(0.5)
    raise Failure(f"timed out after {secs}s waiting for {what}")


def stop(p):
    """SIGTERM to the process group the test started (start_new_session), SIGKILL after 20 s."""
    if p.poll() is not None:
        return
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def enter_netns(name):
    """Moves the calling thread (setns is per thread) into the named network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


# The smoke's processes listen on the 127.0.0.1 of the smoke's own network namespace, so Prometheus and
# the queries run there: on one worker thread that entered it (Prometheus, started from that thread,
# inherits it). The process itself stays outside: the smoke kills whatever is left in its namespace.
IN_SMOKE_NS = None


def in_smoke_ns(fn, *args, **kwargs):
    return IN_SMOKE_NS.submit(fn, *args, **kwargs).result() if IN_SMOKE_NS else fn(*args, **kwargs)


def check_live(prometheus, panels, variables, work):
    global IN_SMOKE_NS
    targets = work / "targets"
    targets.mkdir()
    port = free_port()
    (work / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "imp-smoke",
                            "file_sd_configs": [{"files": [str(targets / "*.json")], "refresh_interval": "1s"}]}],
    }))
    procs = {}
    started = time.time()
    prom_log = open(work / "prometheus.log", "w")
    smoke_log = open(work / "smoke.log", "w")
    try:
        log("starting smoke/imp-smoke.sh --local --guest simulated (the panels need the control plane's metrics, not a real boot)")
        procs["smoke"] = subprocess.Popen(
            [str(REPO / "smoke/imp-smoke.sh"), "--local", "--guest", "simulated"], cwd=REPO,
            env=dict(os.environ, IMP_SMOKE_TARGETS_DIR=str(targets)),
            stdout=smoke_log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for("the smoke's network namespace (smoke.log)", 900, (targets / "netns").exists, procs)
        IN_SMOKE_NS = concurrent.futures.ThreadPoolExecutor(
            1, initializer=enter_netns, initargs=((targets / "netns").read_text().strip(),))
        procs["prometheus"] = in_smoke_ns(
            subprocess.Popen,
            [prometheus, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=prom_log, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{port}"

        def ready():
            try:
                return get_json(f"{base}/api/v1/status/buildinfo")["status"] == "success"
            except (OSError, ValueError):
                return False
        wait_for("Prometheus ready", 60, ready, procs)
        log(f"Prometheus {base} up in the smoke's network namespace")
        (targets / "scraper-ready").touch()
        def discovered_then_holding():
            # The smoke starts its processes once Prometheus has discovered all three targets.
            if not (targets / "targets-seen").exists():
                try:
                    if len(get_json(f"{base}/api/v1/targets")["data"]["activeTargets"]) == 3:
                        (targets / "targets-seen").touch()
                except (OSError, ValueError, KeyError):
                    pass
            return (targets / "holding").exists()
        wait_for("the smoke run to reach its hold (smoke.log)", 900, discovered_then_holding, procs)

        def all_up():
            active = get_json(f"{base}/api/v1/targets")["data"]["activeTargets"]
            return len(active) == 3 and all(t["health"] == "up" for t in active)
        wait_for("Prometheus scraping operator, agent and runtime", 30, all_up, procs)
        def evaluate():
            rate_interval = f"{int(time.time() - started) + 60}s"
            rows, empty = [], []
            for dash, title, tgts in panels:
                finite = False
                for ref, expr in tgts:
                    result = query(base, substitute(expr, rate_interval))
                    values = []
                    for s in result:
                        v = float(s["value"][1])
                        finite |= math.isfinite(v)
                        labels = ",".join(f"{k}={v2}" for k, v2 in sorted(s["metric"].items()))
                        values.append(f"{{{labels}}} {s['value'][1]}")
                    rows.append((title, ref, expr, "; ".join(values) if values else "(no series)"))
                if not finite:
                    empty.append(title)
            for dash, name, q in variables:
                selector, label = label_values_query(q)
                result = query(base, f"count by ({label}) ({substitute(selector, rate_interval)})")
                got = sorted(s["metric"].get(label, "") for s in result if s["metric"].get(label))
                rows.append((f"variable {name}", "-", q, ", ".join(got) if got else "(no values)"))
                if not got:
                    empty.append(f"variable {name}")
            return rows, empty

        # Gauges are refreshed periodically (the operator's every 10 s): evaluate until every panel has
        # data or 45 s have passed.
        deadline = time.monotonic() + 45
        while True:
            time.sleep(3)
            rows, empty = evaluate()
            if not empty or time.monotonic() > deadline:
                break
        print("\n| Panel | Query | Expression | Value in the smoke run |\n|---|---|---|---|")
        for title, ref, expr, value in rows:
            print(f"| {title} | {ref} | `{expr}` | {value} |")
        print(flush=True)
        if empty:
            raise Failure("panels returned no finite value against the smoke run: " + "; ".join(empty))
        # Prometheus runs in the smoke's namespace: it stops before the smoke's leak check.
        stop(procs.pop("prometheus"))
        (targets / "release").touch()
        code = procs["smoke"].wait(120)
        if code != 0:
            raise Failure(f"smoke run exited {code}:\n" + (work / "smoke.log").read_text()[-3000:])
        log(f"all {len(panels)} panels and {len(variables)} variables returned data from a real smoke run")
    except BaseException:
        for name in ("smoke.log", "prometheus.log"):
            text = (work / name).read_text()
            print(f"--- {name} (last lines)\n{text[-2500:]}", file=sys.stderr)
        raise
    finally:
        # Released, the smoke run finishes its last stage and removes its work dir itself.
        if "prometheus" in procs:
            stop(procs.pop("prometheus"))
        (targets / "release").touch()
        if "smoke" in procs:
            try:
                procs["smoke"].wait(120)
            except subprocess.TimeoutExpired:
                pass
        for p in procs.values():
            stop(p)
        if IN_SMOKE_NS:
            IN_SMOKE_NS.shutdown()
            IN_SMOKE_NS = None
        prom_log.close()
        smoke_log.close()


def main():
    promtool, prometheus = require_prometheus()
    docs = documented_metrics()
    panels, variables = load_dashboards()
    with tempfile.TemporaryDirectory(prefix="imp-monitoring.") as tmp:
        work = Path(tmp)
        check_static(promtool, panels, variables, docs, work)
        check_chart()
        if os.environ.get("IMP_MONITORING_STATIC") == "1":
            log("IMP_MONITORING_STATIC=1: the live check against a smoke run is not run")
            return
        check_live(prometheus, panels, variables, work)


if __name__ == "__main__":
    try:
        main()
    except Failure as e:
        print(f"monitoring-test: FAIL {e}", file=sys.stderr)
        sys.exit(1)
