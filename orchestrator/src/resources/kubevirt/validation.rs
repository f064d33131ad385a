// SPDX-License-Identifier: Apache-2.0
//! Semantic checks of an instance spec.

use std::collections::BTreeSet;

use super::super::decode::{FieldError, is_dns_label, is_dns_subdomain};
use super::super::quantity::{parse_quantity_bytes, parse_quantity_millis};

use super::*;

fn is_mac(s: &str) -> bool {
    let parts: Vec<&str> = s.split([':', '-']).collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Semantic checks of an instance spec; `p` is the path prefix (`spec` or `spec.template.spec`).
pub fn validate_vmi_spec(s: &VirtualMachineInstanceSpec, p: &str, errs: &mut Vec<FieldError>) {
    let d = &s.domain;
    // Memory: KubeVirt requires a request or a guest size.
    let req_mem = d
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("memory"));
    let guest_mem = d.memory.as_ref().and_then(|m| m.guest.as_ref());
    if req_mem.is_none() && guest_mem.is_none() {
        errs.push(FieldError::required(
            format!("{p}.domain.resources.requests.memory"),
            "set resources.requests.memory or memory.guest",
        ));
    }
    for (key, rr) in [
        (
            "requests",
            d.resources.as_ref().and_then(|r| r.requests.as_ref()),
        ),
        (
            "limits",
            d.resources.as_ref().and_then(|r| r.limits.as_ref()),
        ),
    ] {
        for (name, q) in rr.into_iter().flatten() {
            let field = format!("{p}.domain.resources.{key}.{name}");
            let ok = match name.as_str() {
                "cpu" => parse_quantity_millis(&q.0).is_some_and(|m| m > 0),
                "memory" | "ephemeral-storage" | "storage" => {
                    parse_quantity_bytes(&q.0).is_some_and(|b| b > 0)
                }
                _ => parse_quantity_millis(&q.0).is_some(),
            };
            if !ok {
                errs.push(FieldError::invalid(
                    field,
                    &q.0,
                    "must be a positive quantity",
                ));
            }
        }
    }
    if let Some(g) = guest_mem
        && parse_quantity_bytes(&g.0).is_none_or(|b| b < (1 << 20))
    {
        errs.push(FieldError::invalid(
            format!("{p}.domain.memory.guest"),
            &g.0,
            "must be a quantity of at least 1Mi",
        ));
    }
    if let Some(cpu) = &d.cpu {
        for (name, v) in [
            ("cores", cpu.cores),
            ("sockets", cpu.sockets),
            ("threads", cpu.threads),
        ] {
            if v == Some(0) {
                errs.push(FieldError::invalid(
                    format!("{p}.domain.cpu.{name}"),
                    0,
                    "must be at least 1",
                ));
            }
        }
        if cpu.vcpus() > 512 {
            errs.push(FieldError::invalid(
                format!("{p}.domain.cpu"),
                cpu.vcpus(),
                "at most 512 vCPUs",
            ));
        }
    }
    // Volumes.
    let mut vol_names = BTreeSet::new();
    for (i, v) in s.volumes.iter().enumerate() {
        let vp = format!("{p}.volumes[{i}]");
        if v.name.is_empty() {
            errs.push(FieldError::required(format!("{vp}.name"), ""));
        } else if !is_dns_label(&v.name) {
            errs.push(FieldError::invalid(
                format!("{vp}.name"),
                &v.name,
                "must be a lowercase RFC 1123 label",
            ));
        } else if !vol_names.insert(v.name.as_str()) {
            errs.push(FieldError::duplicate(format!("{vp}.name"), &v.name));
        }
        match v.source_count() {
            0 => errs.push(FieldError::required(vp.clone(), "one volume source must be set (persistentVolumeClaim, dataVolume, containerDisk, cloudInitNoCloud, cloudInitConfigDrive, emptyDisk)")),
            1 => {}
            _ => errs.push(FieldError::forbidden(vp.clone(), "only one volume source may be set")),
        }
        if let Some(c) = &v.persistent_volume_claim
            && !is_dns_subdomain(&c.claim_name)
        {
            errs.push(FieldError::invalid(
                format!("{vp}.persistentVolumeClaim.claimName"),
                &c.claim_name,
                "must name a Volume",
            ));
        }
        if let Some(dv) = &v.data_volume
            && !is_dns_subdomain(&dv.name)
        {
            errs.push(FieldError::invalid(
                format!("{vp}.dataVolume.name"),
                &dv.name,
                "must name a Volume",
            ));
        }
        if let Some(cd) = &v.container_disk
            && cd.image.is_empty()
        {
            errs.push(FieldError::required(
                format!("{vp}.containerDisk.image"),
                "",
            ));
        }
        for (key, ci) in [
            ("cloudInitNoCloud", &v.cloud_init_no_cloud),
            ("cloudInitConfigDrive", &v.cloud_init_config_drive),
        ] {
            if let Some(ci) = ci {
                validate_cloud_init(ci, &format!("{vp}.{key}"), errs);
            }
        }
        if let Some(e) = &v.empty_disk
            && parse_quantity_bytes(&e.capacity.0).is_none_or(|b| b == 0)
        {
            errs.push(FieldError::invalid(
                format!("{vp}.emptyDisk.capacity"),
                &e.capacity.0,
                "must be a positive quantity",
            ));
        }
    }
    // Disks.
    let mut disk_names = BTreeSet::new();
    let mut boot_orders = BTreeSet::new();
    for (i, disk) in d.devices.disks.iter().enumerate() {
        let dp = format!("{p}.domain.devices.disks[{i}]");
        if disk.name.is_empty() {
            errs.push(FieldError::required(format!("{dp}.name"), ""));
        } else if !disk_names.insert(disk.name.as_str()) {
            errs.push(FieldError::duplicate(format!("{dp}.name"), &disk.name));
        } else if !vol_names.contains(disk.name.as_str())
            && !s.volumes.iter().any(|v| v.name == disk.name)
        {
            errs.push(FieldError::invalid(
                format!("{dp}.name"),
                &disk.name,
                "no volume of that name in volumes",
            ));
        }
        if disk.disk.is_some() && disk.cdrom.is_some() {
            errs.push(FieldError::forbidden(
                format!("{dp}.cdrom"),
                "a disk may be either disk or cdrom",
            ));
        }
        if let Some(o) = disk.boot_order {
            if o == 0 {
                errs.push(FieldError::invalid(
                    format!("{dp}.bootOrder"),
                    0,
                    "must be at least 1",
                ));
            } else if !boot_orders.insert(o) {
                errs.push(FieldError::duplicate(format!("{dp}.bootOrder"), o));
            }
        }
    }
    // Networks and interfaces.
    let mut net_names = BTreeSet::new();
    for (i, n) in s.networks.iter().enumerate() {
        let np = format!("{p}.networks[{i}]");
        if n.name.is_empty() {
            errs.push(FieldError::required(format!("{np}.name"), ""));
        } else if !net_names.insert(n.name.as_str()) {
            errs.push(FieldError::duplicate(format!("{np}.name"), &n.name));
        }
        if n.pod.is_none() {
            errs.push(FieldError::required(
                format!("{np}.pod"),
                "sheaf supports the pod network only",
            ));
        }
    }
    let mut if_names = BTreeSet::new();
    let mut macs = BTreeSet::new();
    for (i, ifc) in d.devices.interfaces.iter().enumerate() {
        let ip = format!("{p}.domain.devices.interfaces[{i}]");
        if ifc.name.is_empty() {
            errs.push(FieldError::required(format!("{ip}.name"), ""));
        } else if !if_names.insert(ifc.name.as_str()) {
            errs.push(FieldError::duplicate(format!("{ip}.name"), &ifc.name));
        } else if !net_names.contains(ifc.name.as_str()) {
            errs.push(FieldError::invalid(
                format!("{ip}.name"),
                &ifc.name,
                "no network of that name in networks",
            ));
        }
        if ifc.masquerade.is_some() && ifc.bridge.is_some() {
            errs.push(FieldError::forbidden(
                format!("{ip}.bridge"),
                "only one binding method may be set",
            ));
        }
        if let Some(mac) = &ifc.mac_address {
            match crate::network::parse_mac(mac) {
                Err(_) if !is_mac(mac) => errs.push(FieldError::invalid(
                    format!("{ip}.macAddress"),
                    mac,
                    "must be a MAC address such as 02:00:00:12:34:56",
                )),
                Err(_) => errs.push(FieldError::invalid(
                    format!("{ip}.macAddress"),
                    mac,
                    "must be a unicast MAC address (the first byte even)",
                )),
                Ok(m) => {
                    if !macs.insert(m) {
                        errs.push(FieldError::duplicate(format!("{ip}.macAddress"), mac));
                    }
                }
            }
        }
        for (j, port) in ifc.ports.iter().flatten().enumerate() {
            if port.port == 0 {
                errs.push(FieldError::invalid(
                    format!("{ip}.ports[{j}].port"),
                    0,
                    "must be between 1 and 65535",
                ));
            }
            if let Some(proto) = &port.protocol
                && proto != "TCP"
                && proto != "UDP"
            {
                errs.push(FieldError::not_supported(
                    format!("{ip}.ports[{j}].protocol"),
                    proto,
                    &["TCP", "UDP"],
                ));
            }
        }
    }
    if let Some(t) = s.termination_grace_period_seconds
        && t < 0
    {
        errs.push(FieldError::invalid(
            format!("{p}.terminationGracePeriodSeconds"),
            t,
            "must be >= 0",
        ));
    }
    if let Some(h) = &s.hostname
        && !is_dns_label(h)
    {
        errs.push(FieldError::invalid(
            format!("{p}.hostname"),
            h,
            "must be a lowercase RFC 1123 label",
        ));
    }
}

