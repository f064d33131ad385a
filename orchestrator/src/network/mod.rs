// SPDX-License-Identifier: Apache-2.0
//! The pod network of a node: KubeVirt's default network (`networks[].pod`)
//! with the `masquerade` binding, on real Linux networking.
//!
//! ```text
//!   node (its network namespace in `cluster up --netns`)
//!   ┌──────────────────────────────────────────────────────────────┐
//!   │ bridge sheafpod  10.244.0.1/16  (the gateway every VM sees)  │
//!   │   ├── tap shp<uid>0 ── virtio-net of VM a (10.244.x.y by DHCP)│
//!   │   └── tap shp<uid>1 ── ...                                   │
//!   │ DHCP server (dhcproto) on the bridge: known MACs only        │
//!   │ nftables table ip sheaf_pod: masquerade 10.244.0.0/16 → out  │
//!   └──────────────────────────────────────────────────────────────┘
//! ```
//!
//! A VM's MAC (unless `macAddress` is set) and its address are derived from
//! its namespace and name, so a VM restarted on another node keeps both
//! (the address is the first free one on a probe sequence seeded by the
//! name; addresses in use are those in other instances' `status.interfaces`).
//! The agent creates one tap per interface before the launcher starts and
//! removes it when the launcher is cleaned up; `status.interfaces[].ipAddress`
//! is filled once the guest's DHCP request was acknowledged.

pub mod dhcp;
pub mod host;

use std::collections::{BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

pub use dhcp::DhcpServer;
pub use host::{NetworkError, PodBridge};

/// Where the pod network lives on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodNetworkConfig {
    /// Network address of the pod CIDR (`10.244.0.0`).
    pub network: Ipv4Addr,
    /// Prefix length (8..=30).
    pub prefix: u8,
    /// Bridge name (at most 15 bytes).
    pub bridge: String,
    /// DNS server handed out by DHCP (none: no DNS option).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<Ipv4Addr>,
}

impl Default for PodNetworkConfig {
    fn default() -> Self {
        PodNetworkConfig {
            network: Ipv4Addr::new(10, 244, 0, 0),
            prefix: 16,
            bridge: "sheafpod".into(),
            dns: None,
        }
    }
}

impl PodNetworkConfig {
    /// Parses `A.B.C.D/N`.
    pub fn parse_cidr(s: &str) -> Result<(Ipv4Addr, u8), NetworkError> {
        let bad = || {
            NetworkError::Config(format!(
                "pod CIDR {s:?}: expected A.B.C.D/N with N in 8..=30"
            ))
        };
        let (a, n) = s.split_once('/').ok_or_else(bad)?;
        let a: Ipv4Addr = a.parse().map_err(|_| bad())?;
        let n: u8 = n.parse().map_err(|_| bad())?;
        if !(8..=30).contains(&n) {
            return Err(bad());
        }
        let mask = u32::MAX << (32 - n);
        if u32::from(a) & !mask != 0 {
            return Err(NetworkError::Config(format!(
                "pod CIDR {s:?}: host bits set (network address is {})",
                Ipv4Addr::from(u32::from(a) & mask)
            )));
        }
        Ok((a, n))
    }

    /// Checks the fields.
    pub fn validate(&self) -> Result<(), NetworkError> {
        Self::parse_cidr(&format!("{}/{}", self.network, self.prefix))?;
        host::check_link_name(&self.bridge)?;
        Ok(())
    }

    /// The gateway (the bridge's address): the first host address.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + 1)
    }

    /// The netmask.
    pub fn netmask(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::MAX << (32 - self.prefix))
    }

    /// `network/prefix`.
    pub fn cidr(&self) -> String {
        format!("{}/{}", self.network, self.prefix)
    }

    /// Whether `ip` is a guest address of this network (not the network,
    /// gateway or broadcast address).
    pub fn is_guest_address(&self, ip: Ipv4Addr) -> bool {
        let (n, ip) = (u32::from(self.network), u32::from(ip));
        let size = 1u32 << (32 - self.prefix);
        ip > n + 1 && ip < n + size - 1
    }

    /// The address for `key` (`namespace/name/interface`): the first
    /// address on a probe sequence seeded by the key that is not in `used`.
    pub fn pick_address(&self, key: &str, used: &BTreeSet<Ipv4Addr>) -> Option<Ipv4Addr> {
        let hosts = (1u32 << (32 - self.prefix)) - 3; // minus network, gateway, broadcast
        let start = fnv(key.as_bytes()) % hosts;
        (0..hosts)
            .map(|i| Ipv4Addr::from(u32::from(self.network) + 2 + (start + i) % hosts))
            .find(|ip| !used.contains(ip))
    }
}

