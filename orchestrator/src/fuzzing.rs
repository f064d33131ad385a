// SPDX-License-Identifier: Apache-2.0
//! Fuzz cases over what an API client controls, shared by the cargo-fuzz
//! targets in `fuzz/` (each a one-line call) and the property tests in
//! `fuzzing_tests.rs`, which run every case on a few hundred inputs in the
//! normal test suite. Each case panics only when an invariant breaks.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::api::patch::{PatchKind, apply_patch};
use crate::api::{ApiServerConfig, ApiState, Tokens, router};
use crate::cloudinit::{Flavor, Instance, Seed};
use crate::names;
use crate::resources::kubevirt::CloudInit;
use crate::resources::quantity::{parse_quantity, parse_quantity_bytes, parse_quantity_millis};
use crate::store::{GroupKind, ListOptions, MemoryStore, RedbStore, Store};

/// Splits `data` at its first `0xff` byte (the separator the cases use
/// between fields), lossily as UTF-8.
fn fields(data: &[u8], n: usize) -> Vec<String> {
    let mut out: Vec<String> = data
        .splitn(n, |&b| b == 0xff)
        .map(|f| String::from_utf8_lossy(f).into_owned())
        .collect();
    out.resize(n, String::new());
    out
}

/// Name and path validation: whatever a validator accepts is safe to put
/// in a path, and [`names::child`] only returns paths directly under
/// their parent.
pub fn names_case(data: &[u8]) {
    let [group, name, comp] = <[String; 3]>::try_from(fields(data, 3)).unwrap_or_default();
    let sub = names::is_dns_subdomain(&name);
    if sub {
        assert!(name.len() <= 253);
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        );
        assert!(!name.starts_with(['-', '.']) && !name.ends_with(['-', '.']));
        assert!(!name.contains(".."));
    }
    if names::is_dns_label(&name) {
        assert!(sub && name.len() <= 63 && !name.contains('.'));
    }
    if names::check_namespace(&name).is_ok() && !name.is_empty() {
        assert!(names::is_dns_label(&name));
    }
    match names::check_object_name(&group, &name) {
        Ok(()) => {
            assert!(!name.is_empty() && name != "." && name != "..");
            assert!(!name.contains(['/', '\0']));
        }
        Err(e) => assert!(e.to_string().contains("metadata.name")),
    }
    let parent = Path::new("/nonexistent-sheaf-fuzz/data");
    match names::child(parent, &comp) {
        Ok(p) => {
            assert_eq!(p.parent(), Some(parent), "{p:?} escapes its parent");
            assert!(names::ensure_child(parent, &p).is_ok());
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
    let joined = parent.join(&comp);
    if names::ensure_child(parent, &joined).is_ok() {
        use std::path::Component;
        // Exactly one normal component below the parent, whatever the
        // spelling (`a/.` is `a`).
        let extra: Vec<Component<'_>> = joined
            .components()
            .skip(parent.components().count())
            .collect();
        assert!(
            matches!(extra[..], [Component::Normal(_)]),
            "{joined:?} accepted under {parent:?}"
        );
        assert!(joined.starts_with(parent));
    }
}

/// Resource quantities (`128Mi`, `500m`, `1e3`): the byte and milli
/// forms agree with the exact value, and binary suffixes scale exactly.
pub fn quantity_case(data: &[u8]) {
    let s = String::from_utf8_lossy(data);
    let q = parse_quantity(&s);
    match parse_quantity_bytes(&s) {
        Some(b) => {
            let m = q.unwrap_or(-1);
            assert!(m >= 0, "bytes of a negative quantity {s:?}");
            let b = i128::from(b);
            assert!(
                b * 1000 >= m && (b - 1) * 1000 < m,
                "{s:?}: {b} bytes for {m} milli"
            );
        }
        None => assert!(q.is_none_or(|m| m < 0 || m > i128::from(u64::MAX) * 1000)),
    }
    match parse_quantity_millis(&s) {
        Some(m) => assert_eq!(Some(i128::from(m)), q),
        None => assert!(q.is_none_or(|m| m < 0 || m > i128::from(u64::MAX))),
    }
    // An integer with each binary suffix is that many units, exactly.
    let digits: String = s.chars().filter(char::is_ascii_digit).take(12).collect();
    if let Ok(n) = digits.parse::<i128>() {
        for (i, suf) in ["", "Ki", "Mi", "Gi"].iter().enumerate() {
            let want = n << (10 * i) as u32;
            assert_eq!(parse_quantity(&format!("{n}{suf}")), Some(want * 1000));
        }
        assert_eq!(parse_quantity(&format!("{n}m")), Some(n));
    }
}

/// The object [`patch_case`] patches.
fn patch_target() -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "vm1", "namespace": "default", "labels": {"app": "x"}},
        "spec": {"running": false, "template": {"spec": {"domain": {
            "devices": {"disks": [{"name": "d0", "disk": {"bus": "virtio"}}]},
            "resources": {"requests": {"memory": "64Mi"}}}}}}
    })
}

