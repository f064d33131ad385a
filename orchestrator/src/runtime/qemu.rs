// SPDX-License-Identifier: Apache-2.0
//! The QEMU runtime: `qemu-system-x86_64` as a child of the launcher, for
//! guests sheaf-vmm cannot run on this host (a stock Linux kernel where the
//! host's KVM cannot boot it: TCG). Each volume is exported by an in-process
//! NBD server (blockrepl `frontend::nbd`) on a unix socket in the launcher's
//! directory and attached as `virtio-blk-pci` through QEMU's NBD client, so
//! the guest's writes go through the same engine and epoch as with sheaf-vmm.
//! A file disk (a cloud-init seed) is a raw `-blockdev` on the file.
//! Pause and resume go through QMP (`stop`/`cont`) on `qmp.sock` in the same
//! directory; the serial console is QEMU's stdio (input through its stdin).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sheaf_blockrepl::frontend::nbd::{Export, NbdConfig, NbdServer};

use super::{
    AttachedDisk, ConsoleInput, DiskBacking, RunningVm, RuntimeContext, RuntimeError, VmExit,
    VmRuntime, VmSpec,
};

/// A value inside a QEMU `-blockdev` option list (`,` is written `,,`).
fn qemu_opt(v: &str) -> String {
    v.replace(',', ",,")
}

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
    qmp: PathBuf,
    stdin: Option<Arc<Mutex<std::process::ChildStdin>>>,
}

