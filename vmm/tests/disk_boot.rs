// SPDX-License-Identifier: Apache-2.0
//! Disk boot: sheaf-vmm finds the kernel and initramfs inside a GPT/MBR +
//! ext4 disk image and boots them, with no kernel outside the image.
//!
//! Images are crafted with the real tools (`sfdisk`, `mkfs.ext4 -d`,
//! `mkfs.fat`), so the partition tables and file systems are exactly what
//! distribution images carry. The kernel is the probe guest's ELF placed at
//! /boot/vmlinuz-<version> behind Debian's /boot/vmlinuz symlink; it prints
//! its command line and the head of its initramfs, which proves the VMM
//! loaded the files from the image and passed root=UUID= of the root file
//! system. (A stock Debian kernel boots only in the nested-KVM box, see
//! docs/testing.md.)
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use sheaf_vmm::boot::BootError;
use sheaf_vmm::boot::disk::{self, DiskBootFiles};
use sheaf_vmm::config::ConfigError;
use sheaf_vmm::devices::virtio::block::{AsyncBlockBackend, SyncAdapter, engine};
use sheaf_vmm::{
    DiskConfig, Error, ExitReason, FileBackend, IoEngine, MemBackend, Vm, VmConfig, probe,
};

const MIB: u64 = 1 << 20;
const INITRD_HEAD: &[u8] = b"SHEAF-INITRD-OK-";

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A partition to create: its sfdisk line (start/size in sectors) and what
/// goes in it.
enum Fs<'a> {
    /// ext4 with the contents of this directory and this UUID.
    Ext4(&'a Path, &'a str),
    /// FAT.
    Fat,
    /// Left as zeros.
    Empty,
}

/// Writes a 64 MiB image with partition table `label` (`gpt` or `dos`)
/// and `parts`, each 24 MiB from 1 MiB on.
fn image(dir: &Path, label: &str, parts: &[Fs<'_>]) -> PathBuf {
    let img = dir.join(format!("disk-{label}-{}.img", parts.len()));
    let f = std::fs::File::create(&img).unwrap();
    f.set_len(64 * MIB).unwrap();
    drop(f);
    let mut table = format!("label: {label}\n");
    for i in 0..parts.len() as u64 {
        table.push_str(&format!(
            "start={}, size={}\n",
            2048 + i * 24 * 2048,
            24 * 2048
        ));
    }
    let mut child = Command::new("sfdisk")
        .args(["-q", img.to_str().unwrap()])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("sfdisk (scripts/setup installs fdisk)");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(table.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success());
    for (i, fs) in parts.iter().enumerate() {
        let start = 2048 + i as u64 * 24 * 2048;
        match fs {
            Fs::Ext4(root, uuid) => run(Command::new("mkfs.ext4")
                .args(["-q", "-F", "-b", "4096", "-U", uuid, "-E"])
                .arg(format!("offset={}", start * 512))
                .arg("-d")
                .arg(root)
                .arg(&img)
                .arg("24M")),
            Fs::Fat => run(Command::new("mkfs.fat")
                .arg(format!("--offset={start}"))
                .arg(&img)
                .arg((24 * 1024).to_string())),
            Fs::Empty => {}
        }
    }
    img
}

/// A root file system tree: /etc, and a kernel + initramfs in /boot behind
/// Debian's symlinks.
fn debian_like_root(dir: &Path, kernel: &[u8]) -> PathBuf {
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("boot")).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/hostname"), "disk-boot\n").unwrap();
    std::fs::write(root.join("boot/vmlinuz-6.1.0-99-probe"), kernel).unwrap();
    let mut initrd = INITRD_HEAD.to_vec();
    initrd.resize(300_000, 0x5a);
    std::fs::write(root.join("boot/initrd.img-6.1.0-99-probe"), &initrd).unwrap();
    std::os::unix::fs::symlink("vmlinuz-6.1.0-99-probe", root.join("boot/vmlinuz")).unwrap();
    std::os::unix::fs::symlink("initrd.img-6.1.0-99-probe", root.join("boot/initrd.img")).unwrap();
    root
}

fn probe_kernel() -> Vec<u8> {
    std::fs::read(probe::elf_path()).unwrap()
}

