//! Wake counters: while a VM is Suspended, an nft rule in Imp's own `inet imp_wake` table
//! counts the packets the node forwards towards the VM's address (what a wake hook acts on; a
//! suspended VM answers nothing, so its TAP counters stay still). A table of its own because
//! `inet imp` is replaced as a whole on every network reconcile, which would reset a counter
//! kept there. Its forward chain runs before `inet imp`'s (priority -10) and only counts.
//!
//! Same shape as the rest of the data plane: observe the chain, decide with the pure [`plan`],
//! apply one nft transaction. Idempotent, so a restarted runtime converges too.

use std::net::Ipv4Addr;

use serde_json::{Value, json};

use super::NetworkError;
use super::nft::nft;

pub const TABLE: &str = "imp_wake";
const CHAIN: &str = "forward";
const COMMENT_PREFIX: &str = "imp-wake ";

/// A counter rule on the host: its address, handle and packets so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counter {
    pub address: Ipv4Addr,
    pub handle: u64,
    pub packets: u64,
}

/// What to change so exactly `desired` addresses have a counter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub add: Vec<Ipv4Addr>,
    /// Rule handles to delete (counters of VMs no longer Suspended, or duplicates).
    pub delete: Vec<u64>,
    /// Nothing desired and nothing left: drop the table.
    pub drop_table: bool,
}

pub fn plan(observed: &[Counter], desired: &[Ipv4Addr], table_exists: bool) -> Plan {
    let mut p = Plan::default();
    let mut kept: Vec<Ipv4Addr> = Vec::new();
    for c in observed {
        if desired.contains(&c.address) && !kept.contains(&c.address) {
            kept.push(c.address);
        } else {
            p.delete.push(c.handle);
        }
    }
    for a in desired {
        if !kept.contains(a) && !p.add.contains(a) {
            p.add.push(*a);
        }
    }
    p.drop_table = desired.is_empty() && table_exists;
    p
}

/// The counter rules found in `nft -j list table inet imp_wake` output.
pub fn parse(listing: &Value) -> Vec<Counter> {
    let Some(items) = listing.get("nftables").and_then(Value::as_array) else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|i| i.get("rule"))
        .filter(|r| r["table"] == TABLE && r["chain"] == CHAIN)
        .filter_map(|r| {
            let address = r["comment"]
                .as_str()?
                .strip_prefix(COMMENT_PREFIX)?
                .parse()
                .ok()?;
            let packets = r["expr"]
                .as_array()?
                .iter()
                .find_map(|e| e.get("counter")?.get("packets")?.as_u64())
                .unwrap_or(0);
            Some(Counter {
                address,
                handle: r["handle"].as_u64()?,
                packets,
            })
        })
        .collect()
}

fn rule(address: Ipv4Addr) -> Value {
    json!({"add": {"rule": {
        "family": "inet", "table": TABLE, "chain": CHAIN,
        "comment": format!("{COMMENT_PREFIX}{address}"),
        "expr": [
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": address.to_string()}},
            {"counter": {"packets": 0, "bytes": 0}}
        ]
    }}})
}

/// The nft transaction for `p` (None when there is nothing to do).
pub fn batch(p: &Plan) -> Option<Value> {
    let mut cmds = Vec::new();
    if p.drop_table {
        cmds.push(json!({"delete": {"table": {"family": "inet", "name": TABLE}}}));
        return Some(json!({ "nftables": cmds }));
    }
    if p.add.is_empty() && p.delete.is_empty() {
        return None;
    }
    cmds.push(json!({"add": {"table": {"family": "inet", "name": TABLE}}}));
    cmds.push(json!({"add": {"chain": {
        "family": "inet", "table": TABLE, "name": CHAIN,
        "type": "filter", "hook": "forward", "prio": -10, "policy": "accept"
    }}}));
    for h in &p.delete {
        cmds.push(json!({"delete": {"rule": {"family": "inet", "table": TABLE, "chain": CHAIN, "handle": h}}}));
    }
    for a in &p.add {
        cmds.push(rule(*a));
    }
    Some(json!({ "nftables": cmds }))
}

