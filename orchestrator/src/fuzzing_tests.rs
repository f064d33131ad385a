// SPDX-License-Identifier: Apache-2.0
//! The fuzz cases on structured random input (the cargo-fuzz targets
//! explore further), plus checks that the cases' invariants can fail.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;

use super::*;

fn sep(parts: &[&[u8]]) -> Vec<u8> {
    parts.join(&[0xffu8][..])
}

fn req(m: u8, auth: u8, ct: u8, path: &str, body: &[u8]) -> Vec<u8> {
    let mut v = vec![m, auth, ct, path.len() as u8];
    v.extend_from_slice(path.as_bytes());
    let mut body = body.to_vec();
    body.resize(body.len().div_ceil(8) * 8, b' ');
    v.push((body.len() / 8) as u8);
    v.extend(body);
    v
}

#[test]
fn http_case_creates_and_reads_back() {
    // POST a ConfigMap as admin (prefix 0: /api/v1/namespaces/default/),
    // GET it as the reader, then try a DELETE as the reader.
    let cm = br#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a"},"data":{"k":"v"}}"#;
    let mut d = req(1, 0, 0, "configmaps", cm);
    d.extend(req(0, 1, 0, "configmaps/a", b""));
    d.extend(req(4, 1, 0, "configmaps/a", b""));
    d.extend(req(0, 2, 0, "configmaps", b""));
    http_case(&d);
}

#[test]
fn seeds_are_real() {
    let (path, bytes) = store_seed().unwrap();
    assert!(path.exists() && bytes.len() > 4096);
    store_reload_case(&[]);
    cloudinit_case(&sep(&[&[0x10], b"#cloud-config\n", b"", b"", b"host-1"]));
    quantity_case(b"128Mi");
    names_case(&sep(&[b"", b"my-vm.example", b"seed.img"]));
    patch_case(b"\x02[{\"op\":\"replace\",\"path\":\"/spec/running\",\"value\":true}]");
}

fn quantity() -> impl Strategy<Value = String> {
    (
        prop::option::of(prop::sample::select(vec!["-", "+"])),
        "[0-9]{0,22}",
        prop::option::of("\\.[0-9]{0,12}"),
        prop::sample::select(vec![
            "", "n", "u", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei",
            "e3", "E-2", "e18", "e19", "x", "mi",
        ]),
    )
        .prop_map(|(s, i, f, x)| format!("{}{i}{}{x}", s.unwrap_or(""), f.unwrap_or_default()))
}

