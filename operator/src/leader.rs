//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's semantics: a candidate takes
//! the Lease when it is free or when its holder has not renewed it for `lease_duration` as measured
//! by the candidate's own clock since it last saw the record change (no clock agreement needed); the
//! leader renews every `retry_period` and stops leading when no renewal succeeded for
//! `renew_deadline`; on shutdown it releases the Lease so a successor takes over at once. Every write
//! carries the `resourceVersion` it read, so two candidates cannot both win a round.
//! (kube-lease-manager 0.12 depends on kube 4; this is the small elector instead.)
//!
//! [`decide`] is the pure decision, [`run_elector`] the thin executor publishing leadership on a
//! `watch` channel.

use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::error::Error;

/// Timing and identity of one candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElectionConfig {
    pub namespace: String,
    /// Name of the Lease.
    pub lease_name: String,
    /// This candidate (the pod name).
    pub identity: String,
    /// A holder silent this long (by our clock) has lost the Lease.
    pub lease_duration: Duration,
    /// The leader stops leading when no renewal succeeded for this long (< `lease_duration`).
    pub renew_deadline: Duration,
    /// Between two attempts to acquire or renew.
    pub retry_period: Duration,
}

impl ElectionConfig {
    /// client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry.
    pub fn new(namespace: &str, lease_name: &str, identity: &str) -> Self {
        ElectionConfig {
            namespace: namespace.to_owned(),
            lease_name: lease_name.to_owned(),
            identity: identity.to_owned(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// What of a Lease the decision reads. `renew_time` is only compared for change, never against our
/// clock.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseRecord {
    pub holder: Option<String>,
    pub renew_time: Option<String>,
    pub lease_duration: Option<Duration>,
    pub transitions: i32,
}

impl LeaseRecord {
    pub fn from_lease(lease: &Lease) -> Self {
        let spec = lease.spec.clone().unwrap_or_default();
        LeaseRecord {
            holder: spec.holder_identity.filter(|h| !h.is_empty()),
            renew_time: spec.renew_time.map(|t| t.0.to_string()),
            lease_duration: spec
                .lease_duration_seconds
                .map(|s| Duration::from_secs(s.max(0) as u64)),
            transitions: spec.lease_transitions.unwrap_or(0),
        }
    }
}

/// The candidate's memory between rounds.
#[derive(Debug, Clone, Default)]
pub struct ElectorState {
    /// The record last read and when (our clock) it last changed.
    pub observed: Option<(LeaseRecord, Instant)>,
    /// Our last successful acquire or renewal.
    pub last_renewed: Option<Instant>,
}

impl ElectorState {
    /// Records a read: the observation time moves only when the record changed.
    pub fn observe(&mut self, record: &LeaseRecord, now: Instant) {
        match &self.observed {
            Some((r, _)) if r == record => {}
            _ => self.observed = Some((record.clone(), now)),
        }
    }
}

/// What to do this round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No Lease yet: create it, held by us.
    Create,
    /// Write ourselves as holder: `renew` when we hold it already (acquire time and transitions
    /// kept), else a takeover (transitions + 1).
    Claim { renew: bool },
    /// Someone else holds a live Lease.
    Follow { holder: String },
}

/// One round of client-go's `tryAcquireOrRenew`, given the record just read (after
/// [`ElectorState::observe`]).
pub fn decide(
    record: Option<&LeaseRecord>,
    state: &ElectorState,
    cfg: &ElectionConfig,
    now: Instant,
) -> Decision {
    let Some(record) = record else {
        return Decision::Create;
    };
    match &record.holder {
        Some(h) if h == &cfg.identity => Decision::Claim { renew: true },
        Some(h) => {
            let observed_at = state
                .observed
                .as_ref()
                .filter(|(r, _)| r == record)
                .map_or(now, |(_, t)| *t);
            let duration = record.lease_duration.unwrap_or(cfg.lease_duration);
            if now.saturating_duration_since(observed_at) < duration {
                Decision::Follow { holder: h.clone() }
            } else {
                Decision::Claim { renew: false }
            }
        }
        None => Decision::Claim { renew: false },
    }
}

/// Does a leader whose last renewal was at `last_renewed` still lead?
pub fn still_leading(last_renewed: Option<Instant>, cfg: &ElectionConfig, now: Instant) -> bool {
    last_renewed.is_some_and(|t| now.saturating_duration_since(t) < cfg.renew_deadline)
}

fn spec_for(cfg: &ElectionConfig, prev: Option<&LeaseSpec>, renew: bool) -> LeaseSpec {
    let now = MicroTime(Timestamp::now());
    let transitions = prev.and_then(|p| p.lease_transitions).unwrap_or(0);
    LeaseSpec {
        holder_identity: Some(cfg.identity.clone()),
        lease_duration_seconds: Some(cfg.lease_duration.as_secs() as i32),
        acquire_time: if renew {
            prev.and_then(|p| p.acquire_time.clone())
                .or(Some(now.clone()))
        } else {
            Some(now.clone())
        },
        renew_time: Some(now),
        lease_transitions: Some(if renew { transitions } else { transitions + 1 }),
        ..LeaseSpec::default()
    }
}

/// One round against the API server; true if we hold the Lease afterwards.
async fn round(api: &Api<Lease>, cfg: &ElectionConfig, state: &mut ElectorState) -> bool {
    let now = Instant::now();
    let current = match api.get_opt(&cfg.lease_name).await {
        Ok(l) => l,
        Err(e) => {
            warn!(lease = %cfg.lease_name, error = %e, "reading the leader Lease failed");
            return false;
        }
    };
    let record = current.as_ref().map(LeaseRecord::from_lease);
    if let Some(r) = &record {
        state.observe(r, now);
    }
    let result = match decide(record.as_ref(), state, cfg, now) {
        Decision::Follow { .. } => return false,
        Decision::Create => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(cfg.lease_name.clone()),
                    namespace: Some(cfg.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(spec_for(cfg, None, false)),
            };
            api.create(&PostParams::default(), &lease).await
        }
        Decision::Claim { renew } => {
            let mut lease = current.expect("a record was read");
            lease.spec = Some(spec_for(cfg, lease.spec.as_ref(), renew));
            // The read's resourceVersion makes a concurrent claim fail with 409.
            api.replace(&cfg.lease_name, &PostParams::default(), &lease)
                .await
        }
    };
    match result {
        Ok(l) => {
            state.observe(&LeaseRecord::from_lease(&l), now);
            state.last_renewed = Some(now);
            true
        }
        Err(kube::Error::Api(e)) if e.code == 409 => false,
        Err(e) => {
            warn!(lease = %cfg.lease_name, error = %e, "writing the leader Lease failed");
            false
        }
    }
}

/// Gives the Lease up if we hold it (client-go's ReleaseOnCancel): holder cleared, duration 1 s.
async fn release(api: &Api<Lease>, cfg: &ElectionConfig) {
    let Ok(Some(mut lease)) = api.get_opt(&cfg.lease_name).await else {
        return;
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    if spec.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
        return;
    }
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(MicroTime(Timestamp::now()));
    match api
        .replace(&cfg.lease_name, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => info!(lease = %cfg.lease_name, identity = %cfg.identity, "leader Lease released"),
        Err(e) => warn!(lease = %cfg.lease_name, error = %e, "releasing the leader Lease failed"),
    }
}

/// Campaigns until `shutdown` resolves, publishing whether we lead on `leading`; releases the
/// Lease on shutdown. A leader that misses its renew deadline publishes `false` (callers stop
/// leading work at once; the operator exits so its in-memory state starts afresh).
pub async fn run_elector(
    client: kube::Client,
    cfg: ElectionConfig,
    leading: watch::Sender<bool>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let mut state = ElectorState::default();
    tokio::pin!(shutdown);
    loop {
        let won = round(&api, &cfg, &mut state).await;
        let lead =
            won || (*leading.borrow() && still_leading(state.last_renewed, &cfg, Instant::now()));
        if lead != *leading.borrow() {
            if lead {
                info!(lease = %cfg.lease_name, identity = %cfg.identity, "became the leader");
            } else {
                warn!(lease = %cfg.lease_name, identity = %cfg.identity, "stopped leading");
            }
            let _ = leading.send(lead);
        }
        tokio::select! {
            () = tokio::time::sleep(cfg.retry_period) => {}
            () = &mut shutdown => break,
        }
    }
    if *leading.borrow() {
        let _ = leading.send(false);
        release(&api, &cfg).await;
    }
}

/// Middleware for the webhook receiver: a standby must not answer a delivery 2xx, or its demand
/// would be lost (GitHub shows the delivery failed; the leader's sweep finds the job).
pub async fn leader_only(
    State(leading): State<watch::Receiver<bool>>,
    req: Request,
    next: Next,
) -> Response {
    if *leading.borrow() {
        next.run(req).await
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "standby: not the leader").into_response()
    }
}

