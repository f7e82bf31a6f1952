//! ImpNetwork: subnet, gateway, NAT and DNS for the VMs attached to it.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// A routed subnet on each node's bridge; VMs get addresses from the built-in IPAM.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "imp.dev",
    version = "v1alpha1",
    kind = "ImpNetwork",
    namespaced,
    shortname = "impnet",
    category = "imp",
    status = "ImpNetworkStatus",
    doc = "Subnet, gateway, NAT and DNS for Imp microVMs.",
    printcolumn(name = "Subnet", type_ = "string", json_path = ".spec.subnet"),
    printcolumn(name = "NAT", type_ = "boolean", json_path = ".spec.nat.enabled"),
    printcolumn(
        name = "Gateway",
        type_ = "string",
        json_path = ".spec.gateway",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = kube::core::Rule::new("!isCIDR(self.subnet) || !isIP(self.gateway) || cidr(self.subnet).containsIP(self.gateway)")
    .message("gateway must lie inside subnet").field_path(".gateway"))]
#[x_kube(validation = kube::core::Rule::new("!isCIDR(self.subnet) || !isIP(self.gateway) || ip(self.gateway).family() == cidr(self.subnet).ip().family()")
    .message("gateway and subnet must be the same IP family").field_path(".gateway"))]
#[serde(rename_all = "camelCase")]
pub struct ImpNetworkSpec {
    /// CIDR of the VM subnet, e.g. 10.44.0.0/24.
    #[x_kube(validation = kube::core::Rule::new("isCIDR(self)").message("subnet must be a CIDR such as 10.44.0.0/24"))]
    #[schemars(length(max = 64))]
    pub subnet: String,
    /// Address of the node-side bridge inside the subnet; VMs route through it.
    #[x_kube(validation = kube::core::Rule::new("isIP(self)").message("gateway must be an IP address"))]
    #[schemars(length(max = 64))]
    pub gateway: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nat: Option<Nat>,
    /// Resolvers written into the guest's resolv.conf.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = kube::core::Rule::new("self.all(s, isIP(s))").message("every dns entry must be an IP address"))]
    #[schemars(length(max = 8), inner(length(max = 64)))]
    pub dns: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipam: Option<Ipam>,
    /// Where guests may send traffic. Default: anywhere out of the node's egress interface
    /// except private ranges (10/8, 172.16/12, 192.168/16, 100.64/10) and the platform's
    /// reserved ranges, which `allow` opens where the platform allows it; never the node itself
    /// or link-local 169.254.0.0/16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Egress>,
    /// Connections into the guests the node admits, e.g. to a persistent VM's service or to
    /// wake a ScaleToZero VM. Default: none (replies to the guests' own connections only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub ingress: Vec<IngressRule>,
}

/// One admitted kind of inbound connection: from a source CIDR to some ports of the guests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct IngressRule {
    /// IPv4 CIDR the connections come from, e.g. 192.0.2.0/24 (0.0.0.0/0: anywhere).
    #[x_kube(validation = kube::core::Rule::new("isCIDR(self) && cidr(self).ip().family() == 4").message("ingress.from must be an IPv4 CIDR such as 192.0.2.0/24"))]
    #[schemars(length(max = 64))]
    pub from: String,
    /// Transport protocol (default TCP).
    #[serde(default)]
    pub protocol: IngressProtocol,
    /// Destination ports on the guests; empty: every port of the protocol.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(range(min = 1, max = 65535)))]
    pub ports: Vec<u16>,
}

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum IngressProtocol {
    #[default]
    #[serde(rename = "TCP")]
    Tcp,
    #[serde(rename = "UDP")]
    Udp,
}

/// Destination CIDR lists; `deny` wins over `allow`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Egress {
    /// When non-empty, guests may reach only these IPv4 CIDRs. An entry reaching into a private
    /// or reserved range must lie inside the ranges the platform allows (else the node refuses
    /// the network) and opens that range to the guests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = kube::core::Rule::new("self.all(c, isCIDR(c) && cidr(c).ip().family() == 4)").message("every egress.allow entry must be an IPv4 CIDR"))]
    #[schemars(length(max = 64), inner(length(max = 64)))]
    pub allow: Vec<String>,
    /// IPv4 CIDRs guests may never reach, e.g. internal ranges.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = kube::core::Rule::new("self.all(c, isCIDR(c) && cidr(c).ip().family() == 4)").message("every egress.deny entry must be an IPv4 CIDR"))]
    #[schemars(length(max = 64), inner(length(max = 64)))]
    pub deny: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Nat {
    /// Masquerade VM traffic leaving the node.
    pub enabled: bool,
    /// Host interface for egress; default: the interface of the node's default route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 15))]
    pub egress_interface: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Ipam {
    #[serde(rename = "type", default)]
    pub kind: IpamKind,
}

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum IpamKind {
    /// Addresses handed out per node by imp-runtime from the subnet.
    #[default]
    Builtin,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImpNetworkStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Addresses currently allocated to VMs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<u32>,
    /// Addresses the built-in IPAM can hand out (the subnet minus network, broadcast and
    /// gateway; at most 4096, the size the status object can hold).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u32>,
    /// The built-in IPAM's durable record: guest address -> the ImpVM holding it. Written
    /// only by the operator, with resourceVersion-guarded replaces.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub allocations: BTreeMap<String, IpAllocation>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The ImpVM an address belongs to (same namespace as the ImpNetwork).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IpAllocation {
    /// ImpVM name.
    pub vm: String,
    /// ImpVM uid: a VM re-created under the same name gets a new address.
    pub uid: String,
}
