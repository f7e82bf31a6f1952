//! Imp's nftables rules, rendered as nft's JSON API (pure) and applied with `nft -j -f -`.
//!
//! Two tables belong to Imp and hold nothing else: `inet imp` (guest traffic to the node,
//! forwarding, masquerade) and `bridge imp` (per-port anti-spoofing, no VM-to-VM bridging).
//! They are replaced as a whole in one nft transaction, so the rules are never half-applied.
//! Each rule's comment is a hash of its content: the observed comments say whether the host's
//! rules are exactly the desired ones, which keeps a repeated setup a no-op.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::process::Stdio;

use ipnet::Ipv4Net;

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
    /// A base chain of [`CHAINS`], or a network's own chain (created with the table).
    pub chain: String,
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

/// The destination the guest asked for: before a DNAT (kube-proxy rewrites service IPs in
/// prerouting, before the forward hook sees the packet) it differs from `ip daddr`.
fn original_daddr(op: &str, right: Value) -> Value {
    json!({"match": {"op": op, "left": {"ct": {"key": "ip daddr", "dir": "original"}}, "right": right}})
}

fn prefix(net: &Ipv4Net) -> Value {
    json!({"prefix": {"addr": net.network().to_string(), "len": net.prefix_len()}})
}

/// An anonymous interval set; overlapping ranges are merged first (nft refuses them).
fn prefixes(nets: &[Ipv4Net]) -> Value {
    let merged = Ipv4Net::aggregate(&nets.iter().map(Ipv4Net::trunc).collect());
    json!({"set": merged.iter().map(prefix).collect::<Vec<_>>()})
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

/// Private and shared address space (RFC 1918, CGNAT 100.64.0.0/10): where the node's own
/// networks, other nodes and the control plane live. Guests open no connection there unless
/// their network's `egress.allow` names the range and the platform allows that
/// ([`admit`](super::admit)).
pub const PRIVATE: [&str; 4] = [
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
];

/// What no guest opens a connection to by default, node-wide.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Denied {
    /// [`PRIVATE`] and the platform's reserved ranges (pod, service, node CIDRs): denied unless
    /// the network's (platform-allowed) `egress.allow` names them.
    pub ranges: Vec<Ipv4Net>,
    /// Every address of the node outside Imp's bridges: never (like link-local).
    pub node: Vec<Ipv4Net>,
}

impl Denied {
    /// The private ranges plus `reserved`, and the node's `addresses` as host routes.
    pub fn new(reserved: &[Ipv4Net], addresses: impl IntoIterator<Item = Ipv4Addr>) -> Self {
        let mut ranges: Vec<Ipv4Net> = PRIVATE.iter().map(|c| c.parse().unwrap()).collect();
        ranges.extend(reserved.iter().map(Ipv4Net::trunc));
        let node = addresses.into_iter().map(Ipv4Net::from).collect();
        Denied { ranges, node }
    }
}