/// Runs one QMP command (`stop`, `cont`) on the monitor socket at `path`.
fn qmp(path: &std::path::Path, command: &str) -> Result<(), RuntimeError> {
    let err = |message: String| RuntimeError::Control { op: "QMP", message };
    if !path.exists() {
        return Err(RuntimeError::Unsupported {
            runtime: "qemu",
            what: format!(
                "{command}: this QEMU has no QMP socket ({})",
                path.display()
            ),
        });
    }
    let sock = UnixStream::connect(path).map_err(|e| err(format!("connect: {e}")))?;
    let timeout = Some(Duration::from_secs(10));
    sock.set_read_timeout(timeout)
        .and_then(|_| sock.set_write_timeout(timeout))
        .map_err(|e| err(e.to_string()))?;
    let mut w = sock.try_clone().map_err(|e| err(e.to_string()))?;
    let mut r = BufReader::new(sock);
    let mut line = String::new();
    // The greeting, then one answer per command (events are skipped).
    r.read_line(&mut line)
        .map_err(|e| err(format!("greeting: {e}")))?;
    for cmd in ["qmp_capabilities", command] {
        writeln!(w, "{{\"execute\":\"{cmd}\"}}").map_err(|e| err(e.to_string()))?;
        loop {
            line.clear();
            let n = r
                .read_line(&mut line)
                .map_err(|e| err(format!("{cmd}: {e}")))?;
            if n == 0 {
                return Err(err(format!("{cmd}: QEMU closed the monitor")));
            }
            let v: serde_json::Value =
                serde_json::from_str(&line).map_err(|e| err(format!("{cmd}: bad answer: {e}")))?;
            if v.get("return").is_some() {
                break;
            }
            if let Some(e) = v.get("error") {
                return Err(err(format!("{cmd}: {e}")));
            }
        }
    }
    Ok(())
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
        let qmp_sock = ctx.work_dir.join("qmp.sock");
        let server = NbdServer::new(NbdConfig::default());
        let mut drives = Vec::new();
        for (i, d) in disks.into_iter().enumerate() {
            let blockdev = match d.disk {
                DiskBacking::Volume(disk) => {
                    let export = Export::new(disk).read_only(d.read_only);
                    server
                        .add_export(&d.name, export)
                        .map_err(|e| RuntimeError::Disk {
                            disk: d.name.clone(),
                            message: e.to_string(),
                        })?;
                    format!(
                        "driver=nbd,server.type=unix,server.path={},export={}",
                        qemu_opt(&sock.display().to_string()),
                        d.name
                    )
                }
                DiskBacking::File(path) => format!(
                    "driver=raw,file.driver=file,file.filename={}",
                    qemu_opt(&path.display().to_string())
                ),
                DiskBacking::Deferred(_) => {
                    return Err(RuntimeError::Unsupported {
                        runtime: "qemu",
                        what: "a volume attached at a live-migration switch-over".into(),
                    });
                }
            };
            drives.push((i, blockdev, d.serial, d.read_only));
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
        if spec.boot_disk.is_some() {
            return Err(RuntimeError::Config(
                "the qemu runtime boots kernels directly; booting the kernel inside a disk \
                 (no spec.domain.firmware.kernelBoot) needs the sheaf-vmm runtime"
                    .into(),
            ));
        }
        let mut cmd = Command::new(&self.binary);
        cmd.args(["-machine", &self.machine]);
        // `kvm:tcg` becomes `-accel kvm -accel tcg` (QEMU falls back in order).
        for a in self.accel.split(':') {
            cmd.args(["-accel", a]);
        }
        cmd.args(["-m", &spec.memory_mib.max(64).to_string()])
            .args(["-smp", &spec.vcpus.max(1).to_string()])
            .args(["-display", "none", "-monitor", "none", "-serial", "stdio"])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp_sock.display()))
            .arg("-no-reboot")
            .arg("-kernel")
            .arg(&spec.kernel)
            .args(["-append", &spec.cmdline]);
        if let Some(i) = &spec.initramfs {
            cmd.arg("-initrd").arg(i);
        }
        if spec.nets.is_empty() {
            cmd.args(["-nic", "none"]);
        }
        for (i, n) in spec.nets.iter().enumerate() {
            crate::network::host::check_link_name(&n.tap)
                .map_err(|e| RuntimeError::Config(e.to_string()))?;
            crate::network::parse_mac(&n.mac).map_err(|e| RuntimeError::Config(e.to_string()))?;
            cmd.arg("-netdev").arg(format!(
                "tap,id=net{i},ifname={},script=no,downscript=no",
                n.tap
            ));
            cmd.arg("-device")
                .arg(format!("virtio-net-pci,netdev=net{i},mac={}", n.mac));
        }
        for (i, blockdev, serial, ro) in &drives {
            cmd.arg("-blockdev").arg(format!(
                "{blockdev},node-name=disk{i}{}",
                if *ro { ",read-only=on" } else { "" }
            ));
            cmd.arg("-device")
                .arg(format!("virtio-blk-pci,drive=disk{i},serial={serial}"));
        }
        cmd.stdin(Stdio::piped())
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
        let stdin = child.stdin.take().map(|p| Arc::new(Mutex::new(p)));
        Ok(Box::new(QemuVm {
            child,
            nbd,
            qmp: qmp_sock,
            stdin,
        }))
    }
}

impl RunningVm for QemuVm {
    fn migrate(
        &mut self,
        _conn: std::net::TcpStream,
        _cfg: &sheaf_vmm::MigrationConfig,
    ) -> Result<sheaf_vmm::MigrationReport, RuntimeError> {
        Err(RuntimeError::Unsupported {
            runtime: "qemu",
            what: "live migration (only sheaf-vmm guests migrate live)".into(),
        })
    }

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

    fn pause(&mut self) -> Result<(), RuntimeError> {
        qmp(&self.qmp, "stop")
    }

    fn resume(&mut self) -> Result<(), RuntimeError> {
        qmp(&self.qmp, "cont")
    }

    fn console_input(&self) -> Option<ConsoleInput> {
        let stdin = self.stdin.clone()?;
        Some(Arc::new(move |data: &[u8]| {
            let mut w = stdin.lock().unwrap_or_else(|e| e.into_inner());
            w.write_all(data)
                .and_then(|_| w.flush())
                .map_err(|e| RuntimeError::Control {
                    op: "serial input",
                    message: e.to_string(),
                })
        }))
    }
}