fn file_backend(img: &Path) -> Arc<dyn AsyncBlockBackend> {
    Arc::new(SyncAdapter::new(Arc::new(
        FileBackend::open(img, true, None).unwrap(),
    )))
}

/// `img` read-only on the VM's default engine (io_uring where allowed).
fn uring_backend(img: &Path) -> Arc<dyn AsyncBlockBackend> {
    engine::open_disk(&DiskConfig {
        path: img.to_path_buf(),
        read_only: true,
        id: None,
        io_engine: IoEngine::Auto,
        io_threads: None,
        queues: None,
    })
    .unwrap()
}

fn find(img: &Path) -> Result<DiskBootFiles, BootError> {
    disk::find(file_backend(img), 0, None)
}

const ROOT_UUID: &str = "5eaf0b00-7000-4000-8000-0000000000a1";
const BOOT_UUID: &str = "5eaf0b00-7000-4000-8000-0000000000b2";

#[test]
fn finds_kernel_initramfs_and_root_uuid_on_gpt_and_mbr() {
    let dir = tempfile::tempdir().unwrap();
    let root = debian_like_root(dir.path(), &probe_kernel());
    for label in ["gpt", "dos"] {
        let img = image(dir.path(), label, &[Fs::Empty, Fs::Ext4(&root, ROOT_UUID)]);
        let f = find(&img).unwrap();
        assert_eq!(f.root_uuid, ROOT_UUID, "{label}");
        assert_eq!(f.root_partition, 2);
        assert_eq!(f.kernel_path, "partition 2:/boot/vmlinuz-6.1.0-99-probe");
        assert_eq!(f.kernel, probe_kernel());
        assert_eq!(
            f.initramfs_path.as_deref(),
            Some("partition 2:/boot/initrd.img-6.1.0-99-probe")
        );
        let initrd = f.initramfs.unwrap();
        assert_eq!(initrd.len(), 300_000);
        assert!(initrd.starts_with(INITRD_HEAD));
        // The reads are bounded: the files plus metadata, not the disk.
        assert!(f.bytes_read < 16 * MIB, "read {} bytes", f.bytes_read);
    }
}

#[test]
fn separate_boot_partition_and_newest_versioned_kernel() {
    let dir = tempfile::tempdir().unwrap();
    // /boot partition: kernels at its root, no /etc, no symlinks.
    let boot = dir.path().join("bootfs");
    std::fs::create_dir_all(&boot).unwrap();
    std::fs::write(boot.join("vmlinuz-6.1.0-9-amd64"), b"old kernel").unwrap();
    std::fs::write(boot.join("vmlinuz-6.1.0-27-amd64"), probe_kernel()).unwrap();
    std::fs::write(boot.join("initrd.img-6.1.0-27-amd64"), INITRD_HEAD).unwrap();
    let root = dir.path().join("rootfs");
    std::fs::create_dir_all(root.join("etc")).unwrap();
    let img = image(
        dir.path(),
        "gpt",
        &[Fs::Ext4(&boot, BOOT_UUID), Fs::Ext4(&root, ROOT_UUID)],
    );
    let f = find(&img).unwrap();
    assert_eq!(f.kernel_path, "partition 1:/vmlinuz-6.1.0-27-amd64");
    assert_eq!(
        f.initramfs_path.as_deref(),
        Some("partition 1:/initrd.img-6.1.0-27-amd64")
    );
    assert_eq!(f.root_uuid, ROOT_UUID, "root is the partition with /etc");
    assert_eq!(f.root_partition, 2);
    // An explicit partition restricts the search.
    let e = disk::find(file_backend(&img), 0, Some(2)).unwrap_err();
    assert!(matches!(e, BootError::KernelNotFound { .. }), "{e}");
    let e = disk::find(file_backend(&img), 0, Some(7)).unwrap_err();
    assert!(
        matches!(e, BootError::NoSuchPartition { partition: 7, .. }),
        "{e}"
    );
}