/// Two drops of destinations in `set` (but not in `except`): one on the address the guest asked
/// for, one on the address a DNAT made of it, so that either matching drops the packet.
fn drops_to(set: Value, except: Option<Value>) -> [Vec<Value>; 2] {
    let daddr = |op: &str, right| payload("ip", "daddr", op, right);
    let one = |m: &dyn Fn(&str, Value) -> Value| {
        let mut expr = vec![m("==", set.clone())];
        expr.extend(except.clone().map(|e| m("!=", e)));
        expr.push(verdict("drop"));
        expr
    };
    [one(&daddr), one(&original_daddr)]
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

/// The network's chain for what its guests send (jumped to by the bridge as input interface).
pub fn egress_chain(bridge: &str) -> String {
    format!("egress-{bridge}")
}

/// The network's chain for what is sent to its guests (jumped to by the bridge as output).
pub fn ingress_chain(bridge: &str) -> String {
    format!("ingress-{bridge}")
}

/// Every rule for the desired state, in order.
///
/// Forwarded traffic of a network is decided in its own two chains, each ending in a drop: a
/// guest's packet enters only its network's egress chain (and is decided there), a packet to
/// a guest only its network's ingress chain, so no network's lists or ingress rules decide
/// for another's guests.
pub fn rules(networks: &[Resolved<'_>], denied: &Denied) -> Vec<Rule> {
    let mut out = Vec::new();
    let mut rule = |family, chain: &str, expr: Vec<Value>, why| {
        out.push(Rule {
            family,
            chain: chain.to_owned(),
            expr,
            why,
        })
    };
    let link_local: Ipv4Net = LINK_LOCAL.parse().unwrap();
    // Every guest's packet jumps to its own network's egress chain before any packet is
    // matched by the network it is sent to: those chains end in a drop, so another network's
    // ingress rules never see (and never admit) it.
    for n in networks {
        rule(
            Family::Inet,
            "forward",
            vec![
                meta("iifname", "==", json!(n.bridge)),
                json!({"jump": {"target": egress_chain(&n.bridge)}}),
            ],
            "guests' traffic: their network's egress chain",
        );
    }
    for n in networks {
        rule(
            Family::Inet,
            "forward",
            vec![
                meta("oifname", "==", json!(n.bridge)),
                json!({"jump": {"target": ingress_chain(&n.bridge)}}),
            ],
            "traffic to guests: their network's ingress chain",
        );
    }
    for n in networks {
        let spec = &n.attachment.network;
        let br = json!(n.bridge);
        let from_br = || meta("iifname", "==", br.clone());
        let (egress_ch, ingress_ch) = (egress_chain(&n.bridge), ingress_chain(&n.bridge));
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

        for e in drops_to(prefix(&link_local), None) {
            rule(
                Family::Inet,
                &egress_ch,
                e,
                "no link-local (cloud metadata)",
            );
        }
        if !spec.ingress.is_empty() {
            // Replies on connections opened into a guest (only `spec.ingress` admits those): out
            // the way they came, whatever the egress lists say about the client's address.
            rule(
                Family::Inet,
                &egress_ch,
                vec![reply_direction(), verdict("accept")],
                "replies to admitted connections (spec.ingress)",
            );
        }
        if !denied.node.is_empty() {
            for e in drops_to(prefixes(&denied.node), None) {
                rule(Family::Inet, &egress_ch, e, "no address of the node");
            }
        }
        if !spec.egress_deny.is_empty() {
            for e in drops_to(prefixes(&spec.egress_deny), None) {
                rule(Family::Inet, &egress_ch, e, "spec.egress.deny");
            }
        }
        if !spec.egress_allow.is_empty() {
            // What the guest asked for: a service IP the list names stays allowed after DNAT.
            rule(
                Family::Inet,
                &egress_ch,
                vec![
                    original_daddr("!=", prefixes(&spec.egress_allow)),
                    verdict("drop"),
                ],
                "spec.egress.allow",
            );
        }
        let resolvers: BTreeSet<Ipv4Addr> = n
            .attachment
            .ports
            .iter()
            .flat_map(|p| p.dns.iter().copied())
            .collect();
        if let Some(egress) = &n.egress
            && !resolvers.is_empty()
        {
            // The guests' own resolvers stay reachable for DNS wherever they are (a VPC resolver,
            // the cluster DNS service), and only for DNS.
            let nets: Vec<Ipv4Net> = resolvers.iter().copied().map(Ipv4Net::from).collect();
            rule(
                Family::Inet,
                &egress_ch,
                [
                    outbound(egress),
                    vec![
                        original_daddr("==", prefixes(&nets)),
                        meta("l4proto", "==", json!({"set": ["tcp", "udp"]})),
                        payload("th", "dport", "==", json!(53)),
                        verdict("accept"),
                    ],
                ]
                .concat(),
                "DNS to the guests' resolvers (spec.dns)",
            );
        }
        if !denied.ranges.is_empty() {
            // Admission let through only allow entries the platform allows where they open a
            // denied range, so every entry may carve its range out here.
            let opened = (!spec.egress_allow.is_empty()).then(|| prefixes(&spec.egress_allow));
            for e in drops_to(prefixes(&denied.ranges), opened) {
                let why = "private and reserved ranges (default deny; egress.allow opens)";
                rule(Family::Inet, &egress_ch, e, why);
            }
        }
        if let Some(egress) = &n.egress {
            rule(
                Family::Inet,
                &egress_ch,
                [outbound(egress), vec![verdict("accept")]].concat(),
                "guests out the egress interface",
            );
        }
        rule(
            Family::Inet,
            &egress_ch,
            vec![verdict("drop")],
            "nothing else from guests (no VM-to-VM routing)",
        );
        rule(
            Family::Inet,
            &ingress_ch,
            vec![established(), verdict("accept")],
            "replies to guests",
        );
        for r in &spec.ingress {
            rule(
                Family::Inet,
                &ingress_ch,
                [ingress_match(r), vec![verdict("accept")]].concat(),
                "spec.ingress",
            );
        }
        rule(
            Family::Inet,
            &ingress_ch,
            vec![verdict("drop")],
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
    // The networks' own chains (no hook), each created before its first rule and its jump.
    let mut chains = BTreeSet::new();
    for r in rules {
        if !CHAINS
            .iter()
            .any(|(f, name, ..)| *f == r.family && *name == r.chain)
            && chains.insert((r.family, r.chain.as_str()))
        {
            cmds.push(json!({"add": {"chain": {
                "family": r.family.name(), "table": TABLE, "name": r.chain
            }}}));
        }
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
                    dns: vec![],
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

    /// The node of these tests: uplink address 192.0.2.2, no reserved ranges.
    fn node_denied() -> Denied {
        Denied::new(&[], ["192.0.2.2".parse().unwrap()])
    }

    fn rules_of(networks: &[Resolved<'_>]) -> Vec<Rule> {
        rules(networks, &node_denied())
    }

    fn j(v: Value) -> String {
        serde_json::to_string(&v).unwrap()
    }

    fn original_ct() -> String {
        j(json!({"ct": {"key": "ip daddr", "dir": "original"}}))
    }

    fn text(r: &Rule) -> String {
        serde_json::to_string(&r.expr).unwrap()
    }

    /// The rules of one chain, in order.
    fn chain<'r>(r: &'r [Rule], name: &str) -> Vec<&'r Rule> {
        r.iter()
            .filter(|x| x.family == Family::Inet && x.chain == name)
            .collect()
    }

    fn egress_of(r: &[Rule]) -> Vec<&Rule> {
        chain(r, &egress_chain("impbr0000000001"))
    }

    fn at(rules: &[&Rule], why: &str) -> usize {
        rules
            .iter()
            .position(|x| x.why == why)
            .unwrap_or_else(|| panic!("no {why:?}"))
    }

    const DEFAULT_DENY: &str = "private and reserved ranges (default deny; egress.allow opens)";

    #[test]
    fn rules_cover_isolation_nat_and_every_port() {
        let a = attachment(true, 2);
        let r = rules_of(&resolved(&a));
        let count = |f: Family, c: &str| r.iter().filter(|x| x.family == f && x.chain == c).count();
        assert_eq!(count(Family::Inet, "input"), 2);
        assert_eq!(count(Family::Inet, "postrouting"), 1);
        // The base chain only jumps: one chain for what the guests send, one for what they get.
        assert_eq!(count(Family::Inet, "forward"), 2);
        // Link-local, the node's addresses, the default deny (each before and after DNAT), the
        // way out, the catch-all drop.
        let egress = egress_of(&r);
        assert_eq!(egress.len(), 8);
        assert_eq!(chain(&r, &ingress_chain("impbr0000000001")).len(), 2);
        assert_eq!(count(Family::Bridge, "prerouting"), 10);
        assert_eq!(count(Family::Bridge, "forward"), 2);
        let accept = at(&egress, "guests out the egress interface");
        let ll = at(&egress, "no link-local (cloud metadata)");
        let node = at(&egress, "no address of the node");
        let deny = at(&egress, DEFAULT_DENY);
        assert!(ll < node && node < deny && deny < accept);
        assert_eq!(
            egress.last().unwrap().why,
            "nothing else from guests (no VM-to-VM routing)"
        );
        assert_eq!(text(egress.last().unwrap()), r#"[{"drop":null}]"#);
        let nat = text(r.iter().find(|x| x.chain == "postrouting").unwrap());
        assert!(
            nat.contains("\"masquerade\"") && nat.contains("192.0.2.0") && nat.contains("eth0"),
            "{nat}"
        );
        // Without NAT there is no masquerade, the rest stays.
        let plain = attachment(false, 2);
        assert_eq!(rules_of(&resolved(&plain)).len(), r.len() - 1);
    }

    #[test]
    fn the_default_deny_covers_private_cgnat_reserved_and_the_node_before_and_after_dnat() {
        let a = attachment(true, 1);
        let denied = Denied::new(
            &[
                "10.96.0.0/12".parse().unwrap(),
                "198.18.0.0/15".parse().unwrap(),
            ],
            ["192.0.2.2".parse().unwrap(), "127.0.0.1".parse().unwrap()],
        );
        let r = rules(&resolved(&a), &denied);
        let egress = egress_of(&r);
        let deny: Vec<_> = egress.iter().filter(|x| x.why == DEFAULT_DENY).collect();
        assert_eq!(deny.len(), 2);
        // One on the destination as routed (after a DNAT), one on the destination the guest
        // asked for (kube-proxy rewrites a service IP before the forward hook).
        let (routed, original) = (text(deny[0]), text(deny[1]));
        assert!(routed.contains(&j(json!({"payload": {"protocol": "ip", "field": "daddr"}}))));
        assert!(original.contains(&original_ct()), "{original}");
        for set in [&routed, &original] {
            for net in [
                r#"{"addr":"10.0.0.0","len":8}"#,
                r#"{"addr":"172.16.0.0","len":12}"#,
                r#"{"addr":"192.168.0.0","len":16}"#,
                r#"{"addr":"100.64.0.0","len":10}"#,
                r#"{"addr":"198.18.0.0","len":15}"#,
            ] {
                assert!(set.contains(net), "{net} missing: {set}");
            }
            // The service range lies inside 10/8: merged, not listed twice (nft refuses
            // overlapping intervals).
            assert!(!set.contains("10.96.0.0"), "{set}");
            assert!(
                !set.contains("!="),
                "nothing is carved out without egress.allow: {set}"
            );
        }
        let node: Vec<_> = egress
            .iter()
            .filter(|x| x.why == "no address of the node")
            .collect();
        assert_eq!(node.len(), 2);
        for n in &node {
            let t = text(n);
            assert!(
                t.contains(r#"{"addr":"192.0.2.2","len":32}"#) && t.contains("127.0.0.1"),
                "{t}"
            );
        }
        let ll: Vec<_> = egress
            .iter()
            .filter(|x| x.why.starts_with("no link-local"))
            .collect();
        assert!(text(ll[0]).contains("daddr") && text(ll[1]).contains("original"));
        // A node without addresses outside Imp's bridges gets no empty set (nft refuses those).
        let bare = rules(&resolved(&a), &Denied::new(&[], []));
        assert!(!bare.iter().any(|x| x.why == "no address of the node"));
    }

    #[test]
    fn egress_allow_carves_its_ranges_out_of_the_default_deny_and_limits_the_rest() {
        let mut a = attachment(true, 0);
        a.network.egress_deny = vec!["10.1.2.0/24".parse().unwrap()];
        a.network.egress_allow = vec![
            "10.1.0.0/16".parse().unwrap(),
            "198.51.100.0/24".parse().unwrap(),
        ];
        let r = rules_of(&resolved(&a));
        let egress = egress_of(&r);
        let deny = at(&egress, "spec.egress.deny");
        let allow = at(&egress, "spec.egress.allow");
        let default = at(&egress, DEFAULT_DENY);
        let node = at(&egress, "no address of the node");
        // The node's addresses are never opened; the user's deny wins over their allow; the
        // allow list limits before the default deny carves out.
        assert!(node < deny && deny < allow && allow < default);
        // The allow list is about the destination the guest asked for (a service IP it names
        // stays allowed after kube-proxy's DNAT).
        assert_eq!(
            egress[allow].expr,
            [
                original_daddr("!=", prefixes(&a.network.egress_allow)),
                verdict("drop")
            ]
        );
        for d in [egress[default], egress[default + 1]] {
            let t = text(d);
            let carve = t.find(r#""op":"!=""#).expect("a carve-out");
            assert!(
                t[carve..].contains(r#"{"addr":"10.1.0.0","len":16}"#),
                "{t}"
            );
        }
        // The deny list drops on both destinations too.
        assert!(
            text(egress[deny]).contains("payload") && text(egress[deny + 1]).contains("original")
        );
    }

    #[test]
    fn the_guests_resolvers_stay_reachable_for_dns_only() {
        let mut a = attachment(true, 2);
        a.ports[0].dns = vec!["10.96.0.10".parse().unwrap()];
        a.ports[1].dns = vec!["10.96.0.10".parse().unwrap(), "192.0.2.53".parse().unwrap()];
        let r = rules_of(&resolved(&a));
        let egress = egress_of(&r);
        let dns = at(&egress, "DNS to the guests' resolvers (spec.dns)");
        assert!(dns < at(&egress, DEFAULT_DENY));
        assert!(at(&egress, "no address of the node") < dns);
        let t = text(egress[dns]);
        for want in [
            original_ct().as_str(),
            r#"{"addr":"10.96.0.10","len":32}"#,
            r#"{"addr":"192.0.2.53","len":32}"#,
            j(payload("th", "dport", "==", json!(53))).as_str(),
            j(meta("oifname", "==", json!("eth0"))).as_str(),
            r#""accept":null"#,
        ] {
            assert!(t.contains(want), "{want} missing: {t}");
        }
        // No resolvers, no rule; no way out (a failed egress), no rule either.
        assert!(
            !egress_of(&rules_of(&resolved(&attachment(true, 2))))
                .iter()
                .any(|x| x.why.starts_with("DNS"))
        );
        let mut failed = resolved(&a);
        failed[0].egress = None;
        let r = rules_of(&failed);
        let egress = egress_of(&r);
        assert!(
            !egress
                .iter()
                .any(|x| x.why.starts_with("DNS") || x.why.starts_with("guests out"))
        );
        assert_eq!(
            egress.last().unwrap().why,
            "nothing else from guests (no VM-to-VM routing)"
        );
    }

    #[test]
    fn each_network_is_decided_in_its_own_chains() {
        let mut a = attachment(true, 1);
        a.network.ingress = vec![crate::api::Ingress {
            from: "0.0.0.0/0".parse().unwrap(),
            protocol: imp_api::IngressProtocol::Tcp,
            ports: vec![],
        }];
        let mut b = attachment(true, 1);
        b.network.id = "net-2".into();
        b.network.subnet = "198.51.100.0/24".parse().unwrap();
        b.network.egress_allow = vec!["203.0.113.0/24".parse().unwrap()];
        let nets = vec![
            Resolved {
                bridge: "impbr000000000b".into(),
                egress: Some("eth0".into()),
                attachment: &b,
            },
            Resolved {
                bridge: "impbr000000000a".into(),
                egress: Some("eth0".into()),
                attachment: &a,
            },
        ];
        let r = rules_of(&nets);
        // The base chain holds nothing but jumps, chosen by the bridge alone, and every guest's
        // packet meets its own network's egress jump before any ingress jump: a guest of A
        // sending to B's guest is decided (dropped) in A's chain, never admitted by B's
        // `from 0.0.0.0/0` (the real-kernel test caught an interleaved order).
        let forward = chain(&r, "forward");
        assert_eq!(forward.len(), 4);
        for (f, (dir, br, target)) in forward.iter().zip([
            (
                "iifname",
                "impbr000000000b",
                egress_chain("impbr000000000b"),
            ),
            (
                "iifname",
                "impbr000000000a",
                egress_chain("impbr000000000a"),
            ),
            (
                "oifname",
                "impbr000000000b",
                ingress_chain("impbr000000000b"),
            ),
            (
                "oifname",
                "impbr000000000a",
                ingress_chain("impbr000000000a"),
            ),
        ]) {
            assert_eq!(
                f.expr,
                [
                    meta(dir, "==", json!(br)),
                    json!({"jump": {"target": target}})
                ],
                "{}",
                text(f)
            );
        }
        // Every egress chain ends in a drop: a guest's packet is decided in its own network's
        // chain and never returns to the base chain's ingress jumps.
        for br in ["impbr000000000a", "impbr000000000b"] {
            let egress = chain(&r, &egress_chain(br));
            assert_eq!(text(egress.last().unwrap()), r#"[{"drop":null}]"#, "{br}");
            let ingress = chain(&r, &ingress_chain(br));
            assert_eq!(text(ingress.last().unwrap()), r#"[{"drop":null}]"#, "{br}");
        }
        // A's ingress rule and reply accept are in A's chains only; B's allow list in B's only.
        let whys = |c: &str| chain(&r, c).iter().map(|x| x.why).collect::<Vec<_>>();
        assert!(whys(&ingress_chain("impbr000000000a")).contains(&"spec.ingress"));
        assert!(!whys(&ingress_chain("impbr000000000b")).contains(&"spec.ingress"));
        assert!(
            whys(&egress_chain("impbr000000000a"))
                .contains(&"replies to admitted connections (spec.ingress)")
        );
        assert!(
            !whys(&egress_chain("impbr000000000b"))
                .contains(&"replies to admitted connections (spec.ingress)")
        );
        assert!(whys(&egress_chain("impbr000000000b")).contains(&"spec.egress.allow"));
        assert!(!whys(&egress_chain("impbr000000000a")).contains(&"spec.egress.allow"));
        // Only the jumps name the bridge in the forward path; the chains' rules do not need to.
        assert!(
            chain(&r, &ingress_chain("impbr000000000a"))
                .iter()
                .all(|x| !text(x).contains("impbr"))
        );
    }

    #[test]
    fn egress_lists_render_deny_before_allow() {
        let mut a = attachment(true, 0);
        a.network.egress_deny = vec!["10.0.0.0/8".parse().unwrap()];
        a.network.egress_allow = vec![
            "10.1.0.0/16".parse().unwrap(),
            "198.51.100.0/24".parse().unwrap(),
        ];
        let r = rules_of(&resolved(&a));
        let egress = egress_of(&r);
        assert!(at(&egress, "spec.egress.deny") < at(&egress, "spec.egress.allow"));
    }

    #[test]
    fn ingress_rules_accept_before_the_inbound_drop_and_let_replies_out() {
        let mut a = attachment(true, 1);
        a.network.egress_allow = vec!["10.1.0.0/16".parse().unwrap()];
        let plain = rules_of(&resolved(&a)).len();
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
        let r = rules_of(&resolved(&a));
        // Two admissions and one reply rule.
        assert_eq!(r.len(), plain + 3);
        let ingress = chain(&r, &ingress_chain("impbr0000000001"));
        let admitted: Vec<_> = ingress
            .iter()
            .enumerate()
            .filter(|(_, x)| x.why == "spec.ingress")
            .map(|(i, x)| (i, text(x)))
            .collect();
        assert_eq!(admitted.len(), 2);
        let inbound_drop = at(&ingress, "no connections into guests");
        assert!(admitted.iter().all(|(i, _)| *i < inbound_drop));
        assert!(at(&ingress, "replies to guests") < admitted[0].0);
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
        // Replies pass before the egress lists and the default deny could drop them (a client
        // in a private range), never before the link-local drop.
        let egress = egress_of(&r);
        let replies = at(&egress, "replies to admitted connections (spec.ingress)");
        assert!(at(&egress, "no link-local (cloud metadata)") < replies);
        assert!(replies < at(&egress, "no address of the node"));
        assert!(replies < at(&egress, "spec.egress.allow"));
        assert!(replies < at(&egress, DEFAULT_DENY));
        assert!(text(egress[replies]).contains("\"reply\""));
    }

    #[test]
    fn comments_are_content_hashes() {
        let a = attachment(true, 1);
        let r = rules_of(&resolved(&a));
        let k = keys(&r);
        assert_eq!(k.len(), r.len(), "every rule has its own key");
        let mut b = attachment(true, 1);
        b.ports[0].ip = "192.0.2.99".parse().unwrap();
        assert_ne!(keys(&rules_of(&resolved(&b))), k);
        assert_eq!(keys(&rules_of(&resolved(&attachment(true, 1)))), k);
    }

    #[test]
    fn batches_replace_and_delete_both_tables() {
        let a = attachment(true, 1);
        let r = rules_of(&resolved(&a));
        let b = replace_batch(&r);
        let cmds = b["nftables"].as_array().unwrap();
        // add+delete per table, add per table, the base chains, the network's two chains, the
        // rules.
        assert_eq!(cmds.len(), 4 + 2 + CHAINS.len() + 2 + r.len());
        assert_eq!(cmds[1]["delete"]["table"]["family"], "inet");
        // The network's chains exist before the first rule (a jump to a missing chain fails).
        let first_rule = cmds
            .iter()
            .position(|c| c["add"].get("rule").is_some())
            .unwrap();
        let chains: Vec<_> = cmds[..first_rule]
            .iter()
            .filter_map(|c| c["add"]["chain"]["name"].as_str())
            .collect();
        assert!(
            chains.contains(&egress_chain("impbr0000000001").as_str()),
            "{chains:?}"
        );
        assert!(
            chains.contains(&ingress_chain("impbr0000000001").as_str()),
            "{chains:?}"
        );
        assert_eq!(delete_batch()["nftables"].as_array().unwrap().len(), 4);
    }

    #[test]
    fn observed_keys_reads_only_imps_tables() {
        let a = attachment(true, 1);
        let r = rules_of(&resolved(&a));
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
