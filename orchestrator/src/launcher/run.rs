// SPDX-License-Identifier: Apache-2.0
//! The launcher's main loops: `run_vm` (one VM) and `run_replica` (one
//! replica store). Both are plain blocking functions that build their own
//! tokio runtime, for the `sheaf-launcher` binary and for tests.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use sheaf_blockrepl::frontend::Disk;
use sheaf_blockrepl::net::Secret;
use sheaf_blockrepl::net::server::serve;
use sheaf_blockrepl::proto::engine::Phase;
use sheaf_blockrepl::volume::{
    Volume, VolumeConfig, create_replacement_replica, create_replica, lock_replica_dir,
    open_local_replica,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tracing::{info, warn};

use super::files;
use super::metrics::{DiskIoStats, IoMetrics};
use super::protocol::{
    DiskStatus, LaunchFileDisk, LaunchSpec, LauncherCommand, LauncherPhase, LauncherStatus,
    MigrationProgress,
};
use crate::runtime::{
    self, AttachedDisk, ConsoleInput, ConsoleLog, DiskBacking, RuntimeContext, VmExit,
};

/// Launcher failures that prevent it from reporting at all.
#[derive(Debug, thiserror::Error)]
pub enum LauncherError {
    /// I/O on the launcher directory, sockets or the runtime.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// Cause.
        source: std::io::Error,
    },
    /// A replica store could not be created or served.
    #[error("replica: {0}")]
    Replica(#[from] sheaf_blockrepl::Error),
}

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> LauncherError {
    move |source| LauncherError::Io { op, source }
}

pub(super) struct Reporter {
    dir: PathBuf,
    pub(super) tx: watch::Sender<LauncherStatus>,
}

impl Reporter {
    pub(super) fn publish(&self, f: impl FnOnce(&mut LauncherStatus)) {
        let mut st = self.tx.borrow().clone();
        f(&mut st);
        if let Err(e) = st.save(&self.dir) {
            warn!(error = %e, "writing status.json");
        }
        self.tx.send_replace(st);
    }
}

async fn serve_control(
    listener: UnixListener,
    status: watch::Receiver<LauncherStatus>,
    cmds: std_mpsc::Sender<LauncherCommand>,
) {
    let mut backoff = sheaf_blockrepl::net::accept::AcceptBackoff::new();
    loop {
        let sock = match listener.accept().await {
            Ok((s, _)) => {
                backoff.reset();
                s
            }
            Err(e) => {
                if backoff.handle("launcher control", &e).await {
                    continue;
                }
                return;
            }
        };
        let mut status = status.clone();
        let cmds = cmds.clone();
        tokio::spawn(async move {
            let (r, mut w) = sock.into_split();
            let mut lines = BufReader::new(r).lines();
            loop {
                let st = status.borrow_and_update().clone();
                let mut line = serde_json::to_vec(&st).unwrap_or_default();
                line.push(b'\n');
                if w.write_all(&line).await.is_err() {
                    return;
                }
                if st.phase == LauncherPhase::Exited {
                    return;
                }
                tokio::select! {
                    ch = status.changed() => if ch.is_err() { return },
                    l = lines.next_line() => match l {
                        Ok(Some(l)) => {
                            if let Ok(c) = serde_json::from_str::<LauncherCommand>(&l) {
                                let _ = cmds.send(c);
                            }
                        }
                        _ => return,
                    },
                }
            }
        });
    }
}

/// Serves `console.sock`: every byte a client writes goes to the guest's
/// serial input. One thread per client; they end with the process.
fn serve_console_input(path: &std::path::Path, input: ConsoleInput) {
    let _ = std::fs::remove_file(path);
    let listener = match std::os::unix::net::UnixListener::bind(path) {
        Ok(l) => l,
        Err(e) => {
            warn!(error = %e, "console input socket; the console is output-only");
            return;
        }
    };
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let input = input.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 1024];
                loop {
                    match std::io::Read::read(&mut conn, &mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if let Err(e) = input(&buf[..n]) {
                                warn!(error = %e, "console input");
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
}

fn disk_status(
    rt: &tokio::runtime::Runtime,
    spec: &LaunchSpec,
    vols: &[Volume],
) -> Vec<DiskStatus> {
    spec.disks
        .iter()
        .zip(vols)
        .map(|(d, v)| {
            let st = rt
                .block_on(async { tokio::time::timeout(Duration::from_secs(2), v.status()).await });
            let mut ds = DiskStatus {
                name: d.name.clone(),
                volume: d.volume.clone(),
                ..Default::default()
            };
            if let Ok(Ok(s)) = st {
                ds.epoch = s.epoch;
                ds.fenced = s.phase == Phase::Fenced;
                ds.active = s
                    .active
                    .iter()
                    .filter_map(|i| d.replicas.get(*i).copied())
                    .collect();
                ds.rebuilding = s
                    .rebuilding
                    .iter()
                    .filter_map(|i| d.replicas.get(*i).copied())
                    .collect();
            }
            ds
        })
        .collect()
}

/// Runs one VM as described by `spec` until it ends or the agent stops it.
/// Reports through `spec.dir` (see [`super::files`]). Returns how the VM
/// ended; an `Err` only when not even the status could be reported.
pub fn run_vm(spec: LaunchSpec) -> Result<VmExit, LauncherError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("launcher-io")
        .enable_all()
        .build()
        .map_err(io("start runtime"))?;
    let dir = spec.dir.clone();
    let initial = LauncherStatus {
        pid: std::process::id(),
        uid: spec.uid.clone(),
        runtime: spec.runtime.clone(),
        phase: LauncherPhase::Starting,
        disks: Vec::new(),
        exit: None,
        paused: false,
        commands: 0,
        command_error: None,
        migration: None,
    };
    let (tx, rx) = watch::channel(initial);
    let rep = Reporter {
        dir: dir.clone(),
        tx,
    };
    rep.publish(|_| {});
    let sock = dir.join(files::CONTROL);
    let _ = std::fs::remove_file(&sock);
    let listener = {
        let _g = rt.enter();
        UnixListener::bind(&sock).map_err(io("bind control socket"))?
    };
    let (cmd_tx, cmd_rx) = std_mpsc::channel();
    rt.spawn(serve_control(listener, rx, cmd_tx));

    let finish = |exit: VmExit| {
        info!(success = exit.success, reason = %exit.reason, "launcher done");
        let e2 = exit.clone();
        rep.publish(move |s| {
            s.phase = LauncherPhase::Exited;
            s.exit = Some(e2);
        });
        // Let connected agents read the final status.
        std::thread::sleep(Duration::from_millis(100));
        Ok(exit)
    };
    let fail = |reason: String| {
        finish(VmExit {
            success: false,
            reason,
        })
    };

    let Some(runtime) = runtime::by_name(&spec.runtime) else {
        return fail(format!("unknown runtime {:?}", spec.runtime));
    };
    let secret = match &spec.secret_file {
        Some(p) => match Secret::from_file(p) {
            Ok(s) => Some(s),
            Err(e) => return fail(format!("replication secret: {e}")),
        },
        None => None,
    };
    let console = match ConsoleLog::open(&dir.join(files::CONSOLE)) {
        Ok(c) => c,
        Err(e) => return fail(format!("console log: {e}")),
    };
    let ctx = RuntimeContext {
        io: rt.handle().clone(),
        work_dir: dir.clone(),
        console,
    };
    let io_stats: Vec<Arc<DiskIoStats>> = spec.disks.iter().map(|_| Arc::default()).collect();
    let (mut vm, vols) = if let Some(inc) = &spec.incoming {
        let ends = super::migrate::Ends {
            rt: &rt,
            spec: &spec,
            secret: secret.as_ref(),
            runtime: &*runtime,
            ctx: &ctx,
            io_stats: &io_stats,
            rep: &rep,
        };
        match ends.receive(inc, &cmd_rx) {
            Ok(v) => v,
            Err(reason) => {
                rep.publish(|s| {
                    if let Some(m) = s.migration.as_mut() {
                        m.progress = MigrationProgress::Failed;
                        m.reason = Some(reason.clone());
                    }
                });
                return fail(reason);
            }
        }
    } else {
        // Attach every volume with (at least) the epoch the control plane granted.
        let vols = match attach_volumes(rt.handle(), &spec, secret.as_ref()) {
            Ok(v) => v,
            Err(e) => return fail(e),
        };
        publish_disks(&rt, &rep, &spec, &vols);
        let volumes = spec
            .disks
            .iter()
            .zip(&vols)
            .zip(&io_stats)
            .map(|((d, v), st)| AttachedDisk {
                name: d.name.clone(),
                serial: d.serial.clone(),
                disk: DiskBacking::Volume(Disk::new(v.clone())),
                read_only: d.read_only,
                io_stats: st.clone(),
            })
            .collect();
        let attached = guest_disk_order(volumes, &spec.file_disks);
        match runtime.start(&spec.vm, attached, &ctx) {
            Ok(vm) => (vm, vols),
            Err(e) => {
                detach_all(&rt, vols);
                return fail(format!("starting the VM: {}", error_chain(&e)));
            }
        }
    };
    let io = IoReport {
        spec: &spec,
        stats: &io_stats,
        timed: runtime.times_disk_io(),
        last: std::cell::RefCell::new(None),
    };
    rep.publish(|s| s.phase = LauncherPhase::Running);
    info!(instance = %spec.instance, runtime = %spec.runtime, "VM running");
    if let Some(input) = vm.console_input() {
        serve_console_input(&dir.join(files::CONSOLE_INPUT), input);
    }

    let mut last_check = Instant::now();
    let exit = loop {
        if let Some(exit) = vm.wait_timeout(Duration::from_millis(100)) {
            break exit;
        }
        match cmd_rx.try_recv() {
            Ok(LauncherCommand::Stop) => {
                rep.publish(|s| s.phase = LauncherPhase::Stopping);
                break vm.stop();
            }
            Ok(c @ (LauncherCommand::Pause | LauncherCommand::Resume)) => {
                let pause = c == LauncherCommand::Pause;
                let paused = rep.tx.borrow().paused;
                let res = match (pause, paused) {
                    (true, true) => Err("the VM is already paused".to_string()),
                    (false, false) => Err("the VM is not paused".to_string()),
                    (true, false) => vm.pause().map_err(|e| e.to_string()),
                    (false, true) => vm.resume().map_err(|e| e.to_string()),
                };
                match &res {
                    Ok(()) => info!(instance = %spec.instance, ?c, "done"),
                    Err(e) => warn!(instance = %spec.instance, ?c, error = %e, "command failed"),
                }
                rep.publish(|s| {
                    s.commands += 1;
                    if res.is_ok() {
                        s.paused = pause;
                    }
                    s.command_error = res.err();
                });
            }
            Ok(LauncherCommand::Migrate(m)) => {
                if let Some(exit) = super::migrate::send(&mut vm, &m, secret.as_ref(), &rep) {
                    break exit;
                }
            }
            Err(_) => {}
        }
        if last_check.elapsed() >= Duration::from_secs(1) {
            last_check = Instant::now();
            io.save();
            let disks = disk_status(&rt, &spec, &vols);
            if let Some(d) = disks.iter().find(|d| d.fenced) {
                let reason = format!("volume {} fenced by a newer engine", d.volume);
                warn!(%reason, "stopping the VM");
                let _ = vm.stop();
                rep.publish(|s| s.disks = disks);
                break VmExit {
                    success: false,
                    reason,
                };
            }
            if rep.tx.borrow().disks != disks {
                rep.publish(|s| s.disks = disks);
            }
        }
    };
    drop(vm);
    io.save();
    detach_all(&rt, vols);
    finish(exit)
}

/// Attaches every volume of `spec` with (at least) the epoch the control
/// plane granted; on failure detaches those already attached.
pub(super) fn attach_volumes(
    rt: &tokio::runtime::Handle,
    spec: &LaunchSpec,
    secret: Option<&Secret>,
) -> Result<Vec<Volume>, String> {
    let mut vols = Vec::new();
    for d in &spec.disks {
        let Some(secret) = secret.cloned() else {
            return Err("volumes need a replication secret".into());
        };
        let mut cfg = VolumeConfig::remote(&d.replicas, secret);
        cfg.min_epoch = d.epoch.saturating_sub(1);
        cfg.min_write_replicas = d
            .min_write_replicas
            .map(|w| w.clamp(1, d.replicas.len().max(1)));
        cfg.attach_timeout = Duration::from_secs(20);
        match rt.block_on(Volume::attach(cfg)) {
            Ok(v) => vols.push(v),
            Err(e) => {
                for v in vols {
                    let _ = rt.block_on(v.detach());
                }
                return Err(format!("attaching volume {}: {e}", d.volume));
            }
        }
    }
    Ok(vols)
}

/// Detaches `vols` (each given 5 s).
pub(super) fn detach_all(rt: &tokio::runtime::Runtime, vols: Vec<Volume>) {
    for v in vols {
        let _ =
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), v.detach()).await });
    }
}