fn json_patch_body() -> impl Strategy<Value = Vec<u8>> {
    let path = prop::sample::select(vec![
        "/spec/running",
        "/metadata/labels/app",
        "/metadata/labels",
        "/spec/template/spec/domain/devices/disks/0",
        "/spec/template/spec/domain/devices/disks/-",
        "/spec/template/spec/domain/resources/requests/memory",
        "/metadata/name",
        "/kind",
        "/nope/deeper",
        "",
    ]);
    let op = (
        prop::sample::select(vec![
            "add", "remove", "replace", "move", "copy", "test", "bogus",
        ]),
        path.clone(),
        path,
        prop::sample::select(vec!["1", "\"x\"", "{}", "[]", "null", "{\"a\":[1,2]}"]),
    )
        .prop_map(|(op, p, from, v)| {
            format!(r#"{{"op":"{op}","path":"{p}","from":"{from}","value":{v}}}"#)
        });
    prop::collection::vec(op, 0..6).prop_map(|ops| format!("[{}]", ops.join(",")).into_bytes())
}

fn merge_body() -> impl Strategy<Value = Vec<u8>> {
    prop::sample::select(vec![
        r#"{"spec":{"running":true}}"#,
        r#"{"metadata":{"labels":null}}"#,
        "spec:\n  template: null\n",
        "metadata: {labels: {a: b}}\n",
        r#"{"kind":"Other"}"#,
        "[1,2]",
        "not json",
        "",
    ])
    .prop_map(|s| s.as_bytes().to_vec())
}

fn http_requests_input() -> impl Strategy<Value = Vec<u8>> {
    let bodies = prop::sample::select(vec![
        r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a"},"data":{"k":"v"}}"#,
        r#"{"apiVersion":"v1","kind":"Secret","metadata":{"name":"s"},"stringData":{"userdata":"x"}}"#,
        r#"{"apiVersion":"kubevirt.io/v1","kind":"VirtualMachine","metadata":{"name":"vm"},"spec":{"running":false,"template":{"spec":{"domain":{"devices":{}}}}}}"#,
        r#"{"data":{"k":"w"}}"#,
        r#"[{"op":"add","path":"/data/x","value":"1"}]"#,
        "kind: ConfigMap\napiVersion: v1\nmetadata: {name: b}\n",
        "",
        "{",
    ]);
    let paths = prop::sample::select(vec![
        "configmaps",
        "configmaps/a",
        "configmaps/a?dryRun=All",
        "configmaps?labelSelector=a%3Db,c!=d",
        "configmaps?fieldSelector=metadata.name%3Da&limit=1&continue=xyz",
        "secrets/s",
        "configmaps?watch=true&resourceVersion=0&timeoutSeconds=1",
        "pods/x/log",
        "configmaps/a/status",
        "configmaps?resourceVersion=abc",
        "%2e%2e/%2e%2e/etc",
        "..%2F..",
        "vm",
        "vm/status",
        "",
    ]);
    prop::collection::vec((any::<u8>(), any::<u8>(), any::<u8>(), paths, bodies), 1..6).prop_map(
        |rs| {
            rs.into_iter()
                .flat_map(|(m, a, c, p, b)| req(m, a, c, p, b.as_bytes()))
                .collect()
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn fuzz_names(g in prop::sample::select(vec!["", "kubevirt.io", "rbac.authorization.k8s.io"]),
                  n in "[a-z0-9.%/-]{0,12}|[ -~]{0,8}", c in "[a-z./\\\\]{0,6}|\\.\\.?|[ -~]{0,8}") {
        names_case(&sep(&[g.as_bytes(), n.as_bytes(), c.as_bytes()]));
    }

    #[test]
    fn fuzz_quantity(q in quantity()) {
        quantity_case(q.as_bytes());
    }

    #[test]
    fn fuzz_patch(json in json_patch_body(), merge in merge_body(), k in any::<u8>()) {
        let mut d = vec![k];
        d.extend(if k % 4 == 2 { json } else { merge });
        patch_case(&d);
    }

    #[test]
    fn fuzz_cloudinit(sel in any::<u8>(), user in "#cloud-config\n[ -~\n]{0,40}|[A-Za-z0-9+/=]{0,16}|.{0,10}",
                      net in "version: 2\n[ -~\n]{0,20}|[A-Za-z0-9+/=]{0,12}", key in prop::sample::select(vec!["userdata", "userData", "other"]),
                      host in "[a-z0-9-]{0,12}") {
        cloudinit_case(&sep(&[&[sel], user.as_bytes(), net.as_bytes(), key.as_bytes(), host.as_bytes()]));
    }

    #[test]
    fn fuzz_dhcp(sel in any::<u8>(), patches in prop::collection::vec(any::<u8>(), 0..40)) {
        let mut d = vec![sel];
        d.extend(patches);
        super::dhcp_case(&d);
    }

    #[test]
    fn fuzz_store_reload(patches in prop::collection::vec((0u32..0x40000, prop::collection::vec(any::<u8>(), 0..6)), 1..4)) {
        let mut d = Vec::new();
        for (off, bytes) in patches {
            d.extend_from_slice(&off.to_le_bytes()[..3]);
            d.push(bytes.len() as u8);
            d.extend(bytes);
        }
        store_reload_case(&d);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn fuzz_http(d in http_requests_input()) {
        http_case(&d);
    }
}

/// Regression (found by `fuzz_store_reload`): two bytes overwritten in a
/// B-tree page of store.redb made redb panic inside `RedbStore::open`
/// ("Invalid page type byte 3"); now the file fails its integrity check
/// and open returns an error naming it.
#[test]
fn a_corrupt_store_page_is_an_error_not_a_panic() {
    let (seed_path, seed) = store_seed().unwrap();
    let mut img = seed.clone();
    img[69631..69633].copy_from_slice(&[0, 3]);
    let dir = seed_path.parent().unwrap().join("regression");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("store.redb");
    std::fs::write(&path, &img).unwrap();
    match RedbStore::open(&path) {
        Err(e) => assert!(e.to_string().contains("store.redb"), "{e}"),
        Ok(s) => drop(s), // A page that no live table uses.
    }
    store_reload_case(&[0xff, 0x0f, 0x01, 2, 0, 3]);
}
