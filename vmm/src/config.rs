// SPDX-License-Identifier: Apache-2.0
//! VM configuration: a plain serde struct plus a builder.
//!
//! [`VmConfig`] is data only (it can come from JSON or YAML); things that
//! cannot be serialized — a block backend object, a serial callback — are
//! attached at run time through [`crate::VmBuilder`].
//!
//! ```
//! use sheaf_vmm::VmConfig;
//! let cfg = VmConfig::builder()
//!     .vcpus(2)
//!     .memory_mib(256)
//!     .kernel("/boot/vmlinuz")
//!     .cmdline("console=ttyS0 quiet")
//!     .disk("/var/lib/disk.img")
//!     .build()
//!     .unwrap();
//! assert_eq!(cfg.vcpus, 2);
//! let json = serde_json::to_string(&cfg).unwrap();
//! let back: VmConfig = serde_json::from_str(&json).unwrap();
//! assert_eq!(back, cfg);
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Largest number of vCPUs a VM may have (APIC ids must fit the MADT's u8).
pub const MAX_VCPUS: u8 = 254;
/// Largest number of virtio-mmio devices (one IOAPIC pin each).
pub const MAX_VIRTIO_DEVICES: usize = 16;
/// Smallest guest memory size in MiB.
pub const MIN_MEMORY_MIB: u64 = 2;
/// Largest kernel command line in bytes (Linux's x86 COMMAND_LINE_SIZE).
pub const MAX_CMDLINE_LEN: usize = 2048;

/// Errors found by [`VmConfig::validate`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// vcpus is zero or above [`MAX_VCPUS`].
    #[error("vcpus must be between 1 and {MAX_VCPUS}, got {0}")]
    Vcpus(u8),
    /// Memory size below the minimum or too large for the host address space.
    #[error("memory must be between {MIN_MEMORY_MIB} MiB and 1 TiB, got {0} MiB")]
    MemorySize(u64),
    /// No kernel image given.
    #[error("no kernel image configured (set kernel.path or kernel.from_disk)")]
    MissingKernel,
    /// The disk-boot settings are inconsistent.
    #[error("boot source: {0}")]
    BootSource(String),
    /// The command line is too long or contains a NUL byte.
    #[error("kernel command line is invalid: {0}")]
    Cmdline(String),
    /// Too many disks.
    #[error("at most {MAX_VIRTIO_DEVICES} virtio devices are supported, got {0}")]
    TooManyDevices(usize),
    /// Two disks share an id.
    #[error("duplicate disk id {0:?}")]
    DuplicateDiskId(String),
    /// A disk id is longer than virtio-blk's 20-byte id field.
    #[error("disk id {0:?} is longer than 20 bytes")]
    DiskIdTooLong(String),
    /// A disk's `io_threads` is zero or above [`MAX_IO_THREADS`].
    #[error("disk {path:?}: io_threads must be between 1 and {MAX_IO_THREADS}, got {got}")]
    IoThreads {
        /// The disk's path.
        path: PathBuf,
        /// The value given.
        got: u16,
    },
    /// A disk's `queues` is zero or above the device's maximum.
    #[error("disk {path:?}: queues must be between 1 and 16, got {got}")]
    Queues {
        /// The disk's path.
        path: PathBuf,
        /// The value given.
        got: u16,
    },
    /// `io_threads` set for an engine that does not use threads.
    #[error("disk {0:?}: io_threads only applies to io_engine \"threads\" or \"auto\"")]
    IoThreadsUnused(PathBuf),
    /// A network card's settings are invalid.
    #[error("network card {index}: {message}")]
    Net {
        /// Position in `nets`.
        index: usize,
        /// What is wrong.
        message: String,
    },
    /// The serial ring buffer capacity is zero or above 64 MiB.
    #[error("serial ring capacity must be between 1 byte and 64 MiB, got {0}")]
    SerialRing(usize),
}

/// How guest RAM is backed on the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryBacking {
    /// Private anonymous memory (the default).
    #[default]
    Anonymous,
    /// A memfd, shareable with out-of-process device backends (vhost-user).
    Memfd,
}