#[test]
fn no_partition_table_is_named() {
    let dir = tempfile::tempdir().unwrap();
    // Zeros.
    let zeros = dir.path().join("zeros.img");
    std::fs::write(&zeros, vec![0u8; 4 * MIB as usize]).unwrap();
    let e = find(&zeros).unwrap_err();
    assert!(matches!(e, BootError::NoPartitionTable { .. }), "{e}");
    assert!(e.to_string().contains("no GPT header"), "{e}");
    // A bare ext4 file system on the whole disk.
    let root = debian_like_root(dir.path(), &probe_kernel());
    let bare = dir.path().join("bare.img");
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&root)
        .arg(&bare)
        .arg("16M"));
    let e = find(&bare).unwrap_err();
    assert!(matches!(e, BootError::NoPartitionTable { .. }), "{e}");
    assert!(e.to_string().contains("bare ext4"), "{e}");
    // A disk smaller than a partition table.
    let tiny = dir.path().join("tiny.img");
    std::fs::write(&tiny, [0u8; 512]).unwrap();
    assert!(matches!(
        find(&tiny).unwrap_err(),
        BootError::NoPartitionTable { .. }
    ));
}

#[test]
fn no_ext4_root_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "gpt", &[Fs::Fat, Fs::Empty]);
    let e = find(&img).unwrap_err();
    assert!(
        matches!(e, BootError::NoRootFilesystem { partitions: 2, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("ext4"), "{e}");
}

#[test]
fn no_kernel_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::create_dir_all(root.join("boot")).unwrap();
    // A symlink loop and a dangling link are not kernels.
    std::os::unix::fs::symlink("vmlinuz", root.join("boot/vmlinuz")).unwrap();
    std::os::unix::fs::symlink("/nonexistent", root.join("vmlinuz")).unwrap();
    // A directory named like a kernel is not one either.
    std::fs::create_dir_all(root.join("boot/vmlinuz-9.9")).unwrap();
    let img = image(dir.path(), "gpt", &[Fs::Ext4(&root, ROOT_UUID)]);
    let e = find(&img).unwrap_err();
    assert!(
        matches!(&e, BootError::KernelNotFound { partitions, .. } if partitions == &[1]),
        "{e}"
    );
    assert!(e.to_string().contains("/boot/vmlinuz"), "{e}");
}

