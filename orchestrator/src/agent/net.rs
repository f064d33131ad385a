// SPDX-License-Identifier: Apache-2.0
//! The agent's side of the pod network (see [`crate::network`]): taps and
//! leases for an instance before its launcher starts, `status.interfaces`
//! while it runs, removal when its launcher is cleaned up.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::sync::Arc;

use tracing::{info, warn};

use super::Shared;
use crate::controllers::util::{name, namespace, ns_name, uid};
use crate::launcher::LaunchSpec;
use crate::network::{
    DhcpServer, Leases, NetworkError, PodBridge, PodNetworkConfig, derived_mac, format_mac,
    parse_mac,
};
use crate::resources::VirtualMachineInstance;
use crate::resources::kubevirt::VmiInterfaceStatus;
use crate::runtime::VmNet;
use crate::store::{ListOptions, StoreExt};

/// A node's running pod network.
#[derive(Debug)]
pub(crate) struct PodNet {
    pub(crate) bridge: PodBridge,
    pub(crate) leases: Leases,
    _dhcp: DhcpServer,
}

impl PodNet {
    /// Sets up the bridge, NAT and DHCP; keeps (and re-registers the
    /// leases of) the taps of adopted launchers.
    pub(crate) fn start(
        cfg: &PodNetworkConfig,
        adopted: &[LaunchSpec],
    ) -> Result<PodNet, NetworkError> {
        let nets: Vec<&VmNet> = adopted.iter().flat_map(|s| s.vm.nets.iter()).collect();
        let keep: Vec<String> = nets.iter().map(|n| n.tap.clone()).collect();
        let bridge = PodBridge::setup(cfg, &keep)?;
        let leases = Leases::default();
        for (s, n) in adopted
            .iter()
            .flat_map(|s| s.vm.nets.iter().map(move |n| (s, n)))
        {
            if let (Ok(mac), Some(ip)) = (parse_mac(&n.mac), n.ip) {
                leases.insert(mac, ip, &s.vm.name);
            }
        }
        let dhcp = DhcpServer::start(cfg.clone(), leases.clone())?;
        Ok(PodNet {
            bridge,
            leases,
            _dhcp: dhcp,
        })
    }
}

/// The interfaces of `vmi` on the pod network, `(index, name, macAddress)`:
/// those whose network is `pod`, or KubeVirt's default interface when the
/// spec lists none (unless `autoattachPodInterface: false`).
fn pod_interfaces(vmi: &VirtualMachineInstance) -> Result<Vec<(String, Option<String>)>, String> {
    let d = &vmi.spec.domain.devices;
    if d.interfaces.is_empty() && vmi.spec.networks.is_empty() {
        if d.autoattach_pod_interface == Some(false) {
            return Ok(Vec::new());
        }
        return Ok(vec![("default".into(), None)]);
    }
    let mut out = Vec::new();
    for ifc in &d.interfaces {
        let net = vmi
            .spec
            .networks
            .iter()
            .find(|n| n.name == ifc.name)
            .ok_or(format!(
                "interface {:?} has no network of that name",
                ifc.name
            ))?;
        if net.pod.is_none() {
            return Err(format!(
                "network {:?}: only the pod network is supported on this node",
                net.name
            ));
        }
        if ifc.model == Some(crate::resources::kubevirt::InterfaceModel::E1000) {
            return Err(format!(
                "interface {:?}: model e1000 is not offered by the sheaf runtimes (use virtio)",
                ifc.name
            ));
        }
        out.push((ifc.name.clone(), ifc.mac_address.clone()));
    }
    Ok(out)
}