/// Guest memory settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// Guest RAM in MiB.
    pub size_mib: u64,
    /// Host backing of guest RAM.
    #[serde(default)]
    pub backing: MemoryBacking,
    /// Ask KVM to log dirty pages (for live migration); see
    /// [`crate::Vm::dirty_pages`].
    #[serde(default)]
    pub track_dirty_pages: bool,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            size_mib: 128,
            backing: MemoryBacking::Anonymous,
            track_dirty_pages: false,
        }
    }
}

/// Which boot protocol to enter the kernel with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BootProtocol {
    /// Linux 64-bit boot protocol: the vCPU starts in long mode at the ELF
    /// entry (or bzImage `code32_start + 0x200`) with `boot_params` in RSI.
    #[default]
    Linux64,
    /// Xen PVH: the vCPU starts in 32-bit protected mode at the ELF's PVH
    /// note entry with an `hvm_start_info` in EBX. ELF images only.
    Pvh,
}

/// Kernel and boot settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelConfig {
    /// Kernel image: an ELF (vmlinux, probe guest) or a bzImage. Empty with
    /// [`KernelConfig::from_disk`].
    #[serde(default)]
    pub path: PathBuf,
    /// Optional initramfs.
    #[serde(default)]
    pub initramfs: Option<PathBuf>,
    /// Kernel command line.
    #[serde(default)]
    pub cmdline: String,
    /// Boot protocol.
    #[serde(default)]
    pub boot_protocol: BootProtocol,
    /// Also describe each virtio-mmio device on the command line as
    /// `virtio_mmio.device=<size>@<base>:<irq>` (for kernels built with
    /// `VIRTIO_MMIO_CMDLINE_DEVICES` and for the probe guest). Devices are
    /// always described in the ACPI DSDT as well.
    #[serde(default)]
    pub cmdline_virtio_devices: bool,
    /// Boot the kernel and initramfs found inside a disk instead of host
    /// files (`path` and `initramfs` stay empty); `root=UUID=` of the root
    /// file system is put first on the command line unless it names a root.
    #[serde(default)]
    pub from_disk: Option<DiskBoot>,
}

/// Which disk (and partition) [`KernelConfig::from_disk`] boots.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskBoot {
    /// Index among the VM's disks: `disks` first, then the backends
    /// attached at run time, in order. Default 0 (`/dev/vda`).
    #[serde(default)]
    pub disk: usize,
    /// Partition number (1-based) holding the kernel; default: the first
    /// ext4 partition that has one.
    #[serde(default)]
    pub partition: Option<u32>,
}

/// Most worker threads one disk may have with [`IoEngine::Threads`].
pub const MAX_IO_THREADS: u16 = 64;
/// Worker threads per disk with [`IoEngine::Threads`] when not configured.
pub const DEFAULT_IO_THREADS: u16 = 4;

/// How a file-backed disk performs its I/O.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoEngine {
    /// io_uring when the host kernel allows it, else `threads` (with a
    /// warning in the log).
    #[default]
    Auto,
    /// Inline on the VM's device thread, one request at a time.
    Sync,
    /// A pool of worker threads doing blocking positional I/O.
    Threads,
    /// io_uring (O_DIRECT when the file system allows it); fails to start
    /// the VM when the kernel refuses io_uring.
    IoUring,
}

/// A virtio-blk disk backed by a host file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    /// Path of a raw image file or block device.
    pub path: PathBuf,
    /// Expose the disk read-only (`VIRTIO_BLK_F_RO`).
    #[serde(default)]
    pub read_only: bool,
    /// Device id reported by `VIRTIO_BLK_T_GET_ID` (at most 20 bytes);
    /// defaults to the file name.
    #[serde(default)]
    pub id: Option<String>,
    /// I/O engine.
    #[serde(default)]
    pub io_engine: IoEngine,
    /// Worker threads for [`IoEngine::Threads`] (and the `auto` fallback);
    /// default [`DEFAULT_IO_THREADS`].
    #[serde(default)]
    pub io_threads: Option<u16>,
    /// virtio-blk request queues (`VIRTIO_BLK_F_MQ` when above 1), 1..=16;
    /// default 1.
    #[serde(default)]
    pub queues: Option<u16>,
}