/// The host's counters (none when the table does not exist).
async fn observe() -> Result<Option<Vec<Counter>>, NetworkError> {
    match nft(
        &["-j", "list", "table", "inet", TABLE],
        None,
        "list wake table",
    )
    .await
    {
        Ok(out) => {
            let v: Value = serde_json::from_slice(&out).map_err(|e| NetworkError::Nft {
                step: "list wake table",
                message: format!("unreadable JSON: {e}"),
            })?;
            Ok(Some(parse(&v)))
        }
        // No such table: nothing counted yet.
        Err(NetworkError::Nft { message, .. }) if message.contains("No such file") => Ok(None),
        Err(e) => Err(e),
    }
}

/// Make the counters exactly those of `suspended` (the addresses of every Suspended VM).
pub async fn sync(suspended: &[Ipv4Addr]) -> Result<(), NetworkError> {
    let observed = observe().await?;
    let p = plan(
        observed.as_deref().unwrap_or(&[]),
        suspended,
        observed.is_some(),
    );
    if let Some(b) = batch(&p) {
        nft(&["-j", "-f", "-"], Some(&b), "wake counters").await?;
    }
    Ok(())
}

/// Packets counted towards `address` since its counter was added (0 without one).
pub async fn wake_packets(address: Ipv4Addr) -> u64 {
    match observe().await {
        Ok(Some(c)) => c
            .iter()
            .filter(|c| c.address == address)
            .map(|c| c.packets)
            .sum(),
        Ok(None) => 0,
        Err(e) => {
            tracing::warn!(%address, error = %e, "reading the wake counter failed");
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(a: &str, handle: u64) -> Counter {
        Counter {
            address: a.parse().unwrap(),
            handle,
            packets: 0,
        }
    }

    #[test]
    fn plan_adds_missing_and_deletes_stale_and_duplicate_counters() {
        let a: Ipv4Addr = "198.51.100.5".parse().unwrap();
        let b: Ipv4Addr = "198.51.100.6".parse().unwrap();
        let observed = [
            c("198.51.100.5", 3),
            c("198.51.100.9", 4),
            c("198.51.100.5", 7),
        ];
        let p = plan(&observed, &[a, b], true);
        assert_eq!(p.add, vec![b]);
        assert_eq!(p.delete, vec![4, 7]);
        assert!(!p.drop_table);
        assert_eq!(plan(&[c("198.51.100.5", 3)], &[a], true), Plan::default());
        assert!(batch(&Plan::default()).is_none());
    }

    #[test]
    fn nothing_suspended_drops_the_table_only_if_it_exists() {
        assert!(plan(&[c("198.51.100.5", 3)], &[], true).drop_table);
        let p = plan(&[], &[], false);
        assert!(!p.drop_table && batch(&p).is_none());
    }

    #[test]
    fn parse_reads_only_our_counters() {
        let v = json!({"nftables": [
            {"metainfo": {"json_schema_version": 1}},
            {"table": {"family": "inet", "name": TABLE}},
            {"rule": {"family": "inet", "table": TABLE, "chain": CHAIN, "handle": 5,
                "comment": "imp-wake 203.0.113.7",
                "expr": [{"match": {}}, {"counter": {"packets": 3, "bytes": 180}}]}},
            {"rule": {"family": "inet", "table": TABLE, "chain": CHAIN, "handle": 6,
                "comment": "someone else's", "expr": []}}
        ]});
        assert_eq!(
            parse(&v),
            vec![Counter {
                address: "203.0.113.7".parse().unwrap(),
                handle: 5,
                packets: 3
            }]
        );
        let added = batch(&Plan {
            add: vec!["203.0.113.7".parse().unwrap()],
            ..Plan::default()
        })
        .unwrap()
        .to_string();
        assert!(
            added.contains("imp-wake 203.0.113.7") && added.contains("\"prio\":-10"),
            "{added}"
        );
    }
}
