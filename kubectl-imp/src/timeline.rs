//! Every phase of one runner VM with its time and where that time comes from: the one computation behind
//! `kubectl imp timeline VM` (the VM as the API server has it now, with its Events) and the smoke's
//! timeline (smoke/imp-smoke.sh and smoke/cluster.py record every version of the VM as a watch stream,
//! so a phase is seen the moment the API server had it, also for a VM the pool deleted moments later).
//!
//! Kubernetes' own timestamps have one-second resolution; each phase keeps that value (`api`) beside
//! the time it was seen (`at`, Unix seconds). Without a recording, `at` is the API value itself.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use crate::time::{format_hms, parse_time, rfc3339};

/// One recorded version of an object: when it was seen (absent for a live read) and whether the watch
/// reported its deletion.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub t: Option<f64>,
    pub deleted: bool,
    pub object: Value,
}

impl Seen {
    /// The object as read now.
    pub fn live(object: Value) -> Self {
        Self {
            t: None,
            deleted: false,
            object,
        }
    }

    /// One line of a recording (`{"type", "object", "t"}`, as smoke/timeline.py's `watch` writes).
    pub fn from_record(line: &Value) -> Option<Self> {
        Some(Self {
            t: line.get("t").and_then(Value::as_f64),
            deleted: line.get("type").and_then(Value::as_str) == Some("DELETED"),
            object: line.get("object")?.clone(),
        })
    }
}

/// What the timeline is computed from.
#[derive(Debug, Default)]
pub struct Inputs<'a> {
    pub vm: &'a str,
    /// The VM the pool started in its place (the smoke's last phase).
    pub replacement: Option<&'a str>,
    /// Versions of the VM (and of the replacement), oldest first.
    pub impvms: &'a [Seen],
    /// events.k8s.io/v1 Events, as objects.
    pub events: &'a [Value],
    /// The job as GitHub reports it (`created_at`, `started_at`, `completed_at`), when known.
    pub job: Option<&'a Value>,
    pub job_id: Option<&'a str>,
    /// When the operator's metrics first counted an accepted webhook (the smoke's observation).
    pub accepted_at: Option<f64>,
    /// `imp_rootfs_build_duration_seconds_sum` of the node's runtime.
    pub rootfs_build_s: Option<f64>,
    /// Which guest path ran (the smoke's report names it).
    pub path: Option<&'a str>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Phase {
    pub phase: &'static str,
    pub label: String,
    pub at: Option<f64>,
    pub api: Option<Value>,
    pub source: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_start_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_s: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventLine {
    pub object: String,
    pub reason: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    #[serde(rename = "eventTime")]
    pub event_time: Option<String>,
    pub note: Option<String>,
}

/// The timeline: the phases seen in time order, then those never seen.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timeline {
    pub path: Option<String>,
    pub vm: String,
    pub replacement: Option<String>,
    pub job: Option<String>,
    pub started: Option<String>,
    pub pickup_latency_s: Option<f64>,
    pub phases: Vec<Phase>,
    pub events: Vec<EventLine>,
}

/// The value at a dotted path of a JSON object.
pub fn dig<'v>(obj: &'v Value, dotted: &str) -> Option<&'v Value> {
    dotted
        .split('.')
        .try_fold(obj, |o, key| o.as_object()?.get(key))
        .filter(|v| !v.is_null())
}

fn name_of(obj: &Value) -> Option<&str> {
    dig(obj, "metadata.name").and_then(Value::as_str)
}

/// The time of `api` when it is a timestamp string.
fn api_time(api: &Value) -> Option<f64> {
    api.as_str().and_then(parse_time)
}

/// (time, value) of the first version of `name` with `dotted` set.
fn first_seen(impvms: &[Seen], name: &str, dotted: &str) -> Option<(f64, Value)> {
    impvms
        .iter()
        .filter(|s| name_of(&s.object) == Some(name))
        .find_map(|s| {
            let v = dig(&s.object, dotted)?.clone();
            Some((s.t.or_else(|| api_time(&v))?, v))
        })
}

fn condition_true(impvms: &[Seen], name: &str, kind: &str) -> Option<(f64, Value)> {
    impvms
        .iter()
        .filter(|s| name_of(&s.object) == Some(name))
        .find_map(|s| {
            let conditions = dig(&s.object, "status.conditions")?.as_array()?;
            let c = conditions.iter().find(|c| {
                c.get("type").and_then(Value::as_str) == Some(kind)
                    && c.get("status").and_then(Value::as_str) == Some("True")
            })?;
            let api = c.get("lastTransitionTime").cloned().unwrap_or(Value::Null);
            Some((s.t.or_else(|| api_time(&api))?, api))
        })
}

