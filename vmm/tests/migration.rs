// SPDX-License-Identifier: Apache-2.0
//! Pre-copy live migration of the probe guest on the host's /dev/kvm, over
//! loopback TCP, to a target VM in the same process sharing the disk file.
//! The guest appends log records to its disk and prints `log: ack k` once
//! each is durable; after a migration the acks continue on the target with
//! none lost or repeated, and every acknowledged record is in the file.
//!
//! Failures are injected by a forwarding proxy that cuts the connection at
//! a chosen phase; the source must keep running and the target must fail.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sheaf_vmm::migration::transport::{Role, SecureStream};
use sheaf_vmm::migration::wire::{self, Msg, PagesBuf};
use sheaf_vmm::{
    Error, MigrationConfig, MigrationError, Phase, Progress, Vm, VmConfig, VmState, probe,
};

const KEY: [u8; 32] = *b"sheaf-migration-test-key-32bytes";

fn kvm_available() -> bool {
    if Path::new("/dev/kvm").exists() {
        return true;
    }
    eprintln!("SKIP: /dev/kvm is absent; migration tests need KVM");
    false
}

fn disk_file(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("disk.img");
    std::fs::File::create(&p).unwrap().set_len(4 << 20).unwrap();
    p
}

fn config(disk: &Path) -> VmConfig {
    VmConfig::builder()
        .name("mig")
        .vcpus(2)
        .memory_mib(64)
        .track_dirty_pages(true)
        .kernel(probe::elf_path())
        .cmdline("console=ttyS0 probe.need_disk=1 probe.log=1000000 probe.log_pause=20000")
        .cmdline_virtio_devices(true)
        .disk(disk)
        .build()
        .unwrap()
}

fn console(vm: &Vm) -> String {
    String::from_utf8_lossy(&vm.console().contents()).into_owned()
}

/// Acknowledged record indices in console output, in order.
fn acks(out: &str) -> Vec<u64> {
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("log: ack "))
        .filter_map(|n| n.trim().parse().ok())
        .collect()
}

fn wait_acks(vm: &Vm, n: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = console(vm);
        if acks(&out).len() >= n {
            return out;
        }
        assert!(Instant::now() < deadline, "no {n} acks; console:\n{out}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The source keeps running: its ack count grows by `more`.
fn keeps_running(vm: &Vm, more: usize) {
    assert_eq!(vm.state(), VmState::Running);
    let now = acks(&console(vm)).len();
    wait_acks(vm, now + more);
}

/// An error and its causes, one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn assert_consecutive(seq: &[u64]) {
    for (i, k) in seq.iter().enumerate() {
        assert_eq!(*k, i as u64, "acks not consecutive: {seq:?}");
    }
}

/// Every acknowledged record is in the disk file.
fn assert_on_disk(disk: &Path, seq: &[u64]) {
    let c = std::fs::read(disk).unwrap();
    for &k in seq {
        let off = (2048 + 8 * k as usize) * 512;
        assert_eq!(&c[off..off + 8], b"SHEAFLOG", "record {k}");
        assert_eq!(
            u64::from_le_bytes(c[off + 8..off + 16].try_into().unwrap()),
            k
        );
    }
}

/// Runs a target on a fresh listener; returns its address and the result.
fn spawn_target(
    disk: &Path,
    key: [u8; 32],
) -> (
    std::net::SocketAddr,
    std::thread::JoinHandle<sheaf_vmm::Result<Vm>>,
) {
    spawn_target_with(disk, MigrationConfig::new(key))
}

/// [`spawn_target`] with the target's migration settings.
fn spawn_target_with(
    disk: &Path,
    mc: MigrationConfig,
) -> (
    std::net::SocketAddr,
    std::thread::JoinHandle<sheaf_vmm::Result<Vm>>,
) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let cfg = config(disk);
    let h = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        Vm::builder(cfg).receive_migration(s, &mc)
    });
    (addr, h)
}