#[test]
fn a_kernel_that_is_not_x86_64_is_named() {
    let dir = tempfile::tempdir().unwrap();
    // An aarch64 ELF header, a 32-bit x86 ELF header, a shell script.
    let mut arm = probe_kernel();
    arm[18..20].copy_from_slice(&183u16.to_le_bytes());
    let mut i386 = probe_kernel();
    i386[4] = 1;
    for (i, (kernel, want)) in [
        (arm, "machine 183"),
        (i386, "32-bit ELF"),
        (
            b"#!/bin/sh\necho hi\n".to_vec(),
            "neither an ELF nor a bzImage",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let sub = dir.path().join(format!("k{i}"));
        let root = debian_like_root(&sub, &kernel);
        let img = image(&sub, "gpt", &[Fs::Ext4(&root, ROOT_UUID)]);
        let e = find(&img).unwrap_err();
        assert!(matches!(e, BootError::NotX86Kernel { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains(want), "{msg}");
        assert!(msg.contains("/boot/vmlinuz-6.1.0-99-probe"), "{msg}");
    }
}

#[test]
fn config_rejects_inconsistent_disk_boot() {
    let e = VmConfig::builder()
        .kernel("/k")
        .boot_from_disk(0, None)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("exclusive"), "{e}");
    let e = VmConfig::builder()
        .boot_from_disk(0, Some(0))
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("counts from 1"), "{e}");
    let cfg: VmConfig =
        serde_json::from_str(r#"{"vcpus":1,"kernel":{"from_disk":{"disk":1}}}"#).unwrap();
    assert_eq!(cfg.kernel.from_disk.as_ref().unwrap().disk, 1);
    // Disk 1 of a VM with one disk: refused when the VM is created.
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("d.img");
    std::fs::write(&img, vec![0u8; MIB as usize]).unwrap();
    let cfg = VmConfig::builder()
        .boot_from_disk(1, None)
        .disk(&img)
        .build()
        .unwrap();
    let e = Vm::new(cfg).unwrap_err();
    assert!(
        matches!(&e, Error::Config(ConfigError::BootSource(m)) if m.contains("has 1 disk")),
        "{e:?}"
    );
    // A disk without a partition table fails the create with the reason.
    let cfg = VmConfig::builder()
        .boot_from_disk(0, None)
        .disk(&img)
        .build()
        .unwrap();
    let e = Vm::new(cfg).unwrap_err();
    assert!(
        matches!(e, Error::Boot(BootError::NoPartitionTable { .. })),
        "{e:?}"
    );
}

fn kvm_available() -> bool {
    let ok = Path::new("/dev/kvm").exists();
    if !ok {
        eprintln!("SKIP: /dev/kvm is absent; probe guest tests need KVM");
    }
    ok
}

/// Boots `cfg` and checks the guest saw the disk's kernel, initramfs and
/// root, and did its disk I/O on the same disk.
fn boot_and_check(vm: Vm, what: &str) -> String {
    vm.start().unwrap();
    let reason = vm
        .wait_timeout(Duration::from_secs(60))
        .expect("probe guest timed out");
    let out = String::from_utf8_lossy(&vm.console().contents()).into_owned();
    assert_eq!(
        reason,
        ExitReason::DebugExit { code: 0 },
        "{what} console:\n{out}"
    );
    for line in [
        format!("cmdline: root=UUID={ROOT_UUID} rw console=ttyS0 probe.token=disk"),
        "initrd: 300000 bytes, head SHEAF-INITRD-OK-".to_string(),
        "token: disk".to_string(),
        "probe: PASS".to_string(),
    ] {
        assert!(out.contains(&line), "{what}: missing {line:?} in:\n{out}");
    }
    out
}

#[test]
fn probe_guest_boots_from_its_own_gpt_ext4_disk_on_every_io_engine() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = debian_like_root(dir.path(), &probe_kernel());
    let pristine = image(dir.path(), "gpt", &[Fs::Ext4(&root, ROOT_UUID)]);
    for engine in [IoEngine::IoUring, IoEngine::Threads, IoEngine::Sync] {
        let img = dir.path().join(format!("{engine:?}.img"));
        std::fs::copy(&pristine, &img).unwrap();
        let cfg = VmConfig::builder()
            .name("disk-boot")
            .memory_mib(64)
            .boot_from_disk(0, None)
            .cmdline("console=ttyS0 probe.token=disk")
            .cmdline_virtio_devices(true)
            .disk_config(DiskConfig {
                path: img.clone(),
                read_only: false,
                id: Some("boot-disk".into()),
                io_engine: engine,
                io_threads: None,
                queues: None,
            })
            .build()
            .unwrap();
        let out = boot_and_check(Vm::new(cfg).unwrap(), &format!("{engine:?}"));
        assert!(out.contains("virtio: id boot-disk"), "{out}");
        // The guest wrote its reply to sector 1 of the disk it booted from
        // (over the GPT header: the image is a throw-away copy).
        let c = std::fs::read(&img).unwrap();
        assert_eq!(&c[512..524], b"PROBE-REPLY:", "{engine:?}");
    }
}

#[test]
fn probe_guest_boots_from_an_embedder_backend_and_keeps_an_explicit_root() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = debian_like_root(dir.path(), &probe_kernel());
    let img = image(dir.path(), "dos", &[Fs::Ext4(&root, ROOT_UUID)]);
    // An in-memory backend attached at run time, as the second disk.
    let mem = Arc::new(MemBackend::from_bytes(
        std::fs::read(&img).unwrap(),
        "mem-boot",
    ));
    let other = dir.path().join("other.img");
    std::fs::write(&other, vec![0u8; MIB as usize]).unwrap();
    let cfg = VmConfig::builder()
        .name("disk-boot-mem")
        .memory_mib(64)
        .boot_from_disk(1, Some(1))
        .cmdline("root=/dev/vdb1 console=ttyS0 probe.token=disk")
        .cmdline_virtio_devices(true)
        .disk(&other)
        .build()
        .unwrap();
    let vm = Vm::builder(cfg).disk_backend(mem).create().unwrap();
    vm.start().unwrap();
    let reason = vm.wait_timeout(Duration::from_secs(60)).unwrap();
    let out = String::from_utf8_lossy(&vm.console().contents()).into_owned();
    assert_eq!(reason, ExitReason::DebugExit { code: 0 }, "{out}");
    // The user's root= is kept, nothing prepended.
    assert!(
        out.contains("cmdline: root=/dev/vdb1 console=ttyS0 probe.token=disk"),
        "{out}"
    );
    assert!(
        out.contains("initrd: 300000 bytes, head SHEAF-INITRD-OK-"),
        "{out}"
    );
    // io_uring engine through engine::open_disk reads the image too.
    let b = uring_backend(&img);
    assert_eq!(disk::find(b, 0, None).unwrap().root_uuid, ROOT_UUID);
}