fn deleted(impvms: &[Seen], name: &str) -> Option<(f64, Value)> {
    impvms
        .iter()
        .find(|s| s.deleted && name_of(&s.object) == Some(name))
        .and_then(|s| {
            let api = dig(&s.object, "metadata.deletionTimestamp")
                .cloned()
                .unwrap_or(Value::Null);
            Some((s.t.or_else(|| api_time(&api))?, api))
        })
}

/// Sum of the samples of one metric (every label set) in a Prometheus text exposition.
pub fn metric_sum(exposition: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = exposition
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (head, value) = l.rsplit_once(' ')?;
            (head.split('{').next() == Some(name)).then(|| value.parse().ok())?
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The timeline of `inputs.vm`.
pub fn compute(inputs: &Inputs) -> Timeline {
    let vm = inputs.vm;
    let iv = inputs.impvms;
    let mut phases = Vec::new();
    let mut add = |phase: &'static str, label: &str, seen: Option<(f64, Value)>, source: &str| {
        let (at, api) = seen.map_or((None, None), |(at, api)| (Some(at), Some(api)));
        phases.push(Phase {
            phase,
            label: label.to_owned(),
            at,
            api,
            source: source.to_owned(),
            since_start_s: None,
            duration_s: None,
        });
    };
    let job_time = |field: &str| {
        let v = inputs.job?.get(field)?;
        Some((api_time(v)?, v.clone()))
    };
    let status = |path: &str| first_seen(iv, vm, path);
    add(
        "vm_created",
        "VM created",
        status("metadata.creationTimestamp"),
        "ImpVM metadata.creationTimestamp",
    );
    add(
        "jit_minted",
        "JIT config minted",
        status("spec.runnerConfigSecret"),
        "ImpVM spec.runnerConfigSecret",
    );
    add(
        "scheduled",
        "scheduled",
        status("status.scheduledTime"),
        "ImpVM status.scheduledTime",
    );
    let boot = status("status.bootStartTime");
    let rootfs = match (&boot, inputs.rootfs_build_s) {
        (Some((at, _)), Some(build)) => Some((
            at + build,
            Value::from(format!("bootStartTime + {build:.3}s")),
        )),
        _ => None,
    };
    add(
        "boot_started",
        "boot started",
        boot,
        "ImpVM status.bootStartTime",
    );
    add(
        "rootfs_ready",
        "rootfs ready",
        rootfs,
        "bootStartTime + imp_rootfs_build_duration_seconds_sum",
    );
    add(
        "guest_hello",
        "guest Hello",
        status("status.bootCompleteTime"),
        "ImpVM status.bootCompleteTime",
    );
    add(
        "runner_started",
        "runner started",
        status("status.runner.startedTime"),
        "ImpVM status.runner.startedTime",
    );
    // Without GitHub's record of the job, the times the operator put on status.job stand in.
    let served = |path: &str, field: &str| job_time(field).or_else(|| status(path));
    let (queued_src, picked_src, done_src) = if inputs.job.is_some() {
        (
            "GitHub job created_at",
            "GitHub job started_at",
            "GitHub job completed_at",
        )
    } else {
        (
            "ImpVM status.job.queuedTime",
            "ImpVM status.job.pickedUpTime",
            "ImpVM status.job.completedTime",
        )
    };
    add(
        "job_queued",
        "job queued (webhook sent)",
        served("status.job.queuedTime", "created_at"),
        queued_src,
    );
    let accepted = inputs.accepted_at.map(|t| {
        (
            t,
            Value::from("imp_webhook_deliveries_total{result=accepted} >= 1"),
        )
    });
    add(
        "webhook_accepted",
        "webhook accepted",
        accepted,
        "operator metric, first seen",
    );
    add(
        "job_picked_up",
        "job picked up",
        served("status.job.pickedUpTime", "started_at"),
        picked_src,
    );
    add(
        "job_done",
        "job done",
        served("status.job.completedTime", "completed_at"),
        done_src,
    );
    add(
        "runner_exited",
        "runner exited",
        status("status.runner.exitedTime"),
        "ImpVM status.runner.exitedTime",
    );
    add(
        "torn_down",
        "torn down",
        condition_true(iv, vm, imp_api::names::condition::TORN_DOWN),
        "ImpVM condition TornDown=True",
    );
    add(
        "vm_deleted",
        "VM deleted",
        deleted(iv, vm),
        "ImpVM watch DELETED",
    );
    if let Some(repl) = inputs.replacement {
        add(
            "replaced",
            "replaced (new runner started)",
            first_seen(iv, repl, "status.runner.startedTime"),
            &format!("ImpVM {repl} status.runner.startedTime"),
        );
    }

    let (mut known, unknown): (Vec<Phase>, Vec<Phase>) =
        phases.into_iter().partition(|p| p.at.is_some());
    known.sort_by(|a, b| a.at.partial_cmp(&b.at).unwrap_or(std::cmp::Ordering::Equal));
    let start = known.first().and_then(|p| p.at);
    let mut prev = start.unwrap_or(0.0);
    for p in &mut known {
        let at = p.at.unwrap_or(prev);
        p.since_start_s = Some(round3(at - start.unwrap_or(at)));
        p.duration_s = Some(round3(at - prev));
        prev = at;
    }
    let at_of = |key: &str| known.iter().find(|p| p.phase == key).and_then(|p| p.at);
    let pickup_latency_s = match (at_of("job_queued"), at_of("job_picked_up")) {
        (Some(q), Some(p)) => Some(round3(p - q)),
        _ => None,
    };
    let events = inputs
        .events
        .iter()
        .filter(|o| {
            let regarding = dig(o, "regarding.name").and_then(Value::as_str);
            regarding == Some(vm)
                || (regarding.is_some() && regarding == inputs.replacement)
                || dig(o, "regarding.kind").and_then(Value::as_str) == Some("ImpVMRunnerPool")
        })
        .map(|o| {
            let s = |p: &str| dig(o, p).and_then(Value::as_str).map(str::to_owned);
            EventLine {
                object: format!(
                    "{}/{}",
                    s("regarding.kind").unwrap_or_default(),
                    s("regarding.name").unwrap_or_default()
                ),
                reason: s("reason"),
                kind: s("type"),
                event_time: s("eventTime").or_else(|| s("deprecatedLastTimestamp")),
                note: s("note"),
            }
        })
        .collect();
    Timeline {
        path: inputs.path.map(str::to_owned),
        vm: vm.to_owned(),
        replacement: inputs.replacement.map(str::to_owned),
        job: inputs.job_id.map(str::to_owned),
        started: start.map(rfc3339),
        pickup_latency_s,
        phases: known.into_iter().chain(unknown).collect(),
        events,
    }
}