/// KubeVirt's checks of a cloud-init source: at most one user data source
/// and one network data source, at least one of either, base64 that
/// decodes, inline data within [`CLOUD_INIT_INLINE_MAX_BYTES`] (larger data goes in a
/// Secret), Secret names that are names.
fn validate_cloud_init(ci: &CloudInit, p: &str, errs: &mut Vec<FieldError>) {
    let groups = [
        (
            "user",
            ("userData", ci.user_data.as_deref()),
            ("userDataBase64", ci.user_data_base64.as_deref()),
            ("secretRef", ci.secret_ref.as_ref().map(|r| r.name.as_str())),
        ),
        (
            "network",
            ("networkData", ci.network_data.as_deref()),
            ("networkDataBase64", ci.network_data_base64.as_deref()),
            (
                "networkDataSecretRef",
                ci.network_data_secret_ref.as_ref().map(|r| r.name.as_str()),
            ),
        ),
    ];
    let mut sources = 0;
    for (what, (ik, inline), (bk, b64), (sk, secret)) in groups {
        let set: Vec<&str> = [
            (ik, inline.is_some()),
            (bk, b64.is_some()),
            (sk, secret.is_some()),
        ]
        .into_iter()
        .filter_map(|(k, on)| on.then_some(k))
        .collect();
        sources += set.len();
        if set.len() > 1 {
            errs.push(FieldError::forbidden(
                format!("{p}.{}", set[1]),
                format!(
                    "{} are mutually exclusive: set one {what} data source",
                    set.join(" and ")
                ),
            ));
        }
        let len = match (inline, b64) {
            (Some(s), _) => Some((ik, s.len())),
            (None, Some(s)) => match decode_std_base64(s) {
                Ok(d) => Some((bk, d.len())),
                Err(e) => {
                    errs.push(FieldError::invalid(
                        format!("{p}.{bk}"),
                        "<base64>",
                        format!("not valid base64: {e}"),
                    ));
                    None
                }
            },
            _ => None,
        };
        if let Some((k, n)) = len.filter(|(_, n)| *n > CLOUD_INIT_INLINE_MAX_BYTES) {
            errs.push(FieldError::forbidden(
                format!("{p}.{k}"),
                format!(
                    "{what} data is {n} bytes, over the {CLOUD_INIT_INLINE_MAX_BYTES}-byte limit for inline data; put it in a Secret and use {sk}"
                ),
            ));
        }
        if let Some(name) = secret
            && !is_dns_subdomain(name)
        {
            errs.push(FieldError::invalid(
                format!("{p}.{sk}.name"),
                name,
                "must name a Secret in the instance's namespace",
            ));
        }
    }
    if sources == 0 {
        errs.push(FieldError::required(
            p.to_string(),
            "set user data (userData, userDataBase64 or secretRef) or network data (networkData, networkDataBase64 or networkDataSecretRef)",
        ));
    }
}
