//! Imp's nftables rules, rendered as nft's JSON API (pure) and applied with `nft -j -f -`.
//!
//! Two tables belong to Imp and hold nothing else: `inet imp` (guest traffic to the node,
//! forwarding, masquerade) and `bridge imp` (per-port anti-spoofing, no VM-to-VM bridging).
//! They are replaced as a whole in one nft transaction, so the rules are never half-applied.
//! Each rule's comment is a hash of its content: the observed comments say whether the host's
//! rules are exactly the desired ones, which keeps a repeated setup a no-op.

use std::collections::BTreeSet;
use std::process::Stdio;

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

use super::{NetworkError, format_mac};
use crate::tap::fnv1a;

/// Name of both of Imp's tables.
pub const TABLE: &str = "imp";

/// Link-local, where clouds serve instance metadata (169.254.169.254): never reachable.
pub const LINK_LOCAL: &str = "169.254.0.0/16";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Family {
    Inet,
    Bridge,
}

impl Family {
    fn name(self) -> &'static str {
        match self {
            Family::Inet => "inet",
            Family::Bridge => "bridge",
        }
    }
}

/// The base chains of Imp's tables: (family, name, type, hook, priority). Policy accept: the
/// rules only ever match Imp's own bridges and TAPs, everything else passes untouched.
const CHAINS: &[(Family, &str, &str, &str, i32)] = &[
    (Family::Inet, "input", "filter", "input", 0),
    (Family::Inet, "forward", "filter", "forward", 0),
    (Family::Inet, "postrouting", "nat", "postrouting", 100),
    (Family::Bridge, "prerouting", "filter", "prerouting", -200),
    (Family::Bridge, "forward", "filter", "forward", -200),
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub family: Family,
    pub chain: &'static str,
    pub expr: Vec<Value>,
    /// Why the rule exists, for people reading `nft list ruleset`.
    pub why: &'static str,
}

impl Rule {
    /// `imp:<hash> <why>`: the hash covers family, chain and expressions.
    pub fn comment(&self) -> String {
        let expr = serde_json::to_string(&self.expr).unwrap_or_default();
        let h = fnv1a(&[
            self.family.name().as_bytes(),
            self.chain.as_bytes(),
            expr.as_bytes(),
        ]);
        format!("imp:{h:016x} {}", self.why)
    }
}

fn meta(key: &str, op: &str, right: Value) -> Value {
    json!({"match": {"op": op, "left": {"meta": {"key": key}}, "right": right}})
}

fn payload(protocol: &str, field: &str, op: &str, right: Value) -> Value {
    json!({"match": {"op": op, "left": {"payload": {"protocol": protocol, "field": field}}, "right": right}})
}

fn prefix(net: &ipnet::Ipv4Net) -> Value {
    json!({"prefix": {"addr": net.network().to_string(), "len": net.prefix_len()}})
}

fn prefixes(nets: &[ipnet::Ipv4Net]) -> Value {
    json!({"set": nets.iter().map(prefix).collect::<Vec<_>>()})
}

fn verdict(v: &str) -> Value {
    json!({ v: null })
}

/// Packets in the reply direction of a tracked connection.
fn reply_direction() -> Value {
    json!({"match": {"op": "==", "left": {"ct": {"key": "direction"}}, "right": "reply"}})
}

/// The source, protocol and (when listed) destination ports of one `spec.ingress` rule.
fn ingress_match(r: &crate::api::Ingress) -> Vec<Value> {
    let proto = match r.protocol {
        imp_api::IngressProtocol::Tcp => "tcp",
        imp_api::IngressProtocol::Udp => "udp",
    };
    let mut m = vec![
        payload("ip", "saddr", "==", prefix(&r.from)),
        meta("l4proto", "==", json!(proto)),
    ];
    if !r.ports.is_empty() {
        m.push(payload(proto, "dport", "==", json!({ "set": r.ports })));
    }
    m
}

/// A network with its egress interface resolved: what the rules are rendered from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved<'a> {
    pub bridge: String,
    /// `None`: the egress cannot be resolved (a failed network): its guests keep every
    /// isolation rule and get no way out, rather than losing their rules.
    pub egress: Option<String>,
    pub attachment: &'a super::Attachment,
}