#[test]
fn running_guest_migrates_and_its_log_continues_on_the_target() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = disk_file(dir.path());
    let src = Vm::new(config(&disk)).unwrap();
    src.start().unwrap();
    wait_acks(&src, 5);
    let (addr, target) = spawn_target(&disk, KEY);
    let report = src
        .migrate(
            TcpStream::connect(addr).unwrap(),
            &MigrationConfig::new(KEY),
        )
        .unwrap();
    let dst = target.join().unwrap().unwrap();
    assert_eq!(src.state(), VmState::Stopped);
    assert_eq!(dst.state(), VmState::Running);
    eprintln!("{report:#?}");
    assert!(report.iterations() >= 2, "{report:?}");
    assert_eq!(report.passes[0].pages, 64 << 8, "pass 0 sends all of RAM");
    assert!(report.passes.last().unwrap().final_pass);
    assert!(report.downtime > Duration::ZERO && report.downtime < report.total_time);
    assert!(report.converged && report.state_bytes > 0);

    let before = console(&src);
    let after = wait_acks(&dst, 10);
    assert!(
        !after.contains("sheaf-probe: boot"),
        "the guest rebooted:\n{after}"
    );
    // One console: the source's output, then the target's (a line cut by
    // the pause continues on the target).
    let seq = acks(&(before.clone() + &after));
    assert!(seq.len() >= acks(&before).len() + 10, "{seq:?}");
    assert_consecutive(&seq);
    dst.pause().unwrap();
    let seq = acks(&(before + &console(&dst)));
    assert_on_disk(&disk, &seq);
}

#[test]
fn dirty_log_works_on_the_target_after_migration() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = disk_file(dir.path());
    let src = Vm::new(config(&disk)).unwrap();
    src.start().unwrap();
    wait_acks(&src, 2);
    let (addr, target) = spawn_target(&disk, KEY);
    src.migrate(
        TcpStream::connect(addr).unwrap(),
        &MigrationConfig::new(KEY),
    )
    .unwrap();
    let dst = target.join().unwrap().unwrap();
    dst.dirty_pages().unwrap();
    let n = acks(&console(&dst)).len();
    wait_acks(&dst, n + 3);
    let dirty: u64 = dst.dirty_pages().unwrap().iter().map(|r| r.count()).sum();
    assert!(dirty > 0, "no dirty pages reported after guest writes");
    // And it migrates again, from the target onwards.
    let (addr, target2) = spawn_target(&disk, KEY);
    let r = dst
        .migrate(
            TcpStream::connect(addr).unwrap(),
            &MigrationConfig::new(KEY),
        )
        .unwrap();
    assert!(r.iterations() >= 2);
    let third = target2.join().unwrap().unwrap();
    let out = wait_acks(&third, 3);
    assert!(!out.contains("sheaf-probe: boot"));
}

#[test]
fn a_wrong_key_is_refused_and_the_source_keeps_running() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = disk_file(dir.path());
    let src = Vm::new(config(&disk)).unwrap();
    src.start().unwrap();
    wait_acks(&src, 2);
    let (addr, target) = spawn_target(&disk, [0x55; 32]);
    let e = src
        .migrate(
            TcpStream::connect(addr).unwrap(),
            &MigrationConfig::new(KEY),
        )
        .unwrap_err();
    let Error::Migration(MigrationError::Failed {
        phase,
        cause,
        source_running,
    }) = &e
    else {
        panic!("{e:?}")
    };
    assert_eq!(*phase, Phase::Handshake);
    assert!(*source_running);
    assert!(
        matches!(
            **cause,
            Error::Migration(MigrationError::Transport(
                sheaf_vmm::TransportError::Unauthenticated
            ))
        ),
        "{cause:?}"
    );
    let te = target.join().unwrap().unwrap_err();
    assert!(
        matches!(te, Error::Migration(MigrationError::ReceiveFailed { .. })),
        "{te:?}"
    );
    keeps_running(&src, 3);
}