/// A virtio-net card on a Linux tap interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// Tap interface name (at most 15 bytes). An existing tap of that name
    /// is attached (create it with `ip tuntap add NAME mode tap vnet_hdr`),
    /// otherwise one is created in the network namespace of the thread
    /// that creates the VM, and removed with it.
    pub tap: String,
    /// MAC address (`02:00:00:00:00:01`); default: a locally administered
    /// address derived from the VM name and the card's position.
    #[serde(default)]
    pub mac: Option<String>,
}

/// Where the guest's serial console output (COM1) goes. Output is also
/// always kept in an in-memory ring readable through
/// [`crate::Vm::console`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum SerialConfig {
    /// Only the in-memory ring.
    #[default]
    Ring,
    /// The VMM process's stdout.
    Stdout,
    /// Append to a file.
    File {
        /// File path (created if missing).
        path: PathBuf,
    },
}

/// The complete description of a VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// Name used in thread names and logs.
    #[serde(default = "default_name")]
    pub name: String,
    /// Number of vCPUs.
    pub vcpus: u8,
    /// Guest memory.
    #[serde(default)]
    pub memory: MemoryConfig,
    /// Kernel, initramfs, command line.
    pub kernel: KernelConfig,
    /// File-backed virtio-blk disks, in order (`/dev/vda`, `/dev/vdb`, ...).
    #[serde(default)]
    pub disks: Vec<DiskConfig>,
    /// virtio-net cards on tap interfaces, after the disks on the
    /// virtio-mmio bus (`eth0`, `eth1`, ... in a Linux guest).
    #[serde(default)]
    pub nets: Vec<NetConfig>,
    /// Serial console sink.
    #[serde(default)]
    pub serial: SerialConfig,
    /// Capacity of the in-memory console ring in bytes.
    #[serde(default = "default_ring")]
    pub serial_ring_bytes: usize,
}

fn default_name() -> String {
    "sheaf-vm".to_string()
}

fn default_ring() -> usize {
    64 * 1024
}

impl VmConfig {
    /// Starts a builder with defaults: 1 vCPU, 128 MiB, console to the ring.
    pub fn builder() -> VmConfigBuilder {
        VmConfigBuilder {
            cfg: VmConfig {
                name: default_name(),
                vcpus: 1,
                memory: MemoryConfig::default(),
                kernel: KernelConfig::default(),
                disks: Vec::new(),
                nets: Vec::new(),
                serial: SerialConfig::default(),
                serial_ring_bytes: default_ring(),
            },
        }
    }