/// Every rule for the desired state, in order.
pub fn rules(networks: &[Resolved<'_>]) -> Vec<Rule> {
    let mut out = Vec::new();
    let mut rule = |family, chain, expr: Vec<Value>, why| {
        out.push(Rule {
            family,
            chain,
            expr,
            why,
        })
    };
    for n in networks {
        let spec = &n.attachment.network;
        let br = json!(n.bridge);
        let from_br = || meta("iifname", "==", br.clone());
        let to_br = || meta("oifname", "==", br.clone());
        // From the subnet on this bridge, out the egress interface.
        let outbound = |egress: &str| {
            vec![
                from_br(),
                meta("oifname", "==", json!(egress)),
                payload("ip", "saddr", "==", prefix(&spec.subnet)),
            ]
        };
        let established = || json!({"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["established", "related"]}});
        rule(
            Family::Inet,
            "input",
            vec![from_br(), established(), verdict("accept")],
            "replies to connections the node opened",
        );
        rule(
            Family::Inet,
            "input",
            vec![from_br(), verdict("drop")],
            "guests reach no address of the node",
        );
        rule(
            Family::Inet,
            "forward",
            vec![
                from_br(),
                payload("ip", "daddr", "==", prefix(&LINK_LOCAL.parse().unwrap())),
                verdict("drop"),
            ],
            "no link-local (cloud metadata)",
        );
        if !spec.ingress.is_empty() {
            // Replies on connections opened into a guest (only `spec.ingress` admits those): out
            // the way they came, whatever the egress lists say about the client's address.
            rule(
                Family::Inet,
                "forward",
                vec![from_br(), reply_direction(), verdict("accept")],
                "replies to admitted connections (spec.ingress)",
            );
        }
        if !spec.egress_deny.is_empty() {
            rule(
                Family::Inet,
                "forward",
                vec![
                    from_br(),
                    payload("ip", "daddr", "==", prefixes(&spec.egress_deny)),
                    verdict("drop"),
                ],
                "spec.egress.deny",
            );
        }
        if !spec.egress_allow.is_empty() {
            rule(
                Family::Inet,
                "forward",
                vec![
                    from_br(),
                    payload("ip", "daddr", "!=", prefixes(&spec.egress_allow)),
                    verdict("drop"),
                ],
                "spec.egress.allow",
            );
        }
        if let Some(egress) = &n.egress {
            rule(
                Family::Inet,
                "forward",
                [outbound(egress), vec![verdict("accept")]].concat(),
                "guests out the egress interface",
            );
        }
        rule(
            Family::Inet,
            "forward",
            vec![from_br(), verdict("drop")],
            "nothing else from guests (no VM-to-VM routing)",
        );
        rule(
            Family::Inet,
            "forward",
            vec![to_br(), established(), verdict("accept")],
            "replies to guests",
        );
        for r in &spec.ingress {
            rule(
                Family::Inet,
                "forward",
                [vec![to_br()], ingress_match(r), vec![verdict("accept")]].concat(),
                "spec.ingress",
            );
        }
        rule(
            Family::Inet,
            "forward",
            vec![to_br(), verdict("drop")],
            "no connections into guests",
        );
        if spec.nat
            && let Some(egress) = &n.egress
        {
            rule(
                Family::Inet,
                "postrouting",
                [outbound(egress), vec![verdict("masquerade")]].concat(),
                "outbound NAT",
            );
        }
        for port in &n.attachment.ports {
            let tap = || meta("iifname", "==", json!(port.tap));
            let mac = json!(format_mac(&port.mac));
            let ip = json!(port.ip.to_string());
            let ether_type = |t: &str| payload("ether", "type", "==", json!(t));
            rule(
                Family::Bridge,
                "prerouting",
                vec![
                    tap(),
                    payload("ether", "saddr", "!=", mac.clone()),
                    verdict("drop"),
                ],
                "guest MAC only",
            );
            rule(
                Family::Bridge,
                "prerouting",
                vec![
                    tap(),
                    payload("ether", "type", "!=", json!({"set": ["ip", "arp"]})),
                    verdict("drop"),
                ],
                "IPv4 and ARP only (no IPv6)",
            );
            rule(
                Family::Bridge,
                "prerouting",
                vec![
                    tap(),
                    ether_type("arp"),
                    payload("arp", "saddr ip", "!=", ip.clone()),
                    verdict("drop"),
                ],
                "ARP from the guest's address only",
            );
            rule(
                Family::Bridge,
                "prerouting",
                vec![
                    tap(),
                    ether_type("arp"),
                    payload("arp", "saddr ether", "!=", mac),
                    verdict("drop"),
                ],
                "ARP from the guest's MAC only",
            );
            rule(
                Family::Bridge,
                "prerouting",
                vec![
                    tap(),
                    ether_type("ip"),
                    payload("ip", "saddr", "!=", ip),
                    verdict("drop"),
                ],
                "guest IPv4 source only",
            );
            rule(
                Family::Bridge,
                "forward",
                vec![tap(), verdict("drop")],
                "no VM-to-VM bridging",
            );
        }
    }
    out
}

/// The comments (keys) of a rule list, as [`observed_keys`] reads them back.
pub fn keys(rules: &[Rule]) -> BTreeSet<String> {
    rules.iter().map(Rule::comment).collect()
}

fn table(family: Family) -> Value {
    json!({"table": {"family": family.name(), "name": TABLE}})
}

/// One transaction: (re)create both tables with exactly `rules`. `add` before `delete` makes
/// the delete valid when a table is absent; the final `add` starts it empty.
pub fn replace_batch(rules: &[Rule]) -> Value {
    let mut cmds = delete_cmds();
    for family in [Family::Inet, Family::Bridge] {
        cmds.push(json!({"add": table(family)}));
    }
    for (family, name, kind, hook, prio) in CHAINS {
        cmds.push(json!({"add": {"chain": {
            "family": family.name(), "table": TABLE, "name": name,
            "type": kind, "hook": hook, "prio": prio, "policy": "accept"
        }}}));
    }
    for r in rules {
        cmds.push(json!({"add": {"rule": {
            "family": r.family.name(), "table": TABLE, "chain": r.chain,
            "comment": r.comment(), "expr": r.expr
        }}}));
    }
    json!({ "nftables": cmds })
}

fn delete_cmds() -> Vec<Value> {
    [Family::Inet, Family::Bridge]
        .into_iter()
        .flat_map(|f| [json!({"add": table(f)}), json!({"delete": table(f)})])
        .collect()
}

/// One transaction removing both tables (absent ones included).
pub fn delete_batch() -> Value {
    json!({ "nftables": delete_cmds() })
}

/// What `nft -j list ruleset` shows of Imp's tables.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Either of Imp's tables exists.
    pub present: bool,
    /// Comments of the rules in them, plus a marker for each missing base chain so a deleted
    /// chain also reads as a mismatch.
    pub keys: BTreeSet<String>,
}

const MISSING_CHAIN: &str = "missing-chain:";

/// Pure: read Imp's part out of `nft -j list ruleset`.
pub fn observed_keys(ruleset: &Value) -> Observed {
    let items = ruleset["nftables"].as_array().cloned().unwrap_or_default();
    let ours = |o: &Value, table_key: &str| {
        o[table_key] == TABLE && matches!(o["family"].as_str(), Some("inet" | "bridge"))
    };
    let mut obs = Observed::default();
    let mut chains = BTreeSet::new();
    for item in &items {
        if item.get("table").is_some_and(|t| ours(t, "name")) {
            obs.present = true;
        }
        if let Some(c) = item.get("chain").filter(|c| ours(c, "table")) {
            chains.insert((
                c["family"].as_str().unwrap_or_default().to_owned(),
                c["name"].as_str().unwrap_or_default().to_owned(),
            ));
        }
        if let Some(r) = item.get("rule").filter(|r| ours(r, "table")) {
            obs.keys
                .insert(r["comment"].as_str().unwrap_or("(no comment)").to_owned());
        }
    }
    if obs.present {
        for (family, name, ..) in CHAINS {
            if !chains.contains(&(family.name().to_owned(), (*name).to_owned())) {
                obs.keys
                    .insert(format!("{MISSING_CHAIN}{}/{name}", family.name()));
            }
        }
    }
    obs
}

pub(crate) async fn nft(
    args: &[&str],
    stdin: Option<&Value>,
    step: &'static str,
) -> Result<Vec<u8>, NetworkError> {
    let err = |message: String| NetworkError::Nft { step, message };
    let mut child = tokio::process::Command::new("nft")
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| err(format!("run nft: {e} (is the nftables package installed?)")))?;
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("stdin is piped");
        pipe.write_all(input.to_string().as_bytes())
            .await
            .map_err(|e| err(e.to_string()))?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| err(e.to_string()))?;
    if !out.status.success() {
        return Err(err(String::from_utf8_lossy(&out.stderr).trim().to_owned()));
    }
    Ok(out.stdout)
}