/// Forwards one connection; cuts it when a direction's byte budget is used
/// up or on [`Proxy::cut`].
struct Proxy {
    addr: std::net::SocketAddr,
    s2t_limit: Arc<AtomicU64>,
    t2s_limit: Arc<AtomicU64>,
    s2t_done: Arc<AtomicU64>,
    socks: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    fn new(target: std::net::SocketAddr) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = Proxy {
            addr: l.local_addr().unwrap(),
            s2t_limit: Arc::new(AtomicU64::new(u64::MAX)),
            t2s_limit: Arc::new(AtomicU64::new(u64::MAX)),
            s2t_done: Arc::new(AtomicU64::new(0)),
            socks: Arc::new(Mutex::new(Vec::new())),
        };
        let (s2t_limit, t2s_limit, s2t_done, socks) = (
            p.s2t_limit.clone(),
            p.t2s_limit.clone(),
            p.s2t_done.clone(),
            p.socks.clone(),
        );
        std::thread::spawn(move || {
            let (a, _) = l.accept().unwrap();
            let b = TcpStream::connect(target).unwrap();
            socks
                .lock()
                .unwrap()
                .extend([a.try_clone().unwrap(), b.try_clone().unwrap()]);
            let pipe = |mut from: TcpStream,
                        mut to: TcpStream,
                        limit: Arc<AtomicU64>,
                        done: Arc<AtomicU64>,
                        socks: Arc<Mutex<Vec<TcpStream>>>| {
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let sent = done.load(Ordering::SeqCst);
                        let allowed = limit
                            .load(Ordering::SeqCst)
                            .saturating_sub(sent)
                            .min(n as u64) as usize;
                        if to.write_all(&buf[..allowed]).is_err() {
                            break;
                        }
                        done.fetch_add(allowed as u64, Ordering::SeqCst);
                        if allowed < n {
                            break;
                        }
                    }
                    for s in socks.lock().unwrap().drain(..) {
                        let _ = s.shutdown(Shutdown::Both);
                    }
                })
            };
            let t1 = pipe(
                a.try_clone().unwrap(),
                b.try_clone().unwrap(),
                s2t_limit,
                s2t_done,
                socks.clone(),
            );
            let t2 = pipe(b, a, t2s_limit, Arc::new(AtomicU64::new(0)), socks);
            let _ = t1.join();
            let _ = t2.join();
        });
        p
    }

    fn cut(&self) {
        self.s2t_limit.store(0, Ordering::SeqCst);
        self.t2s_limit.store(0, Ordering::SeqCst);
        for s in self.socks.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Handshake bytes: source → target 8 + 32 + 32, target → source 32 + 32.
const HS_S2T: u64 = 72;
const HS_T2S: u64 = 64;
/// An empty-bodied message frame: length, tag byte, AES-GCM tag.
const SMALL_FRAME: u64 = 4 + 1 + 16;

#[derive(Debug, Clone, Copy)]
enum Cut {
    AfterHandshake,
    MidRamPass,
    BeforeFinalState,
    AfterFinalStateBeforeAck,
}

#[test]
fn a_cut_connection_at_each_phase_leaves_the_source_running() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = disk_file(dir.path());
    let src = Vm::new(config(&disk)).unwrap();
    src.start().unwrap();
    wait_acks(&src, 2);
    for cut in [
        Cut::AfterHandshake,
        Cut::MidRamPass,
        Cut::BeforeFinalState,
        Cut::AfterFinalStateBeforeAck,
    ] {
        let (taddr, target) = spawn_target(&disk, KEY);
        let proxy = Arc::new(Proxy::new(taddr));
        let mut cfg = MigrationConfig::new(KEY);
        match cut {
            Cut::AfterHandshake => proxy.s2t_limit.store(HS_S2T, Ordering::SeqCst),
            // Slow pass 0 down so the cut lands inside it.
            Cut::MidRamPass => cfg.bandwidth_limit = Some(4 << 20),
            // The target's Ready is not delivered.
            Cut::AfterFinalStateBeforeAck => proxy
                .t2s_limit
                .store(HS_T2S + SMALL_FRAME, Ordering::SeqCst),
            Cut::BeforeFinalState => {}
        }
        let p = proxy.clone();
        cfg.progress = Some(Arc::new(move |ev: &Progress| match (cut, ev) {
            (Cut::MidRamPass, Progress::Phase(Phase::Precopy { pass: 0 })) => {
                let now = p.s2t_done.load(Ordering::SeqCst);
                p.s2t_limit.store(now + (64 << 10), Ordering::SeqCst);
            }
            (Cut::BeforeFinalState, Progress::Phase(Phase::StopAndCopy)) => p.cut(),
            _ => {}
        }));
        let e = src
            .migrate(TcpStream::connect(proxy.addr).unwrap(), &cfg)
            .unwrap_err();
        let Error::Migration(MigrationError::Failed { phase, .. }) = &e else {
            panic!("{cut:?}: {e:?}")
        };
        let ok = match cut {
            Cut::AfterHandshake => *phase == Phase::Handshake,
            Cut::MidRamPass => *phase == Phase::Precopy { pass: 0 },
            Cut::BeforeFinalState => matches!(phase, Phase::StopAndCopy | Phase::AwaitReady),
            Cut::AfterFinalStateBeforeAck => *phase == Phase::AwaitReady,
        };
        assert!(ok, "{cut:?} failed in {phase}: {e:?}");
        let te = target.join().unwrap().unwrap_err();
        assert!(
            matches!(te, Error::Migration(MigrationError::ReceiveFailed { .. })),
            "{cut:?}: {te:?}"
        );
        eprintln!(
            "{cut:?}:\n  source: {}\n  target: {}",
            chain(&e),
            chain(&te)
        );
        keeps_running(&src, 2);
    }
    // After four failed attempts the same VM still migrates.
    let (addr, target) = spawn_target(&disk, KEY);
    src.migrate(
        TcpStream::connect(addr).unwrap(),
        &MigrationConfig::new(KEY),
    )
    .unwrap();
    let before = console(&src);
    let dst = target.join().unwrap().unwrap();
    let after = wait_acks(&dst, 3);
    assert_consecutive(&acks(&(before + &after)));
}

