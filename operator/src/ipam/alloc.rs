//! The built-in IPAM's pure half: which address a VM gets from a subnet, given what is already
//! allocated. No I/O; mod.rs reads and writes the allocations on the ImpNetwork's status.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use imp_api::IpAllocation;

/// Most addresses one network hands out: every allocation is an entry in the ImpNetwork's
/// status, and the object must stay well below the API server's size limit (~1.5 MiB).
pub const MAX_ADDRESSES: u32 = 4096;

/// A subnet and its gateway, validated: the addresses IPAM may hand out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    subnet: ipnet::Ipv4Net,
    gateway: Ipv4Addr,
}

impl Pool {
    /// `Err` names the fault; the caller adds the network's name.
    pub fn new(subnet: &str, gateway: &str) -> Result<Self, String> {
        let subnet: ipnet::Ipv4Net = subnet
            .parse()
            .map_err(|_| format!("spec.subnet {subnet:?} is not an IPv4 CIDR"))?;
        let gateway: Ipv4Addr = gateway
            .parse()
            .map_err(|_| format!("spec.gateway {gateway:?} is not an IPv4 address"))?;
        let subnet = subnet.trunc();
        if subnet.prefix_len() > 30 {
            return Err(format!(
                "spec.subnet {subnet} is too small: IPAM needs /30 or larger"
            ));
        }
        if !subnet.contains(&gateway)
            || gateway == subnet.network()
            || gateway == subnet.broadcast()
        {
            return Err(format!(
                "spec.gateway {gateway} is not a host address of {subnet}"
            ));
        }
        Ok(Self { subnet, gateway })
    }

    /// Host addresses in order, without the gateway, at most [`MAX_ADDRESSES`].
    fn candidates(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        self.subnet
            .hosts()
            .filter(|ip| *ip != self.gateway)
            .take(MAX_ADDRESSES as usize)
    }

    pub fn capacity(&self) -> u32 {
        let hosts = (1u64 << (32 - self.subnet.prefix_len())) - 2;
        (hosts - 1).min(u64::from(MAX_ADDRESSES)) as u32
    }

    pub fn prefix_len(&self) -> u8 {
        self.subnet.prefix_len()
    }

