// SPDX-License-Identifier: Apache-2.0
//! The QEMU runtime: `qemu-system-x86_64` as a child of the launcher, for
//! guests sheaf-vmm cannot run on this host (a stock Linux kernel where the
//! host's KVM cannot boot it: TCG). Each volume is exported by an in-process
//! NBD server (blockrepl `frontend::nbd`) on a unix socket in the launcher's
//! directory and attached as `virtio-blk-pci` through QEMU's NBD client, so
//! the guest's writes go through the same engine and epoch as with sheaf-vmm.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sheaf_blockrepl::frontend::nbd::{Export, NbdConfig, NbdServer};

use super::{AttachedDisk, RunningVm, RuntimeContext, RuntimeError, VmExit, VmRuntime, VmSpec};

/// QEMU settings.
#[derive(Debug, Clone)]
pub struct QemuRuntime {
    /// The emulator.
    pub binary: PathBuf,
    /// `-accel` value: `tcg`, `kvm`, or `kvm:tcg` (KVM, falling back to TCG).
    pub accel: String,
    /// Machine type.
    pub machine: String,
}

impl Default for QemuRuntime {
    fn default() -> Self {
        QemuRuntime {
            binary: PathBuf::from("qemu-system-x86_64"),
            // The hosts here run tiny guests on KVM only; Linux needs TCG.
            accel: std::env::var("SHEAF_QEMU_ACCEL").unwrap_or_else(|_| "tcg".into()),
            machine: "pc".into(),
        }
    }
}

#[derive(Debug)]
struct QemuVm {
    child: Child,
    nbd: tokio::task::JoinHandle<()>,
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.nbd.abort();
    }
}

impl VmRuntime for QemuRuntime {
    fn name(&self) -> &'static str {
        "qemu"
    }

    fn start(
        &self,
        spec: &VmSpec,
        disks: Vec<AttachedDisk>,
        ctx: &RuntimeContext,
    ) -> Result<Box<dyn RunningVm>, RuntimeError> {
        let sock = ctx.work_dir.join("nbd.sock");
        let server = NbdServer::new(NbdConfig::default());
        let mut drives = Vec::new();
        for (i, d) in disks.into_iter().enumerate() {
            let export = Export::new(d.disk).read_only(d.read_only);
            server
                .add_export(&d.name, export)
                .map_err(|e| RuntimeError::Disk {
                    disk: d.name.clone(),
                    message: e.to_string(),
                })?;
            drives.push((i, d.name, d.serial, d.read_only));
        }
        let listener = {
            let _guard = ctx.io.enter();
            NbdServer::bind_unix(&sock).map_err(|e| RuntimeError::Disk {
                disk: "nbd".into(),
                message: e.to_string(),
            })?
        };
        let nbd = ctx.io.spawn(async move {
            if let Err(e) = server.serve_unix(listener).await {
                tracing::warn!(error = %e, "NBD server stopped");
            }
        });
        let mut cmd = Command::new(&self.binary);
        cmd.args(["-machine", &self.machine]);
        // `kvm:tcg` becomes `-accel kvm -accel tcg` (QEMU falls back in order).
        for a in self.accel.split(':') {
            cmd.args(["-accel", a]);
        }
        cmd.args(["-m", &spec.memory_mib.max(64).to_string()])
            .args(["-smp", &spec.vcpus.max(1).to_string()])
            .args(["-display", "none", "-monitor", "none", "-serial", "stdio"])
            .args(["-nic", "none", "-no-reboot"])
            .arg("-kernel")
            .arg(&spec.kernel)
            .args(["-append", &spec.cmdline]);
        if let Some(i) = &spec.initramfs {
            cmd.arg("-initrd").arg(i);
        }
        for (i, name, serial, ro) in &drives {
            cmd.arg("-blockdev").arg(format!(
                "driver=nbd,server.type=unix,server.path={},export={name},node-name=disk{i}{}",
                sock.display(),
                if *ro { ",read-only=on" } else { "" }
            ));
            cmd.arg("-device")
                .arg(format!("virtio-blk-pci,drive=disk{i},serial={serial}"));
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Die with the launcher.
        // SAFETY: prctl(PR_SET_PDEATHSIG) only changes this child's own
        // signal disposition; it is async-signal-safe and touches no memory.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|source| RuntimeError::Spawn {
            program: self.binary.display().to_string(),
            source,
        })?;
        for pipe in [
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let console = ctx.console.clone();
            std::thread::spawn(move || {
                let mut pipe = pipe;
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    console.write(&buf[..n]);
                }
            });
        }
        Ok(Box::new(QemuVm { child, nbd }))
    }
}

impl RunningVm for QemuVm {
    fn wait_timeout(&mut self, timeout: Duration) -> Option<VmExit> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => {
                    return Some(VmExit {
                        success: st.success(),
                        reason: format!("qemu exited ({st})"),
                    });
                }
                Ok(None) => {}
                Err(e) => {
                    return Some(VmExit {
                        success: false,
                        reason: format!("waiting for qemu: {e}"),
                    });
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20).min(timeout));
        }
    }

    fn stop(&mut self) -> VmExit {
        let _ = self.child.kill();
        let st = self.child.wait();
        VmExit {
            success: false,
            reason: format!("stopped ({st:?})"),
        }
    }
}