/// FNV-1a, for stable derived addresses (not security).
fn fnv(b: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for x in b {
        h ^= u32::from(*x);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// A locally administered unicast MAC derived from `key`
/// (`namespace/name/interface`): `02:` + 5 bytes of a 64-bit FNV-1a hash.
pub fn derived_mac(key: &str) -> [u8; 6] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in key.as_bytes() {
        h ^= u64::from(*x);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let b = h.to_be_bytes();
    [0x02, b[0], b[1], b[2], b[3], b[4]]
}

/// Parses `aa:bb:cc:dd:ee:ff` (or `-` separated); refuses multicast.
pub fn parse_mac(s: &str) -> Result<[u8; 6], NetworkError> {
    let bad = || {
        NetworkError::Config(format!(
            "MAC address {s:?}: expected six hex bytes like 02:00:00:aa:bb:cc"
        ))
    };
    let parts: Vec<&str> = s.split([':', '-']).collect();
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut m = [0u8; 6];
    for (o, p) in m.iter_mut().zip(&parts) {
        // from_str_radix alone would take a sign ("+a").
        if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        *o = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    if m[0] & 1 != 0 {
        return Err(NetworkError::Config(format!(
            "MAC address {s:?} is multicast"
        )));
    }
    Ok(m)
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// One address the DHCP server hands out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The address.
    pub ip: Ipv4Addr,
    /// Host name option (the VM name).
    pub hostname: String,
    /// The guest's REQUEST was acknowledged: it holds the address.
    pub bound: bool,
}

/// The leases of a node, by MAC: filled by the agent before a launch,
/// read and marked bound by the DHCP server.
#[derive(Debug, Clone, Default)]
pub struct Leases(Arc<Mutex<HashMap<[u8; 6], Lease>>>);

impl Leases {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 6], Lease>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Adds (or replaces) the lease of `mac`.
    pub fn insert(&self, mac: [u8; 6], ip: Ipv4Addr, hostname: &str) {
        self.lock().insert(
            mac,
            Lease {
                ip,
                hostname: hostname.to_string(),
                bound: false,
            },
        );
    }
    /// Removes the lease of `mac`.
    pub fn remove(&self, mac: &[u8; 6]) {
        self.lock().remove(mac);
    }
    /// The lease of `mac`.
    pub fn get(&self, mac: &[u8; 6]) -> Option<Lease> {
        self.lock().get(mac).cloned()
    }
    /// Marks the lease of `mac` not bound (the guest released it).
    pub fn unbind(&self, mac: &[u8; 6]) {
        if let Some(l) = self.lock().get_mut(mac) {
            l.bound = false;
        }
    }
    /// Marks the lease of `mac` bound; false if there is none for `ip`.
    pub fn bind(&self, mac: &[u8; 6], ip: Ipv4Addr) -> bool {
        match self.lock().get_mut(mac) {
            Some(l) if l.ip == ip => {
                l.bound = true;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_and_addresses() {
        assert!(PodNetworkConfig::parse_cidr("10.244.0.0/16").is_ok());
        for bad in [
            "10.244.0.1/16",
            "10.244.0.0",
            "10.244.0.0/31",
            "x/16",
            "10.244.0.0/7",
        ] {
            assert!(PodNetworkConfig::parse_cidr(bad).is_err(), "{bad}");
        }
        let c = PodNetworkConfig {
            network: Ipv4Addr::new(10, 9, 0, 0),
            prefix: 29,
            ..Default::default()
        };
        assert_eq!(c.gateway(), Ipv4Addr::new(10, 9, 0, 1));
        assert_eq!(c.netmask(), Ipv4Addr::new(255, 255, 255, 248));
        // 8 addresses: .0 network, .1 gateway, .7 broadcast: 5 for guests.
        let mut used = BTreeSet::new();
        for i in 0..5 {
            let ip = c.pick_address(&format!("ns/vm{i}"), &used).unwrap();
            assert!(c.is_guest_address(ip), "{ip}");
            assert!(used.insert(ip));
        }
        assert_eq!(c.pick_address("ns/full", &used), None);
        // Stable for a key.
        let d = PodNetworkConfig::default();
        let e = BTreeSet::new();
        assert_eq!(
            d.pick_address("a/b/default", &e),
            d.pick_address("a/b/default", &e)
        );
    }

    #[test]
    fn macs() {
        let m = derived_mac("default/vm/default");
        assert_eq!(m[0], 2);
        assert_eq!(m, derived_mac("default/vm/default"));
        assert_ne!(m, derived_mac("default/vm2/default"));
        assert_eq!(parse_mac(&format_mac(&m)).unwrap(), m);
        assert!(
            parse_mac("01:00:00:00:00:01")
                .unwrap_err()
                .to_string()
                .contains("multicast")
        );
        for bad in [
            "02:00:00:00:00",
            "02:00:00:00:00:0g",
            "0200:00:00:00:00:01",
            "",
            "+a:00:00:00:00:00",
        ] {
            assert!(parse_mac(bad).is_err(), "{bad}");
        }
    }
}