    pub fn gateway(&self) -> Ipv4Addr {
        self.gateway
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The VM already holds this address (a retry, or a second operator replica).
    Have(Ipv4Addr),
    /// Record this address for the VM.
    Take(Ipv4Addr),
    /// No free address.
    Exhausted,
}

/// The VM's address: the one it holds, else the lowest free one (so freed addresses are
/// reused first and allocations stay dense).
pub fn allocate(pool: &Pool, allocations: &BTreeMap<String, IpAllocation>, uid: &str) -> Decision {
    if let Some(ip) = allocations
        .iter()
        .find(|(_, a)| a.uid == uid)
        .and_then(|(ip, _)| ip.parse().ok())
    {
        return Decision::Have(ip);
    }
    let taken: BTreeSet<Ipv4Addr> = allocations.keys().filter_map(|k| k.parse().ok()).collect();
    pool.candidates()
        .find(|ip| !taken.contains(ip))
        .map_or(Decision::Exhausted, Decision::Take)
}

/// Drop every allocation whose VM uid is not in `live`; returns the freed addresses.
pub fn retain_live(
    allocations: &mut BTreeMap<String, IpAllocation>,
    live: &BTreeSet<String>,
) -> Vec<String> {
    let freed: Vec<String> = allocations
        .iter()
        .filter(|(_, a)| !live.contains(&a.uid))
        .map(|(ip, _)| ip.clone())
        .collect();
    for ip in &freed {
        allocations.remove(ip);
    }
    freed
}

/// Allocations that count against the pool (entries outside it, e.g. after a subnet change,
/// are kept until their VM goes, but do not block addresses of the new subnet).
pub fn in_pool(pool: &Pool, allocations: &BTreeMap<String, IpAllocation>) -> u32 {
    allocations
        .keys()
        .filter_map(|k| k.parse::<Ipv4Addr>().ok())
        .filter(|ip| pool.subnet.contains(ip) && *ip != pool.gateway)
        .count() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(entries: &[(&str, &str)]) -> BTreeMap<String, IpAllocation> {
        entries
            .iter()
            .map(|(ip, uid)| {
                (
                    (*ip).to_owned(),
                    IpAllocation {
                        vm: format!("vm-{uid}"),
                        uid: (*uid).to_owned(),
                    },
                )
            })
            .collect()
    }

    #[test]
    fn never_hands_out_network_broadcast_or_gateway() {
        let pool = Pool::new("192.0.2.0/29", "192.0.2.1").unwrap();
        assert_eq!(pool.capacity(), 5);
        let mut a = BTreeMap::new();
        let mut got = Vec::new();
        for i in 0..5 {
            let Decision::Take(ip) = allocate(&pool, &a, &format!("u{i}")) else {
                panic!("exhausted early at {i}");
            };
            got.push(ip.to_string());
            a.insert(
                ip.to_string(),
                IpAllocation {
                    vm: format!("v{i}"),
                    uid: format!("u{i}"),
                },
            );
        }
        assert_eq!(
            got,
            [
                "192.0.2.2",
                "192.0.2.3",
                "192.0.2.4",
                "192.0.2.5",
                "192.0.2.6"
            ]
        );
        assert_eq!(allocate(&pool, &a, "u9"), Decision::Exhausted);
        // A gateway in the middle is skipped too.
        let pool = Pool::new("192.0.2.0/30", "192.0.2.2").unwrap();
        assert_eq!(pool.capacity(), 1);
        assert_eq!(
            allocate(&pool, &BTreeMap::new(), "u"),
            Decision::Take("192.0.2.1".parse().unwrap())
        );
    }

    #[test]
    fn retry_returns_the_held_address_and_freed_ones_are_reused_lowest_first() {
        let pool = Pool::new("192.0.2.0/24", "192.0.2.1").unwrap();
        let mut a = alloc(&[("192.0.2.2", "a"), ("192.0.2.3", "b"), ("192.0.2.4", "c")]);
        assert_eq!(
            allocate(&pool, &a, "b"),
            Decision::Have("192.0.2.3".parse().unwrap())
        );
        let live: BTreeSet<String> = ["a".to_owned(), "c".to_owned()].into();
        assert_eq!(retain_live(&mut a, &live), ["192.0.2.3"]);
        assert_eq!(
            allocate(&pool, &a, "d"),
            Decision::Take("192.0.2.3".parse().unwrap())
        );
        assert_eq!(in_pool(&pool, &a), 2);
    }

    #[test]
    fn capacity_is_capped_and_foreign_entries_do_not_count() {
        let pool = Pool::new("10.0.0.0/16", "10.0.0.1").unwrap();
        assert_eq!(pool.capacity(), MAX_ADDRESSES);
        assert_eq!(pool.candidates().count(), MAX_ADDRESSES as usize);
        let a = alloc(&[("198.51.100.7", "old"), ("junk", "x")]);
        assert_eq!(in_pool(&pool, &a), 0);
        assert_eq!(
            allocate(&pool, &a, "new"),
            Decision::Take("10.0.0.2".parse().unwrap())
        );
        // Non-canonical subnets are truncated.
        assert_eq!(
            Pool::new("192.0.2.77/24", "192.0.2.1").unwrap().capacity(),
            253
        );
    }

    #[test]
    fn bad_specs_name_the_field() {
        let e = |s, g| Pool::new(s, g).unwrap_err();
        assert!(e("nope", "192.0.2.1").starts_with("spec.subnet"));
        assert!(e("fd00::/64", "fd00::1").starts_with("spec.subnet"));
        assert!(e("192.0.2.0/31", "192.0.2.1").contains("too small"));
        assert!(e("192.0.2.0/24", "x").starts_with("spec.gateway"));
        assert!(e("192.0.2.0/24", "192.0.2.0").starts_with("spec.gateway"));
        assert!(e("192.0.2.0/24", "192.0.2.255").starts_with("spec.gateway"));
        assert!(e("192.0.2.0/24", "198.51.100.1").starts_with("spec.gateway"));
    }
}