#[test]
fn a_lost_running_ack_leaves_only_the_target_running() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = disk_file(dir.path());
    let src = Vm::new(config(&disk)).unwrap();
    src.start().unwrap();
    wait_acks(&src, 2);
    let (taddr, target) = spawn_target(&disk, KEY);
    let proxy = Proxy::new(taddr);
    // HelloAck and Ready pass; Running is dropped.
    proxy
        .t2s_limit
        .store(HS_T2S + 2 * SMALL_FRAME, Ordering::SeqCst);
    let e = src
        .migrate(
            TcpStream::connect(proxy.addr).unwrap(),
            &MigrationConfig::new(KEY),
        )
        .unwrap_err();
    assert!(
        matches!(e, Error::Migration(MigrationError::InDoubt { .. })),
        "{e:?}"
    );
    assert_eq!(
        src.state(),
        VmState::Paused,
        "the source must not resume after the commit"
    );
    let dst = target.join().unwrap().unwrap();
    assert_eq!(dst.state(), VmState::Running);
    let before = console(&src);
    let after = wait_acks(&dst, 3);
    assert_consecutive(&acks(&(before + &after)));
}

/// A hand-made source: completes the handshake and Hello, then misbehaves.
fn hostile_source(addr: std::net::SocketAddr) -> SecureStream {
    let s = TcpStream::connect(addr).unwrap();
    let mut link = SecureStream::handshake(s, &KEY, Role::Source, Duration::from_secs(10)).unwrap();
    link.send(&wire::encode(&Msg::Hello {
        version: wire::VERSION,
        memory_bytes: 64 << 20,
        vcpus: 2,
    }))
    .unwrap();
    let mut buf = Vec::new();
    assert!(matches!(
        wire::decode(link.recv(&mut buf).unwrap()).unwrap(),
        Msg::HelloAck
    ));
    link
}

fn receive_error(target: std::thread::JoinHandle<sheaf_vmm::Result<Vm>>) -> Error {
    match target.join().unwrap().unwrap_err() {
        Error::Migration(MigrationError::ReceiveFailed { cause }) => *cause,
        e => panic!("{e:?}"),
    }
}

#[test]
fn hostile_frames_are_refused_by_the_target() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = disk_file(dir.path());
    // Pages outside RAM, misaligned, straddling the end of RAM.
    for gpa in [1u64 << 40, 0x1002, (64 << 20) - 2048, !0xfffu64] {
        let (addr, target) = spawn_target(&disk, KEY);
        let mut link = hostile_source(addr);
        let mut pages = PagesBuf::new(0);
        pages.push(gpa & !1, Some(&[0xaa; wire::PAGE]));
        let _ = link.send(pages.payload());
        let e = receive_error(target);
        assert!(
            matches!(e, Error::Migration(MigrationError::PageOutOfRange { .. })),
            "{gpa:#x}: {e:?}"
        );
    }
    // A giant frame length, written raw after a real handshake: the
    // target refuses it before allocating.
    let (addr, target) = spawn_target(&disk, KEY);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mid = l.local_addr().unwrap();
    let relay = std::thread::spawn(move || {
        // Forward the handshake and Hello, then inject a giant header.
        let (mut a, _) = l.accept().unwrap();
        let mut b = TcpStream::connect(addr).unwrap();
        let mut hs = [0u8; 40];
        a.read_exact(&mut hs).unwrap();
        b.write_all(&hs).unwrap();
        let mut r = [0u8; 64];
        b.read_exact(&mut r).unwrap();
        a.write_all(&r).unwrap();
        let mut p = [0u8; 32];
        a.read_exact(&mut p).unwrap();
        b.write_all(&p).unwrap();
        b.write_all(&u32::MAX.to_be_bytes()).unwrap();
        (a, b)
    });
    let s = TcpStream::connect(mid).unwrap();
    let _link = SecureStream::handshake(s, &KEY, Role::Source, Duration::from_secs(10)).unwrap();
    let _keep = relay.join().unwrap();
    let e = receive_error(target);
    assert!(
        matches!(
            e,
            Error::Migration(MigrationError::Transport(
                sheaf_vmm::TransportError::FrameTooLarge { .. }
            ))
        ),
        "{e:?}"
    );
    // A VM of another shape is refused at Hello.
    let (addr, target) = spawn_target(&disk, KEY);
    let s = TcpStream::connect(addr).unwrap();
    let mut link = SecureStream::handshake(s, &KEY, Role::Source, Duration::from_secs(10)).unwrap();
    link.send(&wire::encode(&Msg::Hello {
        version: wire::VERSION,
        memory_bytes: 128 << 20,
        vcpus: 2,
    }))
    .unwrap();
    let e = receive_error(target);
    assert!(
        matches!(
            e,
            Error::Migration(MigrationError::Mismatch {
                what: "RAM (bytes)",
                ..
            })
        ),
        "{e:?}"
    );
}