/// PATCH bodies of every kind applied to an object: a client error (4xx)
/// or a document that reparses to itself; a merge patch of `{}` changes
/// nothing.
pub fn patch_case(data: &[u8]) {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let kind = [
        PatchKind::Merge,
        PatchKind::StrategicMerge,
        PatchKind::Json,
        PatchKind::Apply,
    ][usize::from(sel % 4)];
    let mut doc = patch_target();
    match apply_patch(kind, &mut doc, body) {
        Ok(()) => {
            // The result still serializes and reparses to itself.
            let bytes = serde_json::to_vec(&doc).unwrap_or_default();
            assert_eq!(serde_json::from_slice::<Value>(&bytes).ok(), Some(doc));
        }
        // On error the caller drops the scratch copy.
        Err(e) => assert!(e.code >= 400 && e.code < 500, "{}", e.message),
    }
    let mut doc = patch_target();
    if apply_patch(PatchKind::Merge, &mut doc, b"{}").is_ok() {
        assert_eq!(doc, patch_target());
    }
}

/// Cloud-init seeds from hostile user and network data (inline, base64
/// or from a Secret): a FAT image whose files read back byte for byte, or
/// a named error.
pub fn cloudinit_case(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let [a, b, key, host] = <[String; 4]>::try_from(fields(rest, 4)).unwrap_or_default();
    let mut ci = CloudInit::default();
    let mut secrets = BTreeMap::new();
    match sel & 3 {
        0 => ci.user_data = Some(a.clone()),
        1 => ci.user_data_base64 = Some(a.clone()),
        2 => {
            ci.secret_ref = Some(crate::resources::kubevirt::SecretRef { name: "s".into() });
            let mut data = BTreeMap::new();
            data.insert(key.clone(), ByteString(a.clone().into_bytes()));
            secrets.insert(
                "s".to_string(),
                Secret {
                    data: Some(data),
                    ..Secret::default()
                },
            );
        }
        // No user data (two sources at once are refused by the VMI's
        // validation before a seed is built).
        _ => {}
    }
    match (sel >> 2) & 3 {
        0 => {}
        1 => ci.network_data = Some(b.clone()),
        2 => ci.network_data_base64 = Some(b.clone()),
        _ => {
            ci.network_data_secret_ref = Some(crate::resources::kubevirt::SecretRef {
                name: "missing".into(),
            })
        }
    }
    // `spec.hostname` is validated as a DNS label before it gets here.
    let host = if names::is_dns_label(&host) && !host.is_empty() {
        host
    } else {
        "vm1".to_string()
    };
    let flavor = if sel & 0x10 == 0 {
        Flavor::NoCloud
    } else {
        Flavor::ConfigDrive
    };
    let inst = Instance {
        namespace: "default",
        uid: "0d6e1c2a-7a40-4a8e-9e0b-2f1f3c1d9a55",
        hostname: &host,
    };
    let seed = match Seed::new(
        flavor,
        &ci,
        "spec.volumes[0].cloudInitNoCloud",
        &inst,
        &secrets,
    ) {
        Ok(s) => s,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    let img = match seed.image(0x1234_5678) {
        Ok(i) => i,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    assert_eq!(img.len() as u64, seed.image_size());
    let mut disk = std::io::Cursor::new(img);
    let fs = fatfs::FileSystem::new(&mut disk, fatfs::FsOptions::new()).expect("seed image mounts");
    for (name, want) in seed.files() {
        let mut f = fs.root_dir().open_file(name).expect("seed file exists");
        let mut got = Vec::new();
        f.read_to_end(&mut got).expect("seed file reads");
        assert_eq!(got, want, "{name} differs");
    }
    if let Some(meta) = seed
        .files()
        .iter()
        .find(|(n, _)| n.contains("meta"))
        .map(|(_, d)| d.to_vec())
    {
        if flavor == Flavor::ConfigDrive {
            let v: Value = serde_json::from_slice(&meta).expect("meta_data.json is JSON");
            assert_eq!(v["hostname"], json!(host));
        } else {
            let v: Value = serde_yaml::from_slice(&meta).expect("meta-data is YAML");
            assert_eq!(
                v["local-hostname"].as_str(),
                Some(host.as_str()),
                "hostname injected into meta-data"
            );
        }
    }
}

const ADMIN: &str = "fuzz-admin-token";
const READER: &str = "fuzz-readonly-token";
const PREFIXES: &[&str] = &[
    "/api/v1/namespaces/default/",
    "/api/v1/namespaces/default/secrets/",
    "/api/v1/",
    "/apis/kubevirt.io/v1/namespaces/default/virtualmachines/",
    "/apis/kubevirt.io/v1/namespaces/default/virtualmachineinstances/",
    "/apis/kubevirt.io/v1/",
    "/apis/",
    "/api/v1/namespaces/",
    "/apis/sheaf.dev/v1alpha1/namespaces/default/",
    "/healthz",
    "/openapi/v2",
    "",
];
const CONTENT_TYPES: &[&str] = &[
    "application/json",
    "application/yaml",
    "application/merge-patch+json",
    "application/json-patch+json",
    "application/apply-patch+yaml",
    "application/strategic-merge-patch+json",
    "text/plain",
];

/// The HTTP API in process (routing, authentication, query strings,
/// headers, bodies, every verb) driven by requests `[method, auth, content
/// type, path length, path..., body length, body...]`. Every response is
/// a well-formed status; an error under `/api` or `/apis` is a Kubernetes
/// `Status` object with the same code; nothing is a 500; a read-only or
/// missing token never changes the store.
pub fn http_case(data: &[u8]) {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
    else {
        return;
    };
    rt.block_on(http_requests(data));
}

async fn http_requests(mut data: &[u8]) {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tokens = Tokens {
        admin: ADMIN.into(),
        readonly: READER.into(),
    };
    let app = router(ApiState::new(
        store.clone(),
        tokens,
        &ApiServerConfig::new("/nonexistent"),
    ));
    let ns = GroupKind::new("", "Namespace");
    let _ = store
        .create(
            &ns,
            "",
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}),
        )
        .await;
    while data.len() >= 5 {
        let (m, auth, ct, plen) = (data[0], data[1], data[2], usize::from(data[3]));
        data = &data[4..];
        let path = &data[..plen.min(data.len())];
        data = &data[path.len()..];
        let blen = data.first().map_or(0, |&b| usize::from(b) * 8);
        data = data.get(1..).unwrap_or_default();
        let body = &data[..blen.min(data.len())];
        data = &data[body.len()..];
        let method = [
            Method::GET,
            Method::POST,
            Method::PUT,
            Method::PATCH,
            Method::DELETE,
            Method::HEAD,
            Method::OPTIONS,
        ][usize::from(m % 7)]
        .clone();
        let uri = format!(
            "{}{}",
            PREFIXES[usize::from(m >> 3) % PREFIXES.len()],
            String::from_utf8_lossy(path)
        );
        let mut req = Request::builder().method(method.clone()).uri(&uri);
        let token = match auth % 4 {
            0 => Some(ADMIN.to_string()),
            1 => Some(READER.to_string()),
            2 => None,
            _ => Some(String::from_utf8_lossy(body.get(..8).unwrap_or_default()).into_owned()),
        };
        if let Some(t) = &token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        req = req.header(
            "content-type",
            CONTENT_TYPES[usize::from(ct) % CONTENT_TYPES.len()],
        );
        if ct & 0x80 != 0 {
            req = req.header("accept", "application/json;as=Table;v=v1;g=meta.k8s.io");
        }
        let Ok(req) = req.body(Body::from(body.to_vec())) else {
            continue; // Not a valid URI: hyper would refuse it before routing.
        };
        let before = store_version(&*store).await;
        let Ok(resp) = app.clone().oneshot(req).await;
        let status = resp.status();
        assert_ne!(status, StatusCode::INTERNAL_SERVER_ERROR, "{method} {uri}");
        let is_api = uri.starts_with("/api");
        // Watches stream until their timeout: read what comes quickly.
        let body =
            tokio::time::timeout(Duration::from_millis(20), resp.into_body().collect()).await;
        if let (Ok(Ok(b)), true) = (
            body,
            is_api && status.as_u16() >= 400 && method != Method::HEAD,
        ) {
            let v: Value = serde_json::from_slice(&b.to_bytes()).expect("error body is JSON");
            assert_eq!(v["kind"], "Status", "{method} {uri}: {v}");
            assert_eq!(v["code"].as_u64(), Some(u64::from(status.as_u16())));
        }
        if token.as_deref() != Some(ADMIN) {
            assert_eq!(
                store_version(&*store).await,
                before,
                "{method} {uri} changed the store without the admin token"
            );
        }
    }
}