/// The real thing: the Debian 12 cloud disk that `scripts/guest-image
/// debian` builds with mmdebstrap. Its kernel is a stock bzImage, which this
/// machine's KVM cannot run (the nested-KVM box boots it); here the VMM's
/// disk-boot path must find it, its initramfs and the root UUID, read
/// through the io_uring engine.
#[test]
fn debian_cloud_image_kernel_initramfs_and_root_are_found() {
    if sheaf_testkit::skip_slow("debian_disk_boot") {
        return;
    }
    let image = sheaf_testkit::debian::DebianImage::build().unwrap();
    let b = uring_backend(&image.raw);
    let f = disk::find(b, 0, None).unwrap();
    let v = &image.kernel_version;
    assert!(v.ends_with("-cloud-amd64"), "{v}");
    assert_eq!(f.kernel_path, format!("partition 1:/boot/vmlinuz-{v}"));
    assert_eq!(
        f.initramfs_path.as_deref(),
        Some(format!("partition 1:/boot/initrd.img-{v}").as_str())
    );
    assert_eq!(f.root_uuid, image.root_uuid);
    assert_eq!(f.root_partition, 1);
    // A bzImage with a 64-bit entry, byte-identical to the file in the image
    // as the kernel's own package installed it.
    assert_eq!(&f.kernel[0x202..0x206], b"HdrS");
    let initrd = f.initramfs.unwrap();
    assert!(
        initrd.len() > 4 << 20,
        "initramfs of {} bytes",
        initrd.len()
    );
    eprintln!(
        "debian image: kernel {} ({} bytes), initramfs {} bytes, {} bytes read from the disk",
        f.kernel_path,
        f.kernel.len(),
        initrd.len(),
        f.bytes_read
    );
}

#[test]
fn a_kernel_larger_than_the_cap_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let root = debian_like_root(dir.path(), &probe_kernel());
    // A sparse 300 MiB "kernel": the inode says so, the blocks are holes.
    let big = root.join("boot/vmlinuz-6.1.0-99-probe");
    let f = std::fs::OpenOptions::new().write(true).open(&big).unwrap();
    f.set_len(300 * MIB).unwrap();
    drop(f);
    let img = image(dir.path(), "gpt", &[Fs::Ext4(&root, ROOT_UUID)]);
    let e = find(&img).unwrap_err();
    assert!(
        matches!(e, BootError::DiskFileTooLarge { size, .. } if size == 300 * MIB),
        "{e}"
    );
}

mod hostile_images {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    /// A valid GPT + ext4 image (built once), as bytes.
    fn pristine() -> &'static [u8] {
        static IMG: OnceLock<Vec<u8>> = OnceLock::new();
        IMG.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let root = debian_like_root(dir.path(), &probe_kernel());
            let img = image(dir.path(), "gpt", &[Fs::Ext4(&root, ROOT_UUID)]);
            std::fs::read(img).unwrap()
        })
    }

    fn find_in(bytes: Vec<u8>) -> Result<DiskBootFiles, BootError> {
        let b: Arc<dyn AsyncBlockBackend> = Arc::new(SyncAdapter::new(Arc::new(
            MemBackend::from_bytes(bytes, "hostile"),
        )));
        disk::find(b, 0, None)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Corrupting the partition table or the file system's metadata
        /// (superblock, group descriptors, bitmaps, inode tables,
        /// directories) gives a boot error or the right files, never a
        /// panic, a hang or an unbounded allocation.
        #[test]
        fn corrupted_images_never_panic(
            flips in proptest::collection::vec((0u64..(3 * MIB), any::<u8>()), 1..64),
        ) {
            let mut img = pristine().to_vec();
            for (at, v) in flips {
                // The GPT (first 34 sectors) or the first 2 MiB of the
                // ext4 partition at 1 MiB, where its metadata lives.
                let off = if at < 34 * 512 { at } else { MIB + at % (2 * MIB) };
                img[off as usize] ^= v | 1;
            }
            if let Ok(f) = find_in(img) {
                prop_assert!(f.kernel.len() as u64 <= disk::MAX_KERNEL_BYTES);
            }
        }
    }
}