/// Publishes the engines' view of `vols`.
pub(super) fn publish_disks(
    rt: &tokio::runtime::Runtime,
    rep: &Reporter,
    spec: &LaunchSpec,
    vols: &[Volume],
) {
    let disks = disk_status(rt, spec, vols);
    info!(disks = ?disks.iter().map(|d| (&d.volume, d.epoch)).collect::<Vec<_>>(), "volumes attached");
    rep.publish(|s| s.disks = disks);
}

/// `e` and its sources, `: `-separated (a source already shown at the end
/// of the text is not repeated), so the reason names the root cause.
pub(super) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let m = s.to_string();
        if !text.ends_with(&m) {
            text.push_str(": ");
            text.push_str(&m);
        }
        source = s.source();
    }
    text
}

/// The guest's disks: the volumes in their order, each file disk inserted
/// at its `position` (clamped to the end).
pub(super) fn guest_disk_order(
    mut disks: Vec<AttachedDisk>,
    files: &[LaunchFileDisk],
) -> Vec<AttachedDisk> {
    let mut files: Vec<&LaunchFileDisk> = files.iter().collect();
    files.sort_by_key(|f| f.position);
    for f in files {
        let at = f.position.min(disks.len());
        disks.insert(
            at,
            AttachedDisk {
                name: f.name.clone(),
                serial: f.serial.clone(),
                disk: DiskBacking::File(f.path.clone()),
                read_only: f.read_only,
                io_stats: Arc::default(),
            },
        );
    }
    disks
}