/// The store's resourceVersion (from a list of namespaces).
async fn store_version(store: &dyn Store) -> u64 {
    store
        .list(
            &GroupKind::new("", "Namespace"),
            None,
            &ListOptions::default(),
        )
        .await
        .map_or(0, |l| l.resource_version)
}

/// The store file [`store_reload_case`] corrupts, written once per process.
fn store_seed() -> Option<&'static (PathBuf, Vec<u8>)> {
    static SEED: OnceLock<Option<(PathBuf, Vec<u8>)>> = OnceLock::new();
    SEED.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("sheaf-fuzz-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).ok()?;
        let path = dir.join("store.redb");
        let rt = tokio::runtime::Builder::new_current_thread().build().ok()?;
        rt.block_on(async {
            let s = RedbStore::open(&path).ok()?;
            let ns = GroupKind::new("", "Namespace");
            let cm = GroupKind::new("", "ConfigMap");
            for n in ["default", "prod"] {
                s.create(&ns, "", json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}})).await.ok()?;
            }
            for i in 0..8 {
                let obj = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("c{i}"), "labels": {"i": i.to_string()}}, "data": {"k": "v".repeat(i * 40)}});
                s.create(&cm, "default", obj).await.ok()?;
            }
            Some(())
        })?;
        let bytes = std::fs::read(&path).ok()?;
        Some((path, bytes))
    })
    .as_ref()
}