#[test]
fn a_guest_dirtying_memory_faster_than_the_link_is_throttled() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = disk_file(dir.path());
    let mut cfg = config(&disk);
    cfg.kernel.cmdline = "console=ttyS0 probe.need_disk=1 probe.log=1000000 \
        probe.log_pause=200000 probe.dirty=1024 probe.dirty_every=20"
        .into();
    let src = Vm::new(cfg.clone()).unwrap();
    src.start().unwrap();
    wait_acks(&src, 2);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let target = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        Vm::builder(cfg).receive_migration(s, &MigrationConfig::new(KEY))
    });
    let mut mc = MigrationConfig::new(KEY);
    mc.bandwidth_limit = Some(16 << 20);
    mc.downtime_budget = Duration::from_millis(30);
    mc.max_iterations = 3;
    let report = src.migrate(TcpStream::connect(addr).unwrap(), &mc).unwrap();
    let dst = target.join().unwrap().unwrap();
    for p in &report.passes {
        eprintln!(
            "pass {:2}: {:5} pages ({:5} zero) {:8} bytes in {:?}, dirtied {:5}, throttle {:2} %{}",
            p.pass,
            p.pages,
            p.zero_pages,
            p.bytes,
            p.duration,
            p.dirtied,
            p.throttle_percent,
            if p.final_pass { " (final)" } else { "" }
        );
    }
    eprintln!(
        "converged {} downtime {:?} total {:?} link {} B/s",
        report.converged, report.downtime, report.total_time, report.link_bytes_per_sec
    );
    assert!(
        report.passes[1].dirtied > 100,
        "the guest does not dirty memory: {report:?}"
    );
    assert!(report.max_throttle_percent > 0, "{report:?}");
    let before = console(&src);
    let after = wait_acks(&dst, 2);
    assert!(!after.contains("sheaf-probe: boot"));
    assert_consecutive(&acks(&(before + &after)));
}

/// The target's `before_start` hook runs after the commit, while the
/// source is paused; when it refuses, the source resumes and keeps its log
/// going, and the target never starts. When it accepts, it ran exactly
/// once before the target's vCPUs did.
#[test]
fn the_before_start_hook_gates_the_switch_over() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = disk_file(dir.path());
    let src = Vm::new(config(&disk)).unwrap();
    src.start().unwrap();
    wait_acks(&src, 3);

    let spawn = |allow: bool, calls: Arc<AtomicU64>| {
        let mut mc = MigrationConfig::new(KEY);
        mc.before_start = Some(Arc::new(move || {
            calls.fetch_add(1, Ordering::SeqCst);
            if allow {
                Ok(())
            } else {
                Err("volume lease not granted".into())
            }
        }));
        spawn_target_with(&disk, mc)
    };

    let refused = Arc::new(AtomicU64::new(0));
    let (addr, target) = spawn(false, refused.clone());
    let err = src
        .migrate(
            TcpStream::connect(addr).unwrap(),
            &MigrationConfig::new(KEY),
        )
        .unwrap_err();
    let msg = chain(&err);
    assert!(msg.contains("volume lease not granted"), "{msg}");
    assert!(
        matches!(
            err,
            Error::Migration(MigrationError::Failed {
                source_running: true,
                ..
            })
        ),
        "{msg}"
    );
    assert_eq!(refused.load(Ordering::SeqCst), 1);
    let terr = chain(&receive_error(target));
    assert!(terr.contains("refused to start"), "{terr}");
    keeps_running(&src, 3);

    let accepted = Arc::new(AtomicU64::new(0));
    let (addr, target) = spawn(true, accepted.clone());
    src.migrate(
        TcpStream::connect(addr).unwrap(),
        &MigrationConfig::new(KEY),
    )
    .unwrap();
    let dst = target.join().unwrap().unwrap();
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    let before = console(&src);
    let after = wait_acks(&dst, 3);
    assert!(!after.contains("sheaf-probe: boot"), "rebooted:\n{after}");
    assert_consecutive(&acks(&(before + &after)));
}

