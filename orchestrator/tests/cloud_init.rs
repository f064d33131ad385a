// SPDX-License-Identifier: Apache-2.0
//! `cloudInitNoCloud` end to end on a local cluster: a probe-guest instance
//! with a volume and a NoCloud disk whose user data comes from a Secret
//! waits for the Secret, then runs on sheaf-vmm with the seed attached
//! read-only as its second disk; the seed goes away with the instance.
#![allow(clippy::unwrap_used)]

mod cluster_common;

use std::process::Command;
use std::time::Duration;

use cluster_common::*;
use serde_json::{Value, json};
use sheaf_orchestrator::launcher::LaunchSpec;
use sheaf_orchestrator::resources::{
    FieldValidation, VirtualMachine, VirtualMachineInstance, decode,
};
use sheaf_orchestrator::store::StoreExt;

const T: Duration = Duration::from_secs(60);
const USER_DATA: &str = "#cloud-config\nruncmd:\n  - [sh, -c, 'echo sheaf-marker']\n";

fn ready_reason(o: &Value) -> String {
    o.pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
        .map(|c| {
            format!(
                "{}: {}",
                c["reason"].as_str().unwrap_or(""),
                c["message"].as_str().unwrap_or("")
            )
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_cloud_seed_from_a_secret_is_attached_in_disk_order() {
    if !kvm_available()
        || sheaf_testkit::skip_slow("no_cloud_seed_from_a_secret_is_attached_in_disk_order")
    {
        return;
    }
    init_tracing();
    let tmp = tempfile::tempdir().unwrap();
    let cluster = start_cluster(tmp.path(), 1).await;
    let store = cluster.store().clone();
    let node = cluster.node_names()[0].clone();
    create(&store, &volume("cidisk", "8Mi", 1)).await;

    // The volume first, the seed second (KubeVirt's usual order).
    let mut vm = serde_json::to_value(probe_vm(
        "ci",
        "Always",
        "probe.halt=1",
        Some("cidisk"),
        "100m",
    ))
    .unwrap();
    let t = &mut vm["spec"]["template"]["spec"];
    t["domain"]["devices"]["disks"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "cloudinitdisk", "disk": {"bus": "virtio"}}));
    t["volumes"].as_array_mut().unwrap().push(json!({
        "name": "cloudinitdisk",
        "cloudInitNoCloud": {
            "secretRef": {"name": "ci-userdata"},
            "networkData": "version: 2\n"
        }
    }));
    let vm: VirtualMachine = decode(&vm, FieldValidation::Strict).unwrap().0;
    create(&store, &vm).await;

    // No Secret yet: the instance waits, saying for what.
    let vmi_k = gk::<VirtualMachineInstance>();
    let v = wait_json(&store, &vmi_k, "default", "ci", T, |o| {
        ready_reason(o).starts_with("WaitingForSecret")
    })
    .await;
    assert_eq!(v["status"]["phase"], "Scheduled", "{v}");
    assert!(
        ready_reason(&v).contains("Secret default/ci-userdata not found"),
        "{}",
        ready_reason(&v)
    );
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "ci-userdata", "namespace": "default"},
        "stringData": {"userdata": USER_DATA}
    }))
    .unwrap();
    store.create_typed(&secret).await.unwrap();

    let v = wait_json(&store, &vmi_k, "default", "ci", T, |o| {
        o["status"]["phase"] == "Running"
    })
    .await;
    let uid = v["metadata"]["uid"].as_str().unwrap().to_string();
    let agent = cluster.agent(&node).unwrap();
    let dir = agent.launchers()[0].dir.clone();
    let spec: LaunchSpec =
        serde_json::from_slice(&std::fs::read(dir.join("spec.json")).unwrap()).unwrap();
    assert_eq!(spec.disks.len(), 1);
    assert_eq!(spec.file_disks.len(), 1);
    let fd = &spec.file_disks[0];
    assert_eq!(
        (fd.name.as_str(), fd.position, fd.read_only),
        ("cloudinitdisk", 1, true)
    );
    assert_eq!(fd.path, dir.join("cidata-cloudinitdisk.img"));

    // The seed, read by the host's tools.
    let blkid = Command::new("blkid")
        .args(["-p", "-o", "export"])
        .arg(&fd.path)
        .output()
        .unwrap();
    let id = String::from_utf8_lossy(&blkid.stdout);
    assert!(
        id.contains("LABEL=cidata\n") && id.contains("TYPE=vfat\n"),
        "{id}"
    );
    let mtype = |name: &str| {
        let o = Command::new("mtype")
            .env("MTOOLS_SKIP_CHECK", "1")
            .arg("-i")
            .arg(&fd.path)
            .arg(format!("::{name}"))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    assert_eq!(mtype("user-data"), USER_DATA);
    assert_eq!(mtype("network-config"), "version: 2\n");
    assert_eq!(
        mtype("meta-data"),
        format!("instance-id: \"{uid}\"\nlocal-hostname: \"ci\"\n")
    );

    // The guest sees two virtio-blk devices (the probe prints its command
    // line, where sheaf-vmm lists them) and passes its test of the first.
    let console = wait_console(&console_of(&cluster.node_dir(&node), &uid), T, |c| {
        c.contains("probe: PASS")
    })
    .await;
    let cmdline = console.lines().find(|l| l.starts_with("cmdline:")).unwrap();
    assert_eq!(
        cmdline.matches("virtio_mmio.device=").count(),
        2,
        "{cmdline}"
    );

    // Deleting the VM stops the guest and removes the seed with the
    // launcher's directory.
    store
        .delete_typed::<VirtualMachine>("default", "ci")
        .await
        .unwrap();
    wait_gone(&store, &vmi_k, "default", "ci", T).await;
    let deadline = std::time::Instant::now() + T;
    while fd.path.exists() {
        assert!(std::time::Instant::now() < deadline, "seed still there");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
