//! What a VM network needs from the node, built from an ImpNetwork spec by the agent and from a
//! VM spec's attachment by imp-runtime (whose `network` module sets it up on the host).

use std::net::Ipv4Addr;

use crate::api::NetworkAttachment;

/// An ImpNetwork field that is not what the node needs (the API server's CEL checks the same, so
/// this is a second line).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("network {network}: {field} {value:?} is not an IPv4 address/CIDR")]
pub struct NetworkSpecError {
    pub network: String,
    pub field: String,
    pub value: String,
}

/// What a VM network needs from the node; built from the ImpNetwork spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmNetwork {
    /// Stable identity of the ImpNetwork (its uid): names the bridge, so two networks of the
    /// same name in different namespaces never share one.
    pub id: String,
    pub subnet: ipnet::Ipv4Net,
    pub gateway: Ipv4Addr,
    /// Masquerade traffic leaving through the egress interface.
    pub nat: bool,
    /// `nat.egressInterface`; `None`: the interface of the node's default route.
    pub egress_interface: Option<String>,
    /// `spec.egress`: destinations the guests may reach (empty: everything not denied).
    pub egress_allow: Vec<ipnet::Ipv4Net>,
    /// Destinations the guests may never reach; wins over `egress_allow`.
    pub egress_deny: Vec<ipnet::Ipv4Net>,
    /// `spec.ingress`: connections into the guests the node admits (empty: none).
    pub ingress: Vec<crate::api::Ingress>,
}

impl VmNetwork {
    /// From an ImpNetwork (its uid and spec); errors name the field.
    pub fn from_spec(uid: &str, spec: &imp_api::ImpNetworkSpec) -> Result<Self, NetworkSpecError> {
        let bad = |field: &str, value: &str| NetworkSpecError {
            network: uid.to_owned(),
            field: field.to_owned(),
            value: value.to_owned(),
        };
        let cidrs = |field: &str, list: &[String]| {
            list.iter()
                .map(|c| c.parse().map_err(|_| bad(field, c)))
                .collect::<Result<Vec<ipnet::Ipv4Net>, _>>()
        };
        let egress = spec.egress.clone().unwrap_or_default();
        let nat = spec.nat.clone().unwrap_or_default();
        Ok(Self {
            id: uid.to_owned(),
            subnet: spec
                .subnet
                .parse::<ipnet::Ipv4Net>()
                .map_err(|_| bad("spec.subnet", &spec.subnet))?
                .trunc(),
            gateway: spec
                .gateway
                .parse()
                .map_err(|_| bad("spec.gateway", &spec.gateway))?,
            nat: nat.enabled,
            egress_interface: nat.egress_interface,
            egress_allow: cidrs("spec.egress.allow", &egress.allow)?,
            egress_deny: cidrs("spec.egress.deny", &egress.deny)?,
            ingress: spec
                .ingress
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let field = format!("spec.ingress[{i}].from");
                    Ok(crate::api::Ingress {
                        from: r
                            .from
                            .parse::<ipnet::Ipv4Net>()
                            .map_err(|_| bad(&field, &r.from))?
                            .trunc(),
                        protocol: r.protocol,
                        ports: r.ports.clone(),
                    })
                })
                .collect::<Result<_, NetworkSpecError>>()?,
        })
    }

    /// The network half of a runtime VM spec's attachment.
    pub fn from_attachment(a: &NetworkAttachment) -> Self {
        Self {
            id: a.network_id.clone(),
            subnet: a.address.trunc(),
            gateway: a.gateway,
            nat: a.nat,
            egress_interface: a.egress_interface.clone(),
            egress_allow: a.egress_allow.clone(),
            egress_deny: a.egress_deny.clone(),
            ingress: a.ingress.clone(),
        }
    }

    /// The guest's kernel command-line words for address `ip` (docs/network.md).
    pub fn boot_args(
        &self,
        ip: Ipv4Addr,
        mtu: Option<u32>,
        dns: &[impl std::fmt::Display],
    ) -> String {
        let mut out = format!("imp.net={ip}/{},{}", self.subnet.prefix_len(), self.gateway);
        if let Some(mtu) = mtu {
            out.push_str(&format!(",{mtu}"));
        }
        if !dns.is_empty() {
            let dns: Vec<String> = dns.iter().map(ToString::to_string).collect();
            out.push_str(&format!(" imp.dns={}", dns.join(",")));
        }
        out
    }
}
