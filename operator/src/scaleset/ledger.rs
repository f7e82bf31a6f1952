//! The job ledger of a scale-set pool: one entry per `runnerRequestId`, moving only forward
//! (Available -> Acquired -> Started(runnerName) -> Completed). It is written to the API server
//! (a ConfigMap per pool, docs/architecture.md) before a message is acknowledged, so a redelivered
//! message or a restarted operator finds what was already decided. Pure data and its codec; the
//! intake does the I/O.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// ConfigMap data keys of entries: `r<runnerRequestId>`.
const KEY_PREFIX: &str = "r";
/// Completed entries are kept this long (a message redelivered later than this is older than any
/// session GitHub keeps).
pub const COMPLETED_TTL_SECS: i64 = 3600;
/// At most this many entries (a ConfigMap holds 1 MiB; an entry is a few hundred bytes).
pub const MAX_ENTRIES: usize = 2000;

/// Where a job is. Ordered: a state never moves back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LedgerState {
    /// Seen as available; acquire asked for (or about to be).
    Available,
    /// Ours: the broker assigned it to the scale set.
    Acquired,
    /// A runner of the scale set took it.
    Started,
    Completed,
}

/// One job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LedgerEntry {
    pub state: LedgerState,
    /// The workflow job's id as the message carries it.
    pub job_id: String,
    /// `owner/repo`.
    pub repository: String,
    pub labels: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<i64>,
    /// The runner that took it (from JobStarted): how a job is bound to a VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// GitHub's times (RFC 3339) where the messages carried them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<String>,
    /// When we last changed it (unix seconds): pruning.
    pub updated: i64,
}

/// The ledger of one pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    pub entries: BTreeMap<i64, LedgerEntry>,
}

impl Ledger {
    /// Reads the ConfigMap data; an entry that does not parse is reported, not dropped silently.
    pub fn from_data(data: &BTreeMap<String, String>) -> Result<Ledger, String> {
        let mut entries = BTreeMap::new();
        for (k, v) in data {
            let Some(id) = k
                .strip_prefix(KEY_PREFIX)
                .and_then(|n| n.parse::<i64>().ok())
            else {
                continue;
            };
            let e: LedgerEntry =
                serde_json::from_str(v).map_err(|e| format!("ledger entry {k}: {e}"))?;
            entries.insert(id, e);
        }
        Ok(Ledger { entries })
    }

    pub fn to_data(&self) -> BTreeMap<String, String> {
        self.entries
            .iter()
            .map(|(id, e)| {
                (
                    format!("{KEY_PREFIX}{id}"),
                    serde_json::to_string(e).expect("ledger entries serialize"),
                )
            })
            .collect()
    }

    pub fn get(&self, id: i64) -> Option<&LedgerEntry> {
        self.entries.get(&id)
    }

    /// Applies changed entries; answers whether anything changed.
    pub fn apply(&mut self, changes: &[(i64, LedgerEntry)]) -> bool {
        let mut changed = false;
        for (id, e) in changes {
            if self.entries.get(id) != Some(e) {
                self.entries.insert(*id, e.clone());
                changed = true;
            }
        }
        changed
    }

    /// Drops completed entries older than the TTL, then the oldest completed ones over the cap.
    /// Entries not completed are never dropped: they are jobs someone must serve.
    pub fn prune(&mut self, now: i64) -> bool {
        let before = self.entries.len();
        self.entries.retain(|_, e| {
            e.state != LedgerState::Completed || now - e.updated < COMPLETED_TTL_SECS
        });
        if self.entries.len() > MAX_ENTRIES {
            let mut done: Vec<(i64, i64)> = self
                .entries
                .iter()
                .filter(|(_, e)| e.state == LedgerState::Completed)
                .map(|(id, e)| (e.updated, *id))
                .collect();
            done.sort();
            let excess = self.entries.len() - MAX_ENTRIES;
            for (_, id) in done.into_iter().take(excess) {
                self.entries.remove(&id);
            }
        }
        self.entries.len() != before
    }

    /// Jobs acquired and not yet taken by a runner.
    pub fn waiting(&self) -> usize {
        self.entries
            .values()
            .filter(|e| e.state == LedgerState::Acquired)
            .count()
    }

    /// Jobs acquired and not yet completed.
    pub fn open(&self) -> usize {
        self.entries
            .values()
            .filter(|e| matches!(e.state, LedgerState::Acquired | LedgerState::Started))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn entry(state: LedgerState, updated: i64) -> LedgerEntry {
        LedgerEntry {
            state,
            job_id: "1".into(),
            repository: "o/r".into(),
            labels: vec!["set".into()],
            run_id: None,
            runner_name: None,
            result: None,
            queued_at: None,
            started_at: None,
            completed_at: None,
            updated,
        }
    }

    #[test]
    fn the_configmap_data_round_trips_and_a_corrupt_entry_is_an_error() {
        let mut l = Ledger::default();
        l.apply(&[
            (5, entry(LedgerState::Acquired, 1)),
            (6, entry(LedgerState::Started, 2)),
        ]);
        let data = l.to_data();
        assert!(data.contains_key("r5"));
        assert_eq!(Ledger::from_data(&data).unwrap(), l);
        let mut bad = data.clone();
        bad.insert("r7".into(), "{".into());
        assert!(Ledger::from_data(&bad).unwrap_err().contains("r7"));
        bad.remove("r7");
        bad.insert("unrelated".into(), "x".into());
        assert_eq!(Ledger::from_data(&bad).unwrap(), l);
    }

    #[test]
    fn pruning_drops_only_old_completed_entries() {
        let mut l = Ledger::default();
        l.apply(&[
            (1, entry(LedgerState::Completed, 0)),
            (2, entry(LedgerState::Completed, 5000)),
            (3, entry(LedgerState::Acquired, 0)),
        ]);
        assert!(l.prune(5000));
        assert_eq!(l.entries.keys().copied().collect::<Vec<_>>(), [2, 3]);
        assert_eq!((l.waiting(), l.open()), (1, 1));
        assert!(!l.prune(5000));
    }
}