/// First sector and buffer count of the probe's `probe.readloop` mode.
const READ_BASE: u64 = 4096;
const READ_BUFS: u64 = 64;
const READ_MAGIC: u64 = 0x5348_4541_4652_4400;

/// A disk holding the blocks `probe.readloop` reads (see `guest/probe.rs`).
fn read_disk_file(dir: &Path) -> std::path::PathBuf {
    let p = disk_file(dir);
    let mut c = std::fs::read(&p).unwrap();
    for j in 0..=READ_BUFS {
        let off = (READ_BASE * 512 + j * 4096) as usize;
        for w in 0..512u64 {
            let at = off + 8 * w as usize;
            c[at..at + 8].copy_from_slice(&(READ_MAGIC ^ (j << 16 | w)).to_le_bytes());
        }
    }
    std::fs::write(&p, c).unwrap();
    p
}

fn read_config(disk: &Path, engine: sheaf_vmm::config::IoEngine) -> VmConfig {
    let mut cfg = config(disk);
    cfg.kernel.cmdline = format!("console=ttyS0 probe.need_disk=1 probe.readloop={READ_BUFS}");
    cfg.disks[0].io_engine = engine;
    cfg
}

/// Read-loop rounds completed, as printed by the guest.
fn rounds(out: &str) -> usize {
    out.lines()
        .filter(|l| l.trim().starts_with("read: ok "))
        .count()
}

fn wait_rounds(vm: &Vm, n: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = console(vm);
        assert!(
            !out.contains("read: BAD") && !out.contains("probe: FAIL"),
            "the guest saw stale device-written memory:\n{out}"
        );
        if rounds(&out) >= n {
            return out;
        }
        assert!(
            Instant::now() < deadline && vm.state() == VmState::Running,
            "no {n} read rounds ({:?}); console:\n{out}",
            vm.state()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Pages a device writes while pre-copy runs (virtio-blk read data into
/// buffers the vCPU never writes, recycled round robin, so the final
/// descriptor table names only the last) reach the target: after the
/// migration the guest finds in every buffer what the device last put there.
#[test]
fn memory_written_by_a_disk_during_precopy_reaches_the_target() {
    if !kvm_available() {
        return;
    }
    use sheaf_vmm::config::IoEngine;
    for engine in [IoEngine::IoUring, IoEngine::Threads] {
        let dir = tempfile::tempdir().unwrap();
        let disk = read_disk_file(dir.path());
        let src = Vm::new(read_config(&disk, engine)).unwrap();
        src.start().unwrap();
        wait_rounds(&src, 3);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let cfg = read_config(&disk, engine);
        let target = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            Vm::builder(cfg).receive_migration(s, &MigrationConfig::new(KEY))
        });
        let mut mc = MigrationConfig::new(KEY);
        // Slow pass 0 so the device rewrites every buffer after it was sent.
        mc.bandwidth_limit = Some(64 << 20);
        let report = src.migrate(TcpStream::connect(addr).unwrap(), &mc).unwrap();
        let dst = target.join().unwrap().unwrap();
        eprintln!(
            "{engine:?}: {} passes, downtime {:?}",
            report.iterations(),
            report.downtime
        );
        let before = rounds(&console(&src));
        assert!(before >= 3);
        // Round 1 on the target checks all READ_BUFS buffers.
        let out = wait_rounds(&dst, 3);
        assert!(!out.contains("sheaf-probe: boot"), "{out}");
        assert_eq!(dst.state(), VmState::Running);
    }
}