/// Writes the disks' guest I/O histograms to `io-metrics.json` when they
/// changed since the last time.
struct IoReport<'a> {
    spec: &'a LaunchSpec,
    stats: &'a [Arc<DiskIoStats>],
    timed: bool,
    last: std::cell::RefCell<Option<IoMetrics>>,
}

impl IoReport<'_> {
    fn save(&self) {
        let m = IoMetrics {
            instance: self.spec.instance.clone(),
            uid: self.spec.uid.clone(),
            timed: self.timed,
            disks: self
                .spec
                .disks
                .iter()
                .zip(self.stats)
                .map(|(d, s)| s.snapshot(&d.name, &d.volume))
                .collect(),
        };
        if self.last.borrow().as_ref() == Some(&m) {
            return;
        }
        if let Err(e) = m.save(&self.spec.dir) {
            warn!(error = %e, "writing io-metrics.json");
        }
        *self.last.borrow_mut() = Some(m);
    }
}

/// Arguments of `sheaf-launcher replica`.
#[derive(Debug, Clone)]
pub struct ReplicaArgs {
    /// Store directory.
    pub dir: PathBuf,
    /// Listen address (port 0: any).
    pub listen: SocketAddr,
    /// Replication secret file.
    pub secret_file: PathBuf,
    /// Create a store of this size if the directory holds none.
    pub create_size: Option<u64>,
    /// With `create_size`: an empty replacement replica (rebuilt on attach).
    pub replacement: bool,
}

