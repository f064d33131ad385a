// SPDX-License-Identifier: Apache-2.0
//! The real kubectl (and the official Python client) against the API server,
//! with the kubeconfig the server writes. Skipped with a message when the
//! client is not installed.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::start;

struct Kubectl {
    kubeconfig: std::path::PathBuf,
    cache: std::path::PathBuf,
}

impl Kubectl {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("kubectl");
        c.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache)
            .args(args);
        c.stdin(Stdio::null());
        c
    }

    /// Runs kubectl; returns (success, stdout, stderr).
    fn run(&self, args: &[&str]) -> (bool, String, String) {
        let out = self.cmd(args).output().expect("run kubectl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn ok(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.run(args);
        assert!(ok, "kubectl {args:?} failed:\n{out}\n{err}");
        out
    }
}

fn have(tool: &str, arg: &str) -> bool {
    Command::new(tool)
        .arg(arg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn manifests() -> String {
    format!("{}/tests/manifests", env!("CARGO_MANIFEST_DIR"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_end_to_end() {
    if !have("kubectl", "version")
        && !Command::new("kubectl")
            .arg("version")
            .arg("--client")
            .output()
            .is_ok_and(|o| o.status.success())
    {
        eprintln!("SKIP: kubectl not installed");
        return;
    }
    let ts = start().await;
    let k = Kubectl {
        kubeconfig: ts.server.kubeconfig.clone(),
        cache: ts.dir.path().join("kcache"),
    };
    let dir = manifests();
    tokio::task::spawn_blocking(move || {
        // apply -f a directory: Volume, VMs, VMI, migration.
        let out = k.ok(&["apply", "-f", &dir]);
        for want in ["volume.sheaf.dev/cirros-disk created", "virtualmachine.kubevirt.io/vm-cirros created", "virtualmachine.kubevirt.io/fedora created", "virtualmachineinstance.kubevirt.io/vmi-migratable created", "virtualmachineinstancemigration.kubevirt.io/migration-job created"] {
            assert!(out.contains(want), "apply output lacks {want:?}:\n{out}");
        }
        // Re-apply is a no-op; a changed manifest is "configured" via merge patch.
        assert!(k.ok(&["apply", "-f", &format!("{dir}/vm-cirros.yaml")]).contains("virtualmachine.kubevirt.io/vm-cirros unchanged"));
        let changed = std::fs::read_to_string(format!("{dir}/vm-cirros.yaml")).unwrap().replace("memory: 128Mi", "memory: 256Mi");
        let tmp = k.kubeconfig.with_file_name("vm-changed.yaml");
        std::fs::write(&tmp, changed).unwrap();
        assert!(k.ok(&["apply", "-f", tmp.to_str().unwrap()]).contains("vm-cirros configured"));
        assert_eq!(k.ok(&["get", "vm", "vm-cirros", "-o", "jsonpath={.spec.template.spec.domain.resources.requests.memory}"]), "256Mi");

        // get: table output with KubeVirt's columns.
        let table = k.ok(&["get", "vm"]);
        let header = table.lines().next().unwrap();
        assert!(header.split_whitespace().eq(["NAME", "AGE", "STATUS", "READY"]), "{table}");
        assert!(table.contains("vm-cirros") && table.contains("fedora"));
        let vmis = k.ok(&["get", "vmi"]);
        assert!(vmis.lines().next().unwrap().split_whitespace().eq(["NAME", "AGE", "PHASE", "IP", "NODENAME", "READY"]), "{vmis}");
        assert!(k.ok(&["get", "vmi", "-o", "wide"]).contains("LIVE-MIGRATABLE"));
        assert!(k.ok(&["get", "vol"]).contains("cirros-disk"));
        // get -o yaml / json.
        let y = k.ok(&["get", "vm", "fedora", "-o", "yaml"]);
        assert!(y.contains("runStrategy: Always") && y.contains("resourceVersion:"), "{y}");
        let j: serde_json::Value = serde_json::from_str(&k.ok(&["get", "vm", "-o", "json"])).unwrap();
        assert_eq!(j["items"].as_array().unwrap().len(), 2);
        // Label selectors.
        assert!(k.ok(&["get", "vm", "-l", "app=fedora", "-o", "name"]).trim() == "virtualmachine.kubevirt.io/fedora");

        // patch: merge and json.
        assert!(k.ok(&["patch", "vm", "vm-cirros", "--type", "merge", "-p", r#"{"spec":{"running":true}}"#]).contains("patched"));
        assert_eq!(k.ok(&["get", "vm", "vm-cirros", "-o", "jsonpath={.spec.running}"]), "true");
        k.ok(&["patch", "vm", "vm-cirros", "--type", "json", "-p", r#"[{"op":"replace","path":"/spec/running","value":false}]"#]);
        assert_eq!(k.ok(&["get", "vm", "vm-cirros", "-o", "jsonpath={.spec.running}"]), "false");
        // Invalid patch: server-side validation error naming the field.
        let (ok, _, err) = k.run(&["patch", "vm", "vm-cirros", "--type", "json", "-p", r#"[{"op":"replace","path":"/spec/template/spec/domain/devices/disks/0/disk/bus","value":"scsi"}]"#]);
        assert!(!ok && err.contains("spec.template.spec.domain.devices.disks[0].disk.bus: Unsupported value: \"scsi\""), "{err}");
        // Unknown field: kubectl's strict validation is done by the server.
        let bogus = k.kubeconfig.with_file_name("bogus.yaml");
        std::fs::write(&bogus, "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata:\n  name: bogus\nspec:\n  runStrategy: Halted\n  bogus: 1\n  template:\n    spec:\n      domain:\n        resources:\n          requests:\n            memory: 64Mi\n").unwrap();
        let (ok, _, err) = k.run(&["apply", "-f", bogus.to_str().unwrap()]);
        assert!(!ok && err.contains("unknown field \"spec.bogus\""), "{err}");

        // explain reads the OpenAPI v3 schema.
        let ex = k.ok(&["explain", "vm.spec.runStrategy"]);
        assert!(ex.contains("mutually exclusive with `running`") && ex.contains("runStrategy <string>"), "{ex}");
        assert!(ex.contains("RerunOnFailure"), "{ex}");

        // get -w: sees a status change made while watching.
        let mut watcher = k.cmd(&["get", "vmi", "-w", "--request-timeout=20s"]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        k.ok(&["patch", "vmi", "vmi-migratable", "--subresource", "status", "--type", "merge", "-p",
            r#"{"status":{"phase":"Running","nodeName":"node-1","interfaces":[{"ipAddress":"10.0.2.2"}],"conditions":[{"type":"Ready","status":"True"}]}}"#]);
        // wait --for=jsonpath.
        k.ok(&["wait", "--for=jsonpath={.status.phase}=Running", "vmi/vmi-migratable", "--timeout=10s"]);
        std::thread::sleep(Duration::from_millis(1000));
        let _ = watcher.kill();
        let wout = String::from_utf8_lossy(&watcher.wait_with_output().unwrap().stdout).into_owned();
        let last = wout.lines().last().unwrap_or("");
        assert!(last.contains("vmi-migratable") && last.contains("Running") && last.contains("10.0.2.2") && last.contains("node-1"), "watch output:\n{wout}");
        // describe.
        let d = k.ok(&["describe", "vmi", "vmi-migratable"]);
        assert!(d.contains("Name:") && d.contains("vmi-migratable") && d.contains("Node Name:") && d.contains("node-1"), "{d}");

        // Read-only context is refused writes.
        let (ok, _, err) = k.run(&["--context", "sheaf-readonly", "delete", "vm", "fedora"]);
        assert!(!ok && err.contains("Forbidden"), "{err}");
        // delete, then it is gone.
        assert!(k.ok(&["delete", "vm", "fedora"]).contains("deleted"));
        let (ok, _, err) = k.run(&["get", "vm", "fedora"]);
        assert!(!ok && err.contains("NotFound"), "{err}");
        k.ok(&["delete", "--ignore-not-found", "-f", &dir]);
        assert!(k.ok(&["get", "vm,vmi,vol", "-o", "name"]).trim().is_empty());
    })
    .await
    .unwrap();
    ts.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_lists_and_watches() {
    if !Command::new("python3")
        .args(["-c", "import kubernetes"])
        .status()
        .is_ok_and(|s| s.success())
    {
        eprintln!("SKIP: python3 with the kubernetes package not installed");
        return;
    }
    // A short history, so that resourceVersion 1 is compacted away (410).
    let ts = common::start_with(
        std::sync::Arc::new(sheaf_orchestrator::store::MemoryStore::with_history(5)),
        |_| {},
    )
    .await;
    let c = common::Client::new(&ts);
    for i in 0..10 {
        let vol = serde_json::json!({"apiVersion": "sheaf.dev/v1", "kind": "Volume", "metadata": {"name": format!("v{i}")}, "spec": {"size": "1Gi"}});
        assert_eq!(
            c.post_json("/apis/sheaf.dev/v1/namespaces/default/volumes", &vol)
                .await
                .status,
            201
        );
    }
    let vm = serde_json::json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "py-1", "labels": {"app": "py"}},
        "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}}}}}});
    assert_eq!(
        c.post_json(
            "/apis/kubevirt.io/v1/namespaces/default/virtualmachines",
            &vm
        )
        .await
        .status,
        201
    );
    let script = format!("{}/tests/python/list_watch.py", env!("CARGO_MANIFEST_DIR"));
    let kubeconfig = ts.server.kubeconfig.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(script)
            .arg(kubeconfig)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python failed:\n{stdout}\n{stderr}");
    for want in [
        "listed py-1",
        "ADDED py-2",
        "MODIFIED py-2 Halted",
        "DELETED py-2",
        "gone 410",
        "readonly 403",
        "OK",
    ] {
        assert!(
            stdout.contains(want),
            "missing {want:?} in:\n{stdout}\n{stderr}"
        );
    }
    ts.server.shutdown().await;
}