pub async fn observe() -> Result<Observed, NetworkError> {
    let out = nft(&["-j", "list", "ruleset"], None, "list ruleset").await?;
    let v: Value = serde_json::from_slice(&out).map_err(|e| NetworkError::Nft {
        step: "list ruleset",
        message: format!("unreadable JSON: {e}"),
    })?;
    Ok(observed_keys(&v))
}

pub async fn apply(batch: &Value, step: &'static str) -> Result<(), NetworkError> {
    nft(&["-j", "-f", "-"], Some(batch), step).await.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::{Attachment, Port, VmNetwork};

    fn attachment(nat: bool, ports: usize) -> Attachment {
        Attachment {
            network: VmNetwork {
                id: "net-1".into(),
                subnet: "192.0.2.0/24".parse().unwrap(),
                gateway: "192.0.2.1".parse().unwrap(),
                nat,
                egress_interface: None,
                egress_allow: vec![],
                egress_deny: vec![],
                ingress: vec![],
            },
            ports: (0..ports)
                .map(|i| Port {
                    tap: format!("imptap{i}"),
                    mac: [6, 0, 0, 0, 0, i as u8],
                    ip: format!("192.0.2.{}", 10 + i).parse().unwrap(),
                })
                .collect(),
        }
    }

    fn resolved(a: &Attachment) -> Vec<Resolved<'_>> {
        vec![Resolved {
            bridge: "impbr0000000001".into(),
            egress: Some("eth0".into()),
            attachment: a,
        }]
    }

    #[test]
    fn rules_cover_isolation_nat_and_every_port() {
        let a = attachment(true, 2);
        let r = rules(&resolved(&a));
        let count = |f: Family, c: &str| r.iter().filter(|x| x.family == f && x.chain == c).count();
        assert_eq!(count(Family::Inet, "input"), 2);
        assert_eq!(count(Family::Inet, "postrouting"), 1);
        assert_eq!(count(Family::Inet, "forward"), 5);
        assert_eq!(count(Family::Bridge, "prerouting"), 10);
        assert_eq!(count(Family::Bridge, "forward"), 2);
        // The accept out of the egress precedes the catch-all drop.
        let fwd: Vec<_> = r
            .iter()
            .filter(|x| x.chain == "forward" && x.family == Family::Inet)
            .collect();
        let accept = fwd
            .iter()
            .position(|x| x.why == "guests out the egress interface")
            .unwrap();
        let drop = fwd
            .iter()
            .position(|x| x.why.starts_with("nothing else"))
            .unwrap();
        let ll = fwd
            .iter()
            .position(|x| x.why.starts_with("no link-local"))
            .unwrap();
        assert!(ll < accept && accept < drop);
        let nat = serde_json::to_string(&r.iter().find(|x| x.chain == "postrouting").unwrap().expr)
            .unwrap();
        assert!(
            nat.contains("\"masquerade\"") && nat.contains("192.0.2.0") && nat.contains("eth0"),
            "{nat}"
        );
        // Without NAT there is no masquerade, the rest stays.
        let plain = attachment(false, 2);
        assert_eq!(rules(&resolved(&plain)).len(), r.len() - 1);
    }

    #[test]
    fn egress_lists_render_deny_before_allow() {
        let mut a = attachment(true, 0);
        a.network.egress_deny = vec!["10.0.0.0/8".parse().unwrap()];
        a.network.egress_allow = vec![
            "10.1.0.0/16".parse().unwrap(),
            "198.51.100.0/24".parse().unwrap(),
        ];
        let r = rules(&resolved(&a));
        let whys: Vec<_> = r.iter().map(|x| x.why).collect();
        let deny = whys.iter().position(|w| *w == "spec.egress.deny").unwrap();
        let allow = whys.iter().position(|w| *w == "spec.egress.allow").unwrap();
        assert!(deny < allow);
        let allow_expr = serde_json::to_string(&r[allow].expr).unwrap();
        assert!(
            allow_expr.contains("\"!=\"") && allow_expr.contains("198.51.100.0"),
            "{allow_expr}"
        );
    }

    #[test]
    fn ingress_rules_accept_before_the_inbound_drop_and_let_replies_out() {
        let mut a = attachment(true, 1);
        a.network.egress_allow = vec!["10.1.0.0/16".parse().unwrap()];
        let plain = rules(&resolved(&a)).len();
        a.network.ingress = vec![
            crate::api::Ingress {
                from: "198.51.100.0/24".parse().unwrap(),
                protocol: imp_api::IngressProtocol::Tcp,
                ports: vec![22, 8080],
            },
            crate::api::Ingress {
                from: "0.0.0.0/0".parse().unwrap(),
                protocol: imp_api::IngressProtocol::Udp,
                ports: vec![],
            },
        ];
        let r = rules(&resolved(&a));
        // Two admissions and one reply rule.
        assert_eq!(r.len(), plain + 3);
        let fwd: Vec<_> = r
            .iter()
            .filter(|x| x.chain == "forward" && x.family == Family::Inet)
            .collect();
        let at = |why: &str| fwd.iter().position(|x| x.why == why).unwrap();
        let admitted: Vec<_> = fwd
            .iter()
            .enumerate()
            .filter(|(_, x)| x.why == "spec.ingress")
            .map(|(i, x)| (i, serde_json::to_string(&x.expr).unwrap()))
            .collect();
        assert_eq!(admitted.len(), 2);
        let inbound_drop = at("no connections into guests");
        assert!(admitted.iter().all(|(i, _)| *i < inbound_drop));
        let (_, tcp) = &admitted[0];
        assert!(
            tcp.contains("198.51.100.0")
                && tcp.contains("\"tcp\"")
                && tcp.contains("\"dport\"")
                && tcp.contains("8080"),
            "{tcp}"
        );
        // Every UDP port: no dport match.
        let (_, udp) = &admitted[1];
        assert!(udp.contains("\"udp\"") && !udp.contains("dport"), "{udp}");
        // Replies pass before the egress lists could drop them, never before the link-local drop.
        let replies = at("replies to admitted connections (spec.ingress)");
        assert!(at("no link-local (cloud metadata)") < replies);
        assert!(replies < at("spec.egress.allow"));
        assert!(
            serde_json::to_string(&fwd[replies].expr)
                .unwrap()
                .contains("\"reply\"")
        );
    }

    #[test]
    fn comments_are_content_hashes() {
        let a = attachment(true, 1);
        let r = rules(&resolved(&a));
        let k = keys(&r);
        assert_eq!(k.len(), r.len(), "every rule has its own key");
        let mut b = attachment(true, 1);
        b.ports[0].ip = "192.0.2.99".parse().unwrap();
        assert_ne!(keys(&rules(&resolved(&b))), k);
        assert_eq!(keys(&rules(&resolved(&attachment(true, 1)))), k);
    }

    #[test]
    fn batches_replace_and_delete_both_tables() {
        let a = attachment(true, 1);
        let r = rules(&resolved(&a));
        let b = replace_batch(&r);
        let cmds = b["nftables"].as_array().unwrap();
        // add+delete per table, add per table, the chains, the rules.
        assert_eq!(cmds.len(), 4 + 2 + CHAINS.len() + r.len());
        assert_eq!(cmds[1]["delete"]["table"]["family"], "inet");
        assert_eq!(delete_batch()["nftables"].as_array().unwrap().len(), 4);
    }

    #[test]
    fn observed_keys_reads_only_imps_tables() {
        let a = attachment(true, 1);
        let r = rules(&resolved(&a));
        // What nft lists back: the batch's objects without the add/delete wrappers.
        let mut listed = vec![json!({"metainfo": {"version": "1.0.6"}})];
        for c in replace_batch(&r)["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .skip(4)
        {
            listed.push(c["add"].clone());
        }
        listed.push(json!({"table": {"family": "ip", "name": "nat"}}));
        listed.push(
            json!({"rule": {"family": "ip", "table": "nat", "chain": "x", "comment": "other"}}),
        );
        let obs = observed_keys(&json!({ "nftables": listed.clone() }));
        assert!(obs.present);
        assert_eq!(obs.keys, keys(&r));
        // A deleted chain reads as a mismatch.
        listed.retain(|i| i.get("chain").is_none_or(|c| c["name"] != "input"));
        let obs = observed_keys(&json!({ "nftables": listed }));
        assert!(obs.keys.contains("missing-chain:inet/input"));
        let none =
            observed_keys(&json!({"nftables": [{"table": {"family": "ip", "name": "imp"}}]}));
        assert_eq!(none, Observed::default());
    }
}