/// Serves one replica store until killed. Prints `listening on ADDR` on
/// stdout once it accepts connections.
pub fn run_replica(args: ReplicaArgs) -> Result<(), LauncherError> {
    let secret = Secret::from_file(&args.secret_file)?;
    std::fs::create_dir_all(&args.dir).map_err(io("create replica directory"))?;
    // One server per directory for the life of this process (a predecessor
    // still exiting gets a few seconds to let go).
    let _dir_lock = lock_replica_dir(&args.dir, Duration::from_secs(5))?;
    if let Some(size) = args.create_size
        && !args.dir.join("superblock").exists()
    {
        if args.replacement {
            create_replacement_replica(&args.dir, size)?;
        } else {
            create_replica(&args.dir, size)?;
        }
    }
    let replica = open_local_replica(&args.dir)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io("start runtime"))?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .map_err(io("listen"))?;
        let addr = listener.local_addr().map_err(io("listen"))?;
        let mut out = std::io::stdout();
        let _ = writeln!(out, "listening on {addr}");
        let _ = out.flush();
        serve(listener, secret, replica).await?;
        Ok(())
    })
}

/// Connects to a launcher's control socket.
pub async fn connect(dir: &std::path::Path) -> std::io::Result<UnixStream> {
    UnixStream::connect(dir.join(files::CONTROL)).await
}