/// Store reload: a store file with bytes overwritten (`[offset lo, mid,
/// hi, len, bytes...]` patches) or truncated (a patch of length 0) opens
/// with its records readable or reported, or fails with an error; listing
/// never panics.
pub fn store_reload_case(data: &[u8]) {
    let Some((seed_path, seed)) = store_seed() else {
        return;
    };
    let mut img = seed.clone();
    let mut p = data;
    while p.len() >= 4 {
        let off = (usize::from(p[0]) | usize::from(p[1]) << 8 | usize::from(p[2]) << 16)
            % img.len().max(1);
        let len = usize::from(p[3]).min(p.len() - 4);
        if len == 0 {
            img.truncate(off);
        } else {
            let end = (off + len).min(img.len());
            img[off..end].copy_from_slice(&p[4..4 + (end - off)]);
        }
        p = &p[4 + len..];
    }
    let Some(dir) = seed_path.parent() else {
        return;
    };
    let path = dir.join("case.redb");
    if std::fs::write(&path, &img).is_err() {
        return;
    }
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().build() else {
        return;
    };
    rt.block_on(async {
        let Ok(s) = RedbStore::open(&path) else {
            return;
        };
        for (gk, ns) in [
            (GroupKind::new("", "ConfigMap"), Some("default")),
            (GroupKind::new("", "Namespace"), None),
        ] {
            if let Ok(l) = s.list(&gk, ns, &ListOptions::default()).await {
                for item in l.items {
                    assert!(item["metadata"]["name"].is_string());
                }
            }
        }
        let _ = s
            .get(&GroupKind::new("", "ConfigMap"), "default", "c3")
            .await;
    });
    let _ = std::fs::remove_file(&path);
}

/// The node's DHCP server on a guest packet: `data[0]` picks whether the
/// packet is raw or a valid DISCOVER/REQUEST from a registered MAC with
/// `data[1..]` written over it. The server answers only registered MACs,
/// only with their address, and never panics.
pub fn dhcp_case(data: &[u8]) {
    use crate::network::{Leases, PodNetworkConfig, dhcp};
    let cfg = PodNetworkConfig::default();
    let leases = Leases::default();
    let mac = [2, 0, 0, 0, 0, 7];
    let ip = std::net::Ipv4Addr::new(10, 244, 3, 4);
    leases.insert(mac, ip, "vm");
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let packet = if sel & 1 == 0 {
        rest.to_vec()
    } else {
        let mut p = dhcp::tests_support::request(sel & 2 != 0, mac, ip);
        // Patches: (offset, byte) pairs.
        for c in rest.chunks_exact(3) {
            let at = usize::from(u16::from_le_bytes([c[0], c[1]])) % (p.len() + 8);
            if at < p.len() {
                p[at] = c[2];
            } else {
                p.push(c[2]);
            }
        }
        p
    };
    if let Some(r) = dhcp::respond(&packet, &cfg, &leases) {
        use dhcproto::Decodable;
        let m = dhcproto::v4::Message::from_bytes(&r.bytes).expect("our reply decodes");
        assert_eq!(&m.chaddr()[..6], &mac, "a reply only to the registered MAC");
        let y = m.yiaddr();
        assert!(
            y == ip || y.is_unspecified(),
            "a reply only with its address: {y}"
        );
    }
}

#[cfg(test)]
#[path = "fuzzing_tests.rs"]
mod tests;