    /// Checks every field; `extra_devices` counts block backends attached at
    /// run time on top of `disks`.
    pub fn validate(&self, extra_devices: usize) -> Result<(), ConfigError> {
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(ConfigError::Vcpus(self.vcpus));
        }
        if self.memory.size_mib < MIN_MEMORY_MIB || self.memory.size_mib > 1 << 20 {
            return Err(ConfigError::MemorySize(self.memory.size_mib));
        }
        let ndev = self.disks.len() + self.nets.len() + extra_devices;
        match &self.kernel.from_disk {
            None if self.kernel.path.as_os_str().is_empty() => {
                return Err(ConfigError::MissingKernel);
            }
            None => {}
            Some(_) if !self.kernel.path.as_os_str().is_empty() => {
                return Err(ConfigError::BootSource(
                    "kernel.path and kernel.from_disk are exclusive".into(),
                ));
            }
            Some(_) if self.kernel.initramfs.is_some() => {
                return Err(ConfigError::BootSource(
                    "kernel.initramfs cannot be set with kernel.from_disk (the initramfs comes from the disk)".into(),
                ));
            }
            Some(DiskBoot {
                partition: Some(0), ..
            }) => {
                return Err(ConfigError::BootSource(
                    "kernel.from_disk.partition counts from 1".into(),
                ));
            }
            Some(_) => {}
        }
        if self.kernel.cmdline.len() >= MAX_CMDLINE_LEN / 2 {
            return Err(ConfigError::Cmdline(format!(
                "{} bytes, at most {} allowed",
                self.kernel.cmdline.len(),
                MAX_CMDLINE_LEN / 2 - 1
            )));
        }
        if self.kernel.cmdline.contains('\0') {
            return Err(ConfigError::Cmdline("contains a NUL byte".into()));
        }
        if ndev > MAX_VIRTIO_DEVICES {
            return Err(ConfigError::TooManyDevices(ndev));
        }
        let mut ids = std::collections::HashSet::new();
        for d in &self.disks {
            if let Some(id) = &d.id {
                if id.len() > 20 {
                    return Err(ConfigError::DiskIdTooLong(id.clone()));
                }
                if !ids.insert(id.clone()) {
                    return Err(ConfigError::DuplicateDiskId(id.clone()));
                }
            }
            if let Some(n) = d.queues
                && !(1..=16).contains(&n)
            {
                return Err(ConfigError::Queues {
                    path: d.path.clone(),
                    got: n,
                });
            }
            if let Some(n) = d.io_threads {
                if !matches!(d.io_engine, IoEngine::Threads | IoEngine::Auto) {
                    return Err(ConfigError::IoThreadsUnused(d.path.clone()));
                }
                if n == 0 || n > MAX_IO_THREADS {
                    return Err(ConfigError::IoThreads {
                        path: d.path.clone(),
                        got: n,
                    });
                }
            }
        }
        let mut taps = std::collections::HashSet::new();
        let mut macs = std::collections::HashSet::new();
        for (index, n) in self.nets.iter().enumerate() {
            let err = |message: String| ConfigError::Net { index, message };
            crate::devices::virtio::net::check_tap_name(&n.tap).map_err(err)?;
            if !taps.insert(n.tap.as_str()) {
                return Err(err(format!("tap {:?} is used by two cards", n.tap)));
            }
            if let Some(m) = &n.mac {
                let mac = crate::devices::virtio::net::MacAddr::parse(m).map_err(err)?;
                if !macs.insert(mac) {
                    return Err(err(format!("MAC address {m} is used by two cards")));
                }
            }
        }
        if self.serial_ring_bytes == 0 || self.serial_ring_bytes > 64 << 20 {
            return Err(ConfigError::SerialRing(self.serial_ring_bytes));
        }
        Ok(())
    }
}

/// Builder for [`VmConfig`]; [`VmConfigBuilder::build`] validates.
#[derive(Debug, Clone)]
pub struct VmConfigBuilder {
    cfg: VmConfig,
}

