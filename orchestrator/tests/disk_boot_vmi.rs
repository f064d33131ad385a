// SPDX-License-Identifier: Apache-2.0
//! A KubeVirt VMI without `firmware.kernelBoot` boots the kernel inside its
//! own disk (sheaf-vmm's disk boot): the agent picks the boot disk (lowest
//! `bootOrder`, else the first volume disk; cloud-init seeds never), puts it
//! in the launch spec, and the runtime reads the disk through the attached
//! replicated volume. A blank volume fails the instance with the VMM's
//! reason, naming what is missing on the disk.
#![allow(clippy::unwrap_used)]

mod cluster_common;

use std::time::Duration;

use cluster_common::*;
use serde_json::json;
use sheaf_orchestrator::launcher::LaunchSpec;
use sheaf_orchestrator::resources::{
    FieldValidation, VirtualMachine, VirtualMachineInstance, decode,
};

const T: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vmi_without_kernel_boot_boots_from_its_volume_and_reports_a_blank_disk() {
    if !kvm_available() {
        return;
    }
    init_tracing();
    let tmp = tempfile::tempdir().unwrap();
    let cluster = start_cluster(tmp.path(), 1).await;
    let store = cluster.store().clone();
    let node = cluster.node_names()[0].clone();
    create(&store, &volume("blank", "8Mi", 1)).await;

    let mut vm = serde_json::to_value(probe_vm("db", "Once", "", Some("blank"), "100m")).unwrap();
    let t = &mut vm["spec"]["template"]["spec"];
    // No kernel from outside: the disk must carry it.
    t["domain"].as_object_mut().unwrap().remove("firmware");
    // A seed first in the guest's disk order: never the boot disk.
    t["domain"]["devices"]["disks"]
        .as_array_mut()
        .unwrap()
        .insert(
            0,
            json!({"name": "cloudinitdisk", "disk": {"bus": "virtio"}}),
        );
    t["volumes"].as_array_mut().unwrap().push(json!({
        "name": "cloudinitdisk",
        "cloudInitNoCloud": {"userData": "#cloud-config\n"}
    }));
    let vm: VirtualMachine = decode(&vm, FieldValidation::Strict).unwrap().0;
    create(&store, &vm).await;

    let vmi_k = gk::<VirtualMachineInstance>();
    // The launch spec is read while the launcher exists: once the VMI has
    // failed, the agent may clean the launcher up at any moment.
    let agent = cluster.agent(&node).unwrap();
    let mut spec: Option<LaunchSpec> = None;
    let t0 = std::time::Instant::now();
    let v = loop {
        if spec.is_none()
            && let Some(l) = agent.launchers().first()
            && let Ok(b) = std::fs::read(l.dir.join("spec.json"))
        {
            spec = serde_json::from_slice(&b).ok();
        }
        let o = store.get(&vmi_k, "default", "db").await.ok();
        if let Some(o) = o.filter(|o| o["status"]["phase"] == "Failed") {
            break o;
        }
        assert!(t0.elapsed() < T, "the VMI did not fail");
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let reason = v["status"].to_string();
    assert!(
        reason.contains("boot disk 1 has no partition table"),
        "the VMM's reason should reach the VMI: {v}"
    );
    let spec = spec.expect("the launcher's spec was seen");
    assert_eq!(spec.runtime, "sheaf-vmm");
    assert_eq!(spec.vm.boot_disk, Some(1), "the volume, not the seed");
    assert!(spec.vm.kernel.as_os_str().is_empty());
}