/// Runs `work` once we lead, until it ends or leadership is lost (an error either way: a leader's
/// work never ends on its own, and a former leader must exit rather than resume with stale state).
pub async fn while_leading(
    mut leading: watch::Receiver<bool>,
    work: impl std::future::Future<Output = ()>,
) -> Result<(), Error> {
    if leading.wait_for(|l| *l).await.is_err() {
        return Err(Error::ElectorStopped);
    }
    info!("leading: starting the controllers");
    tokio::select! {
        () = work => Err(Error::ControllerStopped),
        r = leading.wait_for(|l| !*l) => Err(match r {
            Ok(_) => Error::LeadershipLost,
            Err(_) => Error::ElectorStopped,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ElectionConfig {
        ElectionConfig::new("imp-system", "imp-operator", "me")
    }

    fn held_by(h: &str, renew: &str) -> LeaseRecord {
        LeaseRecord {
            holder: Some(h.into()),
            renew_time: Some(renew.into()),
            lease_duration: Some(Duration::from_secs(15)),
            transitions: 3,
        }
    }

    #[tokio::test]
    async fn while_leading_says_why_it_ended_in_the_operators_error() {
        // The elector went away before we ever led.
        let (tx, rx) = watch::channel(false);
        drop(tx);
        let r = while_leading(rx, std::future::pending()).await;
        assert!(matches!(r, Err(Error::ElectorStopped)));
        // Led, then lost the Lease.
        let (tx, rx) = watch::channel(true);
        let lost = tokio::spawn(while_leading(rx, std::future::pending()));
        tokio::task::yield_now().await;
        tx.send(false).unwrap();
        let r = lost.await.unwrap();
        assert!(matches!(r, Err(Error::LeadershipLost)));
        assert_eq!(r.unwrap_err().metric_label(), "leadership_lost");
        // The work itself ended.
        let (_tx, rx) = watch::channel(true);
        let r = while_leading(rx, async {}).await;
        assert!(matches!(r, Err(Error::ControllerStopped)));
    }

    #[test]
    fn no_lease_is_created_and_a_free_one_is_claimed() {
        let t = Instant::now();
        let s = ElectorState::default();
        assert_eq!(decide(None, &s, &cfg(), t), Decision::Create);
        let free = LeaseRecord::default();
        assert_eq!(
            decide(Some(&free), &s, &cfg(), t),
            Decision::Claim { renew: false }
        );
    }

    #[test]
    fn our_own_lease_is_renewed() {
        let t = Instant::now();
        let r = held_by("me", "t1");
        assert_eq!(
            decide(Some(&r), &ElectorState::default(), &cfg(), t),
            Decision::Claim { renew: true }
        );
    }

    #[test]
    fn a_live_holder_is_followed_until_silent_for_the_lease_duration_by_our_clock() {
        let t0 = Instant::now();
        let mut s = ElectorState::default();
        let r = held_by("other", "t1");
        s.observe(&r, t0);
        let follow = Decision::Follow {
            holder: "other".into(),
        };
        assert_eq!(decide(Some(&r), &s, &cfg(), t0), follow);
        // The same record seen 14 s later: still live.
        let t14 = t0 + Duration::from_secs(14);
        s.observe(&r, t14);
        assert_eq!(decide(Some(&r), &s, &cfg(), t14), follow);
        // 15 s without a change: taken over.
        let t15 = t0 + Duration::from_secs(15);
        s.observe(&r, t15);
        assert_eq!(
            decide(Some(&r), &s, &cfg(), t15),
            Decision::Claim { renew: false }
        );
        // A renewal (the record changed) restarts the clock, whatever its timestamps say.
        let renewed = held_by("other", "t2");
        s.observe(&renewed, t15);
        assert_eq!(decide(Some(&renewed), &s, &cfg(), t15), follow);
    }

    #[test]
    fn a_record_never_observed_counts_from_now() {
        let t = Instant::now();
        let r = held_by("other", "old");
        assert_eq!(
            decide(Some(&r), &ElectorState::default(), &cfg(), t),
            Decision::Follow {
                holder: "other".into()
            }
        );
    }

    #[test]
    fn the_holders_own_lease_duration_applies() {
        let t0 = Instant::now();
        let mut s = ElectorState::default();
        let mut r = held_by("other", "t1");
        r.lease_duration = Some(Duration::from_secs(1));
        s.observe(&r, t0);
        assert_eq!(
            decide(Some(&r), &s, &cfg(), t0 + Duration::from_secs(1)),
            Decision::Claim { renew: false }
        );
    }

    #[test]
    fn a_leader_stops_leading_after_the_renew_deadline() {
        let t0 = Instant::now();
        let c = cfg();
        assert!(still_leading(Some(t0), &c, t0 + Duration::from_secs(9)));
        assert!(!still_leading(Some(t0), &c, t0 + Duration::from_secs(10)));
        assert!(!still_leading(None, &c, t0));
    }

    #[test]
    fn a_takeover_counts_a_transition_and_a_renewal_keeps_the_acquire_time() {
        let c = cfg();
        let first = spec_for(&c, None, false);
        assert_eq!(first.lease_transitions, Some(1));
        assert_eq!(first.holder_identity.as_deref(), Some("me"));
        assert_eq!(first.lease_duration_seconds, Some(15));
        let renewed = spec_for(&c, Some(&first), true);
        assert_eq!(renewed.lease_transitions, Some(1));
        assert_eq!(renewed.acquire_time, first.acquire_time);
        let taken = spec_for(&c, Some(&first), false);
        assert_eq!(taken.lease_transitions, Some(2));
    }
}