impl VmConfigBuilder {
    /// VM name.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.cfg.name = name.into();
        self
    }
    /// Number of vCPUs.
    pub fn vcpus(mut self, n: u8) -> Self {
        self.cfg.vcpus = n;
        self
    }
    /// Guest RAM in MiB.
    pub fn memory_mib(mut self, mib: u64) -> Self {
        self.cfg.memory.size_mib = mib;
        self
    }
    /// Guest RAM backing.
    pub fn memory_backing(mut self, backing: MemoryBacking) -> Self {
        self.cfg.memory.backing = backing;
        self
    }
    /// Enable KVM dirty-page logging.
    pub fn track_dirty_pages(mut self, on: bool) -> Self {
        self.cfg.memory.track_dirty_pages = on;
        self
    }
    /// Kernel image path.
    pub fn kernel(mut self, path: impl Into<PathBuf>) -> Self {
        self.cfg.kernel.path = path.into();
        self
    }

    /// Boots the kernel and initramfs found on disk `disk` (see
    /// [`KernelConfig::from_disk`]).
    pub fn boot_from_disk(mut self, disk: usize, partition: Option<u32>) -> Self {
        self.cfg.kernel.from_disk = Some(DiskBoot { disk, partition });
        self
    }

    /// Initramfs path.
    pub fn initramfs(mut self, path: impl Into<PathBuf>) -> Self {
        self.cfg.kernel.initramfs = Some(path.into());
        self
    }
    /// Kernel command line.
    pub fn cmdline(mut self, cmdline: impl Into<String>) -> Self {
        self.cfg.kernel.cmdline = cmdline.into();
        self
    }
    /// Boot protocol.
    pub fn boot_protocol(mut self, p: BootProtocol) -> Self {
        self.cfg.kernel.boot_protocol = p;
        self
    }
    /// Describe virtio-mmio devices on the command line too.
    pub fn cmdline_virtio_devices(mut self, on: bool) -> Self {
        self.cfg.kernel.cmdline_virtio_devices = on;
        self
    }
    /// Add a writable file-backed disk.
    pub fn disk(mut self, path: impl Into<PathBuf>) -> Self {
        self.cfg.disks.push(DiskConfig {
            path: path.into(),
            read_only: false,
            id: None,
            io_engine: IoEngine::default(),
            io_threads: None,
            queues: None,
        });
        self
    }
    /// Add a disk with full settings.
    pub fn disk_config(mut self, disk: DiskConfig) -> Self {
        self.cfg.disks.push(disk);
        self
    }
    /// Add a virtio-net card on tap `tap` (MAC derived from the VM name).
    pub fn net_tap(mut self, tap: impl Into<String>) -> Self {
        self.cfg.nets.push(NetConfig {
            tap: tap.into(),
            mac: None,
        });
        self
    }
    /// Add a virtio-net card with full settings.
    pub fn net_config(mut self, net: NetConfig) -> Self {
        self.cfg.nets.push(net);
        self
    }
    /// Serial console sink.
    pub fn serial(mut self, s: SerialConfig) -> Self {
        self.cfg.serial = s;
        self
    }
    /// Console ring capacity in bytes.
    pub fn serial_ring_bytes(mut self, n: usize) -> Self {
        self.cfg.serial_ring_bytes = n;
        self
    }
    /// Validates and returns the config.
    pub fn build(self) -> Result<VmConfig, ConfigError> {
        self.cfg.validate(0)?;
        Ok(self.cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> VmConfigBuilder {
        VmConfig::builder().kernel("k")
    }

    #[test]
    fn rejects_bad_values() {
        assert_eq!(base().vcpus(0).build(), Err(ConfigError::Vcpus(0)));
        assert_eq!(base().vcpus(255).build(), Err(ConfigError::Vcpus(255)));
        assert_eq!(
            base().memory_mib(1).build(),
            Err(ConfigError::MemorySize(1))
        );
        assert_eq!(VmConfig::builder().build(), Err(ConfigError::MissingKernel));
        assert!(matches!(
            base().cmdline("a\0b").build(),
            Err(ConfigError::Cmdline(_))
        ));
        let d = DiskConfig {
            path: "x".into(),
            read_only: false,
            id: Some("same".into()),
            io_engine: IoEngine::Auto,
            io_threads: None,
            queues: None,
        };
        assert_eq!(
            base().disk_config(d.clone()).disk_config(d).build(),
            Err(ConfigError::DuplicateDiskId("same".into()))
        );
        let mut b = base();
        for _ in 0..17 {
            b = b.disk("d");
        }
        assert_eq!(b.build(), Err(ConfigError::TooManyDevices(17)));
        let disk = |io_engine, io_threads| DiskConfig {
            path: "p".into(),
            read_only: false,
            id: None,
            io_engine,
            io_threads,
            queues: None,
        };
        assert_eq!(
            base().disk_config(disk(IoEngine::Threads, Some(0))).build(),
            Err(ConfigError::IoThreads {
                path: "p".into(),
                got: 0
            })
        );
        assert_eq!(
            base()
                .disk_config(disk(IoEngine::Threads, Some(65)))
                .build(),
            Err(ConfigError::IoThreads {
                path: "p".into(),
                got: 65
            })
        );
        assert_eq!(
            base().disk_config(disk(IoEngine::IoUring, Some(2))).build(),
            Err(ConfigError::IoThreadsUnused("p".into()))
        );
        let mut q = disk(IoEngine::Auto, None);
        q.queues = Some(17);
        assert_eq!(
            base().disk_config(q.clone()).build(),
            Err(ConfigError::Queues {
                path: "p".into(),
                got: 17
            })
        );
        q.queues = Some(0);
        assert!(base().disk_config(q.clone()).build().is_err());
        q.queues = Some(16);
        assert!(base().disk_config(q).build().is_ok());
        assert!(
            base()
                .disk_config(disk(IoEngine::Threads, Some(64)))
                .build()
                .is_ok()
        );
    }

    #[test]
    fn disk_io_engine_parses_and_defaults_to_auto() {
        let old: DiskConfig = serde_json::from_str(r#"{"path":"/d"}"#).unwrap();
        assert_eq!(old.io_engine, IoEngine::Auto);
        assert_eq!(old.io_threads, None);
        let d: DiskConfig =
            serde_json::from_str(r#"{"path":"/d","io_engine":"io_uring"}"#).unwrap();
        assert_eq!(d.io_engine, IoEngine::IoUring);
        let d: DiskConfig =
            serde_json::from_str(r#"{"path":"/d","io_engine":"threads","io_threads":8}"#).unwrap();
        assert_eq!((d.io_engine, d.io_threads), (IoEngine::Threads, Some(8)));
        let err = serde_json::from_str::<DiskConfig>(r#"{"path":"/d","io_engine":"aio"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown variant `aio`"), "{err}");
    }

    #[test]
    fn parses_minimal_json_with_defaults() {
        let cfg: VmConfig = serde_json::from_str(r#"{"vcpus":1,"kernel":{"path":"/k"}}"#).unwrap();
        assert_eq!(cfg.memory.size_mib, 128);
        assert_eq!(cfg.serial, SerialConfig::Ring);
        assert_eq!(cfg.kernel.boot_protocol, BootProtocol::Linux64);
        assert!(
            serde_json::from_str::<VmConfig>(r#"{"vcpus":1,"kernel":{"path":"/k"},"bogus":1}"#)
                .is_err()
        );
    }

    #[test]
    fn net_cards_are_checked() {
        let net = |tap: &str, mac: Option<&str>| NetConfig {
            tap: tap.into(),
            mac: mac.map(str::to_string),
        };
        assert!(base().net_tap("tap0").build().is_ok());
        for (cfg, want) in [
            (base().net_tap(""), "empty"),
            (base().net_tap("a/../b"), "may not contain"),
            (base().net_tap("sixteen-chars-xx"), "at most 15"),
            (base().net_tap("t0").net_tap("t0"), "used by two cards"),
            (
                base().net_config(net("t0", Some("01:00:00:00:00:01"))),
                "multicast",
            ),
            (
                base().net_config(net("t0", Some("zz:00:00:00:00:01"))),
                "not hex",
            ),
            (
                base().net_config(net("t0", Some("02:00:00:00:01"))),
                "six hex bytes",
            ),
            (
                base()
                    .net_config(net("t0", Some("02:00:00:00:00:01")))
                    .net_config(net("t1", Some("02-00-00-00-00-01"))),
                "used by two cards",
            ),
        ] {
            let err = cfg.build().unwrap_err().to_string();
            assert!(
                err.contains(want) && err.starts_with("network card"),
                "{err}"
            );
        }
        let mut b = base();
        for i in 0..MAX_VIRTIO_DEVICES {
            b = b.net_tap(format!("t{i}"));
        }
        assert!(b.clone().build().is_ok());
        assert_eq!(
            b.disk("d").build(),
            Err(ConfigError::TooManyDevices(MAX_VIRTIO_DEVICES + 1))
        );
        let cfg: VmConfig =
            serde_json::from_str(r#"{"vcpus":1,"kernel":{"path":"/k"},"nets":[{"tap":"t0"}]}"#)
                .unwrap();
        assert_eq!(cfg.nets, vec![net("t0", None)]);
    }
}