impl Timeline {
    /// Labels of the phases never seen.
    pub fn missing(&self) -> Vec<&str> {
        self.phases
            .iter()
            .filter(|p| p.at.is_none())
            .map(|p| p.label.as_str())
            .collect()
    }

    /// The phase table (the smoke prints it after its stages).
    pub fn table(&self) -> String {
        let mut rows = vec![[
            "PHASE".to_owned(),
            "AT (UTC)".to_owned(),
            "SINCE START".to_owned(),
            "DURATION".to_owned(),
            "SOURCE".to_owned(),
        ]];
        for p in self.phases.iter().filter(|p| p.at.is_some()) {
            rows.push([
                p.label.clone(),
                p.at.map(format_hms).unwrap_or_default(),
                format!("{:.3}s", p.since_start_s.unwrap_or_default()),
                format!("{:.3}s", p.duration_s.unwrap_or_default()),
                p.source.clone(),
            ]);
        }
        let mut out = crate::output::columns(&rows);
        if let Some(l) = self.pickup_latency_s {
            out.push_str(&format!(
                "pickup latency (job queued -> picked up): {l:.3}s\n"
            ));
        }
        out
    }
}

/// Parses a recording (one JSON line per watch event; unparsable lines, such as a cut last line, are
/// skipped).
pub fn parse_record(text: &str) -> Vec<Seen> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| Seen::from_record(&v))
        .collect()
}