/// Gives `spec` one tap per pod interface of `vmi` (on the node's bridge,
/// with a lease for its MAC). `Err`: a message for the VMI's condition;
/// nothing is left configured then.
pub(crate) async fn attach(
    shared: &Arc<Shared>,
    vmi: &VirtualMachineInstance,
    spec: &mut LaunchSpec,
) -> Result<(), String> {
    let ifaces = pod_interfaces(vmi)?;
    if ifaces.is_empty() {
        return Ok(());
    }
    let Some(pod) = shared.pod.get() else {
        warn!(vmi = %ns_name(vmi), "this node has no pod network: the instance gets no network card");
        return Ok(());
    };
    let cfg = pod.bridge.config();
    // Addresses and MACs in use by other instances of the cluster.
    let all: Vec<VirtualMachineInstance> = shared
        .store
        .list_typed(None, &ListOptions::default())
        .await
        .map_err(|e| format!("listing instances for address allocation: {e}"))?;
    let me = ns_name(vmi);
    let mut used_ip = BTreeSet::new();
    let mut used_mac = std::collections::BTreeMap::new();
    for o in all.iter().filter(|o| ns_name(*o) != me) {
        for s in o.status.iter().flat_map(|s| s.interfaces.iter().flatten()) {
            if let Some(ip) = s
                .ip_address
                .as_deref()
                .and_then(|a| a.parse::<Ipv4Addr>().ok())
            {
                used_ip.insert(ip);
            }
            if let Some(m) = s.mac.as_deref().and_then(|m| parse_mac(m).ok()) {
                used_mac.insert(m, ns_name(o));
            }
        }
    }
    let mine: Vec<VmiInterfaceStatus> = vmi
        .status
        .as_ref()
        .and_then(|s| s.interfaces.clone())
        .unwrap_or_default();
    let mut made: Vec<VmNet> = Vec::new();
    let fail = |made: &[VmNet], msg: String| {
        release(pod, made);
        Err(msg)
    };
    for (i, (ifname, mac)) in ifaces.iter().enumerate() {
        let key = format!("{}/{}/{ifname}", namespace(vmi), name(vmi));
        let mac = match mac {
            Some(m) => match parse_mac(m) {
                Ok(m) => m,
                Err(e) => return fail(&made, format!("interface {ifname:?}: {e}")),
            },
            None => derived_mac(&key),
        };
        if let Some(other) = used_mac.get(&mac) {
            return fail(
                &made,
                format!(
                    "interface {ifname:?}: MAC {} is already used by {other}",
                    format_mac(&mac)
                ),
            );
        }
        if made.iter().any(|n| n.mac == format_mac(&mac)) {
            return fail(
                &made,
                format!("two interfaces have the MAC {}", format_mac(&mac)),
            );
        }
        // The address this instance had (a restart, another node), else a
        // new one seeded by its name.
        let before = mine
            .iter()
            .find(|s| s.name.as_deref() == Some(ifname))
            .and_then(|s| s.ip_address.as_deref()?.parse::<Ipv4Addr>().ok())
            .filter(|ip| cfg.is_guest_address(*ip) && !used_ip.contains(ip));
        let Some(ip) = before.or_else(|| cfg.pick_address(&key, &used_ip)) else {
            return fail(
                &made,
                format!("the pod network {} has no free address", cfg.cidr()),
            );
        };
        used_ip.insert(ip);
        let tap = PodBridge::tap_name(uid(vmi), i);
        if let Err(e) = pod.bridge.add_tap(&tap) {
            return fail(&made, format!("interface {ifname:?}: {e}"));
        }
        pod.leases.insert(mac, ip, name(vmi));
        info!(vmi = %me, interface = %ifname, %tap, mac = %format_mac(&mac), %ip, "pod interface");
        made.push(VmNet {
            name: ifname.clone(),
            tap,
            mac: format_mac(&mac),
            ip: Some(ip),
        });
    }
    spec.vm.nets = made;
    Ok(())
}

/// `status.interfaces` of a running instance: name, MAC and tap always;
/// the address once the guest's DHCP request was acknowledged (or when
/// the status already showed it: an agent restart forgets bindings).
pub(crate) fn interfaces_status(
    shared: &Shared,
    spec: &LaunchSpec,
    before: Option<&[VmiInterfaceStatus]>,
) -> Option<Vec<VmiInterfaceStatus>> {
    if spec.vm.nets.is_empty() {
        return None;
    }
    let pod = shared.pod.get();
    Some(
        spec.vm
            .nets
            .iter()
            .map(|n| {
                let bound = pod
                    .zip(parse_mac(&n.mac).ok())
                    .and_then(|(p, m)| p.leases.get(&m))
                    .is_some_and(|l| l.bound && Some(l.ip) == n.ip);
                let shown = before.into_iter().flatten().any(|s| {
                    s.name.as_deref() == Some(&n.name)
                        && s.ip_address.as_deref() == n.ip.map(|i| i.to_string()).as_deref()
                });
                let ip = (bound || shown)
                    .then(|| n.ip.map(|i| i.to_string()))
                    .flatten();
                VmiInterfaceStatus {
                    name: Some(n.name.clone()),
                    ip_addresses: ip.clone().map(|i| vec![i]),
                    ip_address: ip,
                    mac: Some(n.mac.clone()),
                    interface_name: Some(n.tap.clone()),
                }
            })
            .collect(),
    )
}

/// Removes the taps and leases of a launch (its launcher is gone).
pub(crate) fn detach(shared: &Shared, spec: &LaunchSpec) {
    if let Some(pod) = shared.pod.get() {
        release(pod, &spec.vm.nets);
    }
}

/// Removes the taps and leases of `nets`.
fn release(pod: &PodNet, nets: &[VmNet]) {
    for n in nets {
        pod.bridge.delete_tap(&n.tap);
        if let Ok(m) = parse_mac(&n.mac) {
            pod.leases.remove(&m);
        }
    }
}