/// The objects of a recording of Events (their last version per name).
pub fn events_of_record(seen: &[Seen]) -> Vec<Value> {
    let mut last: BTreeMap<String, Value> = BTreeMap::new();
    let mut order = Vec::new();
    for s in seen {
        let key = name_of(&s.object).unwrap_or_default().to_owned();
        if !last.contains_key(&key) {
            order.push(key.clone());
        }
        last.insert(key, s.object.clone());
    }
    order.into_iter().filter_map(|k| last.remove(&k)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vm(name: &str, status: Value) -> Value {
        json!({"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"},
               "spec": {"runnerConfigSecret": "jit-1"}, "status": status})
    }

    fn seen(t: f64, obj: Value) -> Seen {
        Seen {
            t: Some(t),
            deleted: false,
            object: obj,
        }
    }

    #[test]
    fn recorded_versions_give_the_time_each_field_was_first_seen() {
        let t0 = parse_time("2026-01-01T00:00:00Z").unwrap();
        let versions = [
            seen(t0 + 0.2, vm("a", json!({}))),
            seen(
                t0 + 1.5,
                vm("a", json!({"scheduledTime": "2026-01-01T00:00:01Z"})),
            ),
            seen(
                t0 + 4.0,
                vm(
                    "a",
                    json!({"scheduledTime": "2026-01-01T00:00:01Z",
                               "bootStartTime": "2026-01-01T00:00:02Z",
                               "bootCompleteTime": "2026-01-01T00:00:04Z"}),
                ),
            ),
            Seen {
                t: Some(t0 + 9.0),
                deleted: true,
                object: vm("a", json!({})),
            },
        ];
        let tl = compute(&Inputs {
            vm: "a",
            impvms: &versions,
            rootfs_build_s: Some(1.25),
            ..Default::default()
        });
        let at = |k: &str| tl.phases.iter().find(|p| p.phase == k).unwrap().at;
        assert_eq!(at("vm_created"), Some(t0 + 0.2));
        assert_eq!(at("scheduled"), Some(t0 + 1.5));
        assert_eq!(at("rootfs_ready"), Some(t0 + 5.25));
        assert_eq!(at("vm_deleted"), Some(t0 + 9.0));
        assert_eq!(at("job_picked_up"), None);
        // Seen phases first, in time order, each with its duration since the one before.
        let seen: Vec<_> = tl.phases.iter().take_while(|p| p.at.is_some()).collect();
        assert!(seen.windows(2).all(|w| w[0].at <= w[1].at));
        let hello = seen.iter().find(|p| p.phase == "guest_hello").unwrap();
        assert_eq!(hello.since_start_s, Some(3.8));
        assert!(tl.missing().contains(&"job picked up"));
    }

    #[test]
    fn a_live_read_uses_the_api_timestamps_and_the_served_job() {
        let obj = vm(
            "a",
            json!({"scheduledTime": "2026-01-01T00:00:02Z",
                   "job": {"jobId": 7, "queuedTime": "2026-01-01T00:00:01.000000Z",
                           "pickedUpTime": "2026-01-01T00:00:31.500000Z"}}),
        );
        let tl = compute(&Inputs {
            vm: "a",
            impvms: &[Seen::live(obj)],
            ..Default::default()
        });
        assert_eq!(tl.pickup_latency_s, Some(30.5));
        let queued = tl.phases.iter().find(|p| p.phase == "job_queued").unwrap();
        assert_eq!(queued.source, "ImpVM status.job.queuedTime");
        assert_eq!(tl.started.as_deref(), Some("2026-01-01T00:00:00Z"));
    }

    #[test]
    fn github_job_times_win_over_the_served_record() {
        let job =
            json!({"created_at": "2026-01-01T00:00:05Z", "started_at": "2026-01-01T00:00:06Z"});
        let tl = compute(&Inputs {
            vm: "a",
            impvms: &[Seen::live(vm("a", json!({})))],
            job: Some(&job),
            job_id: Some("9"),
            ..Default::default()
        });
        assert_eq!(tl.pickup_latency_s, Some(1.0));
        assert_eq!(tl.job.as_deref(), Some("9"));
    }

    #[test]
    fn events_of_the_vm_its_replacement_and_pools_only() {
        let ev = |kind: &str, name: &str| {
            json!({"metadata": {"name": format!("{name}.1")},
            "regarding": {"kind": kind, "name": name}, "reason": "Booted", "type": "Normal"})
        };
        let events = [
            ev("ImpVM", "a"),
            ev("ImpVM", "b"),
            ev("ImpVM", "other"),
            ev("ImpVMRunnerPool", "p"),
        ];
        let tl = compute(&Inputs {
            vm: "a",
            replacement: Some("b"),
            events: &events,
            ..Default::default()
        });
        let objects: Vec<_> = tl.events.iter().map(|e| e.object.as_str()).collect();
        assert_eq!(objects, ["ImpVM/a", "ImpVM/b", "ImpVMRunnerPool/p"]);
    }

    #[test]
    fn metric_sums_every_label_set_and_ignores_comments() {
        let text = "# HELP x\nx_sum{a=\"1\"} 1.5\nx_sum{a=\"2\"} 2\nx_sum_other 9\n";
        assert_eq!(metric_sum(text, "x_sum"), Some(3.5));
        assert_eq!(metric_sum(text, "y"), None);
    }

    #[test]
    fn a_recording_keeps_parsable_lines_and_deletions() {
        let text = "{\"type\":\"ADDED\",\"object\":{\"metadata\":{\"name\":\"a\"}},\"t\":1.0}\n{\"type\":\"DELETED\",\"object\":{\"metadata\":{\"name\":\"a\"}},\"t\":2.0}\n{cut";
        let r = parse_record(text);
        assert_eq!(r.len(), 2);
        assert!(r[1].deleted && !r[0].deleted);
        assert_eq!(events_of_record(&r).len(), 1);
    }
}
