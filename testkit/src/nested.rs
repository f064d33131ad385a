// SPDX-License-Identifier: Apache-2.0
//! The nested-KVM box: runs one statically linked program with a real
//! `/dev/kvm`, on machines whose own KVM cannot boot a stock Linux guest.
//!
//! ```text
//!  host ── qemu-system-x86_64 -accel tcg -cpu qemu64,+svm,+npt (pc machine)
//!           │ -kernel /boot/vmlinuz-*-cloud-amd64  -initrd l1 (busybox, cached)
//!           │ /dev/vda  in.tar   (read-only): program, files, run script
//!           │ /dev/vdb  out.img  (sparse):    tar of outputs, written at the end
//!           └─ L1 /init: insmod virtio…, irqbypass, kvm, kvm_amd → /dev/kvm
//!                        tar -x /dev/vda into /box; cd /box; ./program args
//!                        tar -c /dev/vdb .sheaf-out out <collected files>
//!                        poweroff -f
//! ```
//!
//! Each console marker carries a per-run nonce (`SHEAF-BOX-<nonce>: RUN`,
//! `… END status=<n>`), so nothing the program prints can be mistaken for
//! one. The program runs in `/box` with its files next to it, stdin from
//! `/dev/null`, `SHEAF_BOX=1` and `SHEAF_OUT=/box/out`; everything it writes
//! under `$SHEAF_OUT`, plus the files named with [`NestedBox::collect`],
//! comes back in [`NestedOutput`].
//!
//! ```no_run
//! use std::time::Duration;
//! use sheaf_testkit::{nested::NestedBox, static_build};
//!
//! # fn main() -> sheaf_testkit::Result<()> {
//! let probe = static_build::build_example("sheaf-testkit", "kvm_probe")?;
//! let out = NestedBox::new().timeout(Duration::from_secs(120)).run(&probe, ["--verbose"])?;
//! assert!(out.success(), "{}", out.output);
//! println!("program started {:?} after QEMU", out.timings.program_start);
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tempfile::TempDir;
use tracing::{debug, info};

use crate::cpio::Initramfs;
use crate::error::{Result, TestkitError, io_err};
use crate::guest::SCRIPT_LIB;
use crate::image::{BuiltImage, assemble, build_cached};
use crate::kernel::HostKernel;
use crate::qemu::{ConsoleLine, LineAction, Qemu};
use crate::tail;

/// Modules the L1 init loads, in this order.
pub const L1_MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "virtio_blk",
    "irqbypass",
    "kvm",
    "kvm_amd",
    "tun",
];

/// The CPU QEMU emulates for L1: AMD SVM with nested paging.
pub const L1_CPU: &str = "qemu64,+svm,+npt";

const BOX_MAIN: &str = include_str!("scripts/box-main.sh");

/// How many console lines go into error messages.
const TAIL_LINES: usize = 40;

/// Builds (or reuses) the box's L1 kernel + initramfs.
fn l1_image(kernel: &HostKernel, cache: &Path) -> Result<BuiltImage> {
    let mut extra = Initramfs::new();
    extra
        .file("etc/sheaf/main", BOX_MAIN.as_bytes().to_vec(), 0o644)
        .file("etc/sheaf/lib.sh", SCRIPT_LIB.as_bytes().to_vec(), 0o644)
        .dir("box");
    let modules: Vec<String> = L1_MODULES.iter().map(|m| m.to_string()).collect();
    let fs = assemble(kernel, &modules, &extra)?;
    build_cached(cache, "nested", kernel, &fs)
}

#[derive(Clone)]
enum Source {
    Path(PathBuf),
    Bytes(Vec<u8>, u32),
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Path(p) => write!(f, "{}", p.display()),
            Source::Bytes(b, mode) => write!(f, "<{} bytes, mode {mode:o}>", b.len()),
        }
    }
}

/// A phase of a box run, reported to [`NestedBox::run_with_events`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BoxPhase {
    /// QEMU was started.
    Started,
    /// The L1 init is running.
    L1Init,
    /// `/dev/kvm` is up in L1.
    KvmReady,
    /// The program started.
    ProgramStarted,
    /// The program exited with this status.
    ProgramExited(i32),
    /// The output files were written to the output disk.
    FilesOut,
}

/// Something that happened during a box run.
#[derive(Debug, Clone, Copy)]
pub enum BoxEvent<'a> {
    /// A phase began, `at` this long after QEMU started.
    Phase {
        /// The phase.
        phase: BoxPhase,
        /// Time since QEMU started.
        at: Duration,
    },
    /// A line on L1's serial console (markers included).
    Console(&'a ConsoleLine),
}

/// Where the time went, measured on the host from QEMU's start.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BoxTimings {
    /// L1's `/init` started.
    pub l1_init: Option<Duration>,
    /// `/dev/kvm` was available in L1.
    pub kvm_ready: Option<Duration>,
    /// The program started.
    pub program_start: Duration,
    /// The program exited.
    pub program_end: Duration,
    /// QEMU exited.
    pub total: Duration,
    /// L1's own uptime (seconds) when the program started.
    pub l1_uptime_at_start: Option<f64>,
}

impl BoxTimings {
    /// How long the program ran.
    pub fn program_runtime(&self) -> Duration {
        self.program_end.saturating_sub(self.program_start)
    }
}

/// What a box run produced.
#[derive(Debug)]
pub struct NestedOutput {
    /// The program's exit status (128 + n if killed by signal n).
    pub exit_status: i32,
    /// The program's stdout and stderr, interleaved as written.
    pub output: String,
    /// L1's whole serial console.
    pub console: String,
    /// Timings.
    pub timings: BoxTimings,
    files: TempDir,
}

impl NestedOutput {
    /// Whether the program exited with status 0.
    pub fn success(&self) -> bool {
        self.exit_status == 0
    }

    /// A file that came back from the box: a collected name (e.g.
    /// `disk.img`) or `out/<name>` for files the program wrote to
    /// `$SHEAF_OUT`. `None` if it did not come back.
    pub fn file(&self, name: &str) -> Option<PathBuf> {
        check_name(name).ok()?;
        let p = self.files.path().join(name);
        p.is_file().then_some(p)
    }

    /// Reads a file that came back from the box.
    pub fn read_file(&self, name: &str) -> Result<Vec<u8>> {
        let p = self.files.path().join(name);
        check_name(name)?;
        fs::read(&p).map_err(io_err("read box output file", p))
    }

    /// The host directory holding the files that came back (deleted when
    /// this value drops).
    pub fn files_dir(&self) -> &Path {
        self.files.path()
    }
}

/// The box (builder). See the [module docs](self).
#[derive(Debug, Clone)]
pub struct NestedBox {
    files: Vec<(String, Source)>,
    collect: Vec<String>,
    env: Vec<(String, String)>,
    memory_mib: u32,
    timeout: std::time::Duration,
    output_capacity_mib: Option<u64>,
    require_kvm: bool,
    host_qemu: bool,
    kernel: Option<HostKernel>,
    cache: Option<PathBuf>,
    disks: Vec<PathBuf>,
}

impl Default for NestedBox {
    fn default() -> Self {
        Self::new()
    }
}

/// Checks a name for a file in `/box`: relative, no `..`, a safe charset.
fn check_name(name: &str) -> Result<()> {
    let bad = |why| {
        Err(TestkitError::InvalidName {
            name: name.into(),
            why,
        })
    };
    if name.is_empty() || name.len() > 90 {
        return bad("must be 1 to 90 characters");
    }
    if name.starts_with('/') || name.starts_with('-') || name.starts_with('.') {
        return bad("must be relative and not start with '-' or '.'");
    }
    if name
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return bad("no empty, '.' or '..' components");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/' | '+'))
    {
        return bad("only ASCII letters, digits and . _ - + /");
    }
    Ok(())
}

/// Quotes a string for `sh`.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn nonce() -> String {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{:x}{:x}", t & 0xffff_ffff_ffff, std::process::id())
}

impl NestedBox {
    /// A box with 2048 MiB of L1 memory and a 300 s timeout that requires
    /// `/dev/kvm` in L1.
    pub fn new() -> Self {
        Self {
            files: Vec::new(),
            collect: Vec::new(),
            env: Vec::new(),
            memory_mib: 2048,
            timeout: Duration::from_secs(300),
            output_capacity_mib: None,
            require_kvm: true,
            host_qemu: false,
            kernel: None,
            cache: None,
            disks: Vec::new(),
        }
    }

    /// Puts the host file `path` at `/box/<name>` (next to the program).
    pub fn file(mut self, name: &str, path: impl AsRef<Path>) -> Self {
        self.files
            .push((name.into(), Source::Path(path.as_ref().to_path_buf())));
        self
    }

    /// Puts `data` at `/box/<name>` with permission bits `mode`.
    pub fn file_bytes(mut self, name: &str, data: impl Into<Vec<u8>>, mode: u32) -> Self {
        self.files
            .push((name.into(), Source::Bytes(data.into(), mode)));
        self
    }

    /// Copies `/box/<name>` back out after the program exits (for example a
    /// disk image the L2 guest wrote). Files under `/box/out` always come back.
    pub fn collect(mut self, name: &str) -> Self {
        self.collect.push(name.into());
        self
    }

    /// Sets an environment variable for the program.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// L1 memory in MiB (QEMU allocates it lazily). Files live in L1's RAM.
    pub fn memory_mib(mut self, mib: u32) -> Self {
        self.memory_mib = mib;
        self
    }

    /// The deadline for the whole run, boot included. QEMU is killed after it.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Room on the output disk (default: the inputs' size + 256 MiB; sparse).
    pub fn output_capacity_mib(mut self, mib: u64) -> Self {
        self.output_capacity_mib = Some(mib);
        self
    }

    /// Whether a missing `/dev/kvm` in L1 fails the run (default true).
    pub fn require_kvm(mut self, require: bool) -> Self {
        self.require_kvm = require;
        self
    }

    /// Also puts the host's QEMU in the box as `qemu/qemu-system-x86_64` (a
    /// wrapper that runs the dynamically linked binary with its own copies of
    /// the loader, libraries and firmware), so a program or script can boot a
    /// reference guest with `-accel kvm` next to ours. Adds about 60 MB.
    pub fn host_qemu(mut self) -> Self {
        self.host_qemu = true;
        self
    }

    /// Attaches the raw host image `path` to L1 as a virtio disk, without
    /// copying it into the box: the first such disk is L1's `/dev/vdc`, the
    /// next `/dev/vdd`, and so on. QEMU opens it with `snapshot=on`, so what
    /// the box writes goes to a temporary overlay and the host file (a cached
    /// guest image, say) is never modified.
    pub fn disk(mut self, path: impl AsRef<Path>) -> Self {
        self.disks.push(path.as_ref().to_path_buf());
        self
    }

    /// Uses this kernel for L1 instead of [`HostKernel::find`].
    pub fn kernel(mut self, kernel: HostKernel) -> Self {
        self.kernel = Some(kernel);
        self
    }

    /// Uses this cache directory instead of [`crate::cache_dir`].
    pub fn cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache = Some(dir.into());
        self
    }

    /// Runs `program` (a static executable) with `args` in the box.
    pub fn run<I, S>(&self, program: impl AsRef<Path>, args: I) -> Result<NestedOutput>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.run_with_events(program, args, &mut |_| {})
    }

    /// Like [`NestedBox::run`], reporting phases and console lines to `on_event`.
    pub fn run_with_events<I, S>(
        &self,
        program: impl AsRef<Path>,
        args: I,
        on_event: &mut dyn FnMut(BoxEvent<'_>),
    ) -> Result<NestedOutput>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let program = program.as_ref();
        let args: Vec<String> = args.into_iter().map(|a| a.as_ref().to_string()).collect();
        let prog_name = program
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        check_name(&prog_name)?;
        for (name, _) in &self.files {
            check_name(name)?;
            if *name == prog_name {
                return Err(TestkitError::InvalidName {
                    name: name.clone(),
                    why: "same name as the program",
                });
            }
        }
        for name in &self.collect {
            check_name(name)?;
        }
        for (key, _) in &self.env {
            let ok = !key.is_empty()
                && !key.starts_with(|c: char| c.is_ascii_digit())
                && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ok {
                return Err(TestkitError::InvalidName {
                    name: key.clone(),
                    why: "not a valid environment variable name",
                });
            }
        }

        let kernel = match &self.kernel {
            Some(k) => k.clone(),
            None => HostKernel::find()?,
        };
        let cache = self.cache.clone().unwrap_or_else(crate::cache_dir);
        let l1 = l1_image(&kernel, &cache)?;

        let work = tempfile::Builder::new()
            .prefix("sheaf-box-")
            .tempdir()
            .map_err(io_err("create temp dir in", std::env::temp_dir()))?;
        let in_tar = work.path().join("in.tar");
        let mut inputs = self.clone();
        if self.host_qemu {
            inputs.files.extend(host_qemu_files()?);
        }
        let input_bytes = inputs.write_inputs(&in_tar, program, &prog_name, &args)?;
        let out_img = work.path().join("out.img");
        let capacity = self
            .output_capacity_mib
            .unwrap_or(input_bytes.div_ceil(1 << 20) + 256);
        File::create(&out_img)
            .and_then(|f| f.set_len(capacity << 20))
            .map_err(io_err("create output disk", &out_img))?;

        let nonce = nonce();
        let prefix = format!("SHEAF-BOX-{nonce}:");
        let mut cmdline = format!("console=ttyS0 quiet panic=-1 sheaf.nonce={nonce}");
        if self.require_kvm {
            cmdline.push_str(" sheaf.kvm=required");
        }
        let mut qemu = Qemu::tcg()
            .cpu(L1_CPU)
            .memory_mib(self.memory_mib)
            .kernel(&l1.kernel)
            .initrd(&l1.initramfs)
            .append(&cmdline)
            .disk_readonly(&in_tar)
            .disk(&out_img)
            .timeout(self.timeout);
        for (i, d) in self.disks.iter().enumerate() {
            let mut drive = std::ffi::OsString::from("file=");
            drive.push(d.as_os_str());
            drive.push(format!(",format=raw,if=none,id=box{i},snapshot=on"));
            qemu = qemu
                .arg("-drive")
                .arg(drive)
                .arg("-device")
                .arg(format!("virtio-blk-pci,drive=box{i}"));
        }

        info!(program = %program.display(), ?args, "running in the nested-KVM box");
        on_event(BoxEvent::Phase {
            phase: BoxPhase::Started,
            at: Duration::ZERO,
        });
        let mut timings = BoxTimings::default();
        let mut start_seen = None;
        let mut end_seen = None;
        let mut files_out = false;
        let mut failure = None;
        let result = qemu.run_with(&mut |line| {
            on_event(BoxEvent::Console(line));
            let Some(i) = line.text.find(&prefix) else {
                return LineAction::Continue;
            };
            let rest = line.text[i + prefix.len()..].trim();
            let word = rest.split_whitespace().next().unwrap_or("");
            let phase = match word {
                "INIT" => {
                    timings.l1_init = Some(line.at);
                    Some(BoxPhase::L1Init)
                }
                "KVM" => {
                    timings.kvm_ready = Some(line.at);
                    Some(BoxPhase::KvmReady)
                }
                "RUN" => {
                    start_seen = Some(line.at);
                    timings.l1_uptime_at_start = field(rest, "uptime").and_then(|u| u.parse().ok());
                    Some(BoxPhase::ProgramStarted)
                }
                "END" => {
                    let status = field(rest, "status")
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(-1);
                    end_seen = Some((line.at, status));
                    Some(BoxPhase::ProgramExited(status))
                }
                "FILES-OUT" => {
                    files_out = true;
                    Some(BoxPhase::FilesOut)
                }
                "FAIL" => {
                    failure = Some(rest.trim_start_matches("FAIL").trim().to_string());
                    None
                }
                _ => None,
            };
            if let Some(phase) = phase {
                debug!(?phase, at = ?line.at, "box phase");
                on_event(BoxEvent::Phase { phase, at: line.at });
            }
            LineAction::Continue
        });
        let out = match result {
            Ok(out) => out,
            Err(TestkitError::Timeout {
                after,
                console_tail,
                ..
            }) => {
                return Err(TestkitError::Timeout {
                    what: match (start_seen, end_seen) {
                        (None, _) => "nested-KVM box (before the program started)",
                        (Some(_), None) => "nested-KVM box (program running)",
                        (Some(_), Some(_)) => "nested-KVM box (collecting output files)",
                    },
                    after,
                    console_tail,
                });
            }
            Err(e) => return Err(e),
        };
        let console = out.console_text();
        timings.total = out.elapsed;
        let box_failed = |reason: String| TestkitError::BoxFailed {
            reason,
            console_tail: tail(&console, TAIL_LINES),
        };
        if let Some(reason) = failure {
            return Err(box_failed(reason));
        }
        let Some(program_start) = start_seen else {
            return Err(box_failed("the program never started".into()));
        };
        let Some((program_end, exit_status)) = end_seen else {
            return Err(box_failed(
                "the program did not finish (L1 crashed?)".into(),
            ));
        };
        timings.program_start = program_start;
        timings.program_end = program_end;

        let files = tempfile::Builder::new()
            .prefix("sheaf-box-out-")
            .tempdir()
            .map_err(io_err("create temp dir in", std::env::temp_dir()))?;
        if files_out {
            let f = File::open(&out_img).map_err(io_err("open output disk", &out_img))?;
            tar::Archive::new(f)
                .unpack(files.path())
                .map_err(TestkitError::FilesOut)?;
        } else {
            return Err(box_failed("L1 did not write the output files".into()));
        }
        let output = match fs::read(files.path().join(".sheaf-out/output")) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(_) => console_section(&console, &prefix),
        };
        info!(exit_status, ?timings, "nested-KVM box finished");
        Ok(NestedOutput {
            exit_status,
            output,
            console,
            timings,
            files,
        })
    }

    /// Writes the input tar; returns its size.
    fn write_inputs(
        &self,
        in_tar: &Path,
        program: &Path,
        prog_name: &str,
        args: &[String],
    ) -> Result<u64> {
        let f = File::create(in_tar).map_err(io_err("create", in_tar))?;
        let mut b = tar::Builder::new(f);
        b.mode(tar::HeaderMode::Deterministic);
        let add_bytes = |b: &mut tar::Builder<File>, name: &str, data: &[u8], mode: u32| {
            let mut h = tar::Header::new_ustar();
            h.set_size(data.len() as u64);
            h.set_mode(mode);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, name, data)
                .map_err(io_err("write input archive", in_tar))
        };
        let add_dir = |b: &mut tar::Builder<File>, name: &str| {
            let mut h = tar::Header::new_ustar();
            h.set_size(0);
            h.set_mode(0o755);
            h.set_entry_type(tar::EntryType::Directory);
            b.append_data(&mut h, name, &[][..])
                .map_err(io_err("write input archive", in_tar))
        };
        let mut dirs = std::collections::BTreeSet::new();
        let mut add_parents = |b: &mut tar::Builder<File>, name: &str| -> Result<()> {
            let parts: Vec<&str> = name.split('/').collect();
            for i in 1..parts.len() {
                let d = parts[..i].join("/");
                if dirs.insert(d.clone()) {
                    add_dir(b, &d)?;
                }
            }
            Ok(())
        };

        let mut run = String::from("cd /box || exit 125\nexport SHEAF_BOX=1 SHEAF_OUT=/box/out\n");
        for (k, v) in &self.env {
            run.push_str(&format!("export {k}={}\n", sh_quote(v)));
        }
        run.push_str(&format!("exec ./{}", sh_quote(prog_name)));
        for a in args {
            run.push(' ');
            run.push_str(&sh_quote(a));
        }
        run.push('\n');
        add_dir(&mut b, ".sheaf")?;
        add_bytes(&mut b, ".sheaf/run.sh", run.as_bytes(), 0o755)?;
        let mut collect = self.collect.join("\n");
        collect.push('\n');
        add_bytes(&mut b, ".sheaf/collect", collect.as_bytes(), 0o644)?;

        let prog = File::open(program).map_err(io_err("open program", program))?;
        let mut h = tar::Header::new_ustar();
        let meta = prog.metadata().map_err(io_err("stat program", program))?;
        h.set_size(meta.len());
        h.set_mode(0o755);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, prog_name, prog)
            .map_err(io_err("write input archive", in_tar))?;

        for (name, src) in &self.files {
            add_parents(&mut b, name)?;
            match src {
                Source::Bytes(data, mode) => add_bytes(&mut b, name, data, *mode)?,
                Source::Path(path) => {
                    use std::os::unix::fs::PermissionsExt;
                    let f = File::open(path).map_err(io_err("open box input", path))?;
                    let meta = f.metadata().map_err(io_err("stat box input", path))?;
                    let mut h = tar::Header::new_ustar();
                    h.set_size(meta.len());
                    h.set_mode(if meta.permissions().mode() & 0o111 != 0 {
                        0o755
                    } else {
                        0o644
                    });
                    h.set_entry_type(tar::EntryType::Regular);
                    b.append_data(&mut h, name, f)
                        .map_err(io_err("write input archive", in_tar))?;
                }
            }
        }
        let f = b
            .into_inner()
            .map_err(io_err("finish input archive", in_tar))?;
        let len = f.metadata().map_err(io_err("stat", in_tar))?.len();
        Ok(len)
    }
}

/// Firmware the `pc` machine may load (from the host's QEMU data dirs).
const QEMU_FIRMWARE: &[&str] = &[
    "bios-256k.bin",
    "bios.bin",
    "linuxboot_dma.bin",
    "linuxboot.bin",
    "kvmvapic.bin",
    "pvh.bin",
    "multiboot_dma.bin",
];

/// The host's QEMU, its shared libraries (per `ldd`) and firmware, laid out
/// under `qemu/` with a wrapper script that starts it through its own loader.
fn host_qemu_files() -> Result<Vec<(String, Source)>> {
    let qemu = crate::qemu::qemu_binary()?;
    let ldd = std::process::Command::new("ldd")
        .arg(&qemu)
        .output()
        .map_err(|source| TestkitError::Spawn {
            program: "ldd".into(),
            source,
        })?;
    let mut files = vec![(
        "qemu/bin/qemu-system-x86_64".to_string(),
        Source::Path(qemu.clone()),
    )];
    let mut loader = None;
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        let line = line.trim();
        // "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x…)" or
        // "/lib64/ld-linux-x86-64.so.2 (0x…)"
        let (name, path) = match line.split_once(" => ") {
            Some((name, rest)) => (name.to_string(), rest.split_whitespace().next()),
            None => {
                let path = line.split_whitespace().next();
                let name = path
                    .and_then(|p| Path::new(p).file_name())
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                (name, path)
            }
        };
        let Some(path) = path.filter(|p| p.starts_with('/')) else {
            continue;
        };
        if name.starts_with("ld-linux") {
            loader = Some(name.clone());
        }
        files.push((format!("qemu/lib/{name}"), Source::Path(path.into())));
    }
    let loader = loader.ok_or_else(|| TestkitError::ToolMissing {
        tool: format!("dynamic loader of {}", qemu.display()),
        why: "running the host's QEMU in the nested box",
    })?;
    for fw in QEMU_FIRMWARE {
        if let Some(p) = ["/usr/share/qemu", "/usr/share/seabios"]
            .iter()
            .map(|d| Path::new(d).join(fw))
            .find(|p| p.is_file())
        {
            files.push((format!("qemu/share/{fw}"), Source::Path(p)));
        }
    }
    let wrapper = format!(
        "#!/bin/sh\n# The host's QEMU, with its own loader, libraries and firmware.\n\
         d=$(dirname \"$0\")\n\
         exec \"$d/lib/{loader}\" --library-path \"$d/lib\" \"$d/bin/qemu-system-x86_64\" -L \"$d/share\" \"$@\"\n"
    );
    files.push((
        "qemu/qemu-system-x86_64".into(),
        Source::Bytes(wrapper.into_bytes(), 0o755),
    ));
    Ok(files)
}

/// `key=value` in a marker line.
fn field<'a>(rest: &'a str, key: &str) -> Option<&'a str> {
    rest.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// The program's output as seen on the console: the lines between the RUN
/// and END markers (a last line without newline ends just before END).
fn console_section(console: &str, prefix: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in console.lines() {
        match line.find(prefix) {
            Some(i) => {
                let rest = line[i + prefix.len()..].trim_start();
                if rest.starts_with("RUN") {
                    inside = true;
                } else if rest.starts_with("END") {
                    out.push_str(&line[..i]);
                    break;
                }
            }
            None if inside => {
                out.push_str(line);
                out.push('\n');
            }
            None => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["disk.img", "a/b.raw", "vmlinux-6.1", "x+y"] {
            check_name(ok).unwrap();
        }
        for bad in [
            "", "/abs", "../up", "a/../b", "a//b", ".hidden", "-flag", "sp ace", "q'uote",
        ] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn quoting() {
        assert_eq!(sh_quote("a b"), "'a b'");
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn console_output_section() {
        let p = "SHEAF-BOX-ab:";
        let console = format!(
            "boot\n{p} RUN uptime=1\nhello\nworld\npartial{p} END status=3 uptime=2\nafter\n"
        );
        assert_eq!(console_section(&console, p), "hello\nworld\npartial");
        assert_eq!(field("END status=3 uptime=2", "status"), Some("3"));
        assert_eq!(field("RUN uptime=5.5", "uptime"), Some("5.5"));
    }

    #[test]
    fn input_archive_layout() {
        let dir = tempfile::tempdir().unwrap();
        let prog = dir.path().join("prog");
        fs::write(&prog, b"\x7fELF").unwrap();
        let tar_path = dir.path().join("in.tar");
        let b = NestedBox::new()
            .file_bytes("sub/dir/data.bin", vec![7u8; 1000], 0o600)
            .env("FOO", "it's")
            .collect("sub/dir/data.bin");
        b.write_inputs(&tar_path, &prog, "prog", &["--x".into(), "a b".into()])
            .unwrap();
        let mut names = Vec::new();
        let mut run = String::new();
        let mut ar = tar::Archive::new(File::open(&tar_path).unwrap());
        for e in ar.entries().unwrap() {
            let mut e = e.unwrap();
            let name = e.path().unwrap().display().to_string();
            if name == ".sheaf/run.sh" {
                std::io::Read::read_to_string(&mut e, &mut run).unwrap();
            }
            names.push(name);
        }
        assert_eq!(
            names,
            [
                ".sheaf",
                ".sheaf/run.sh",
                ".sheaf/collect",
                "prog",
                "sub",
                "sub/dir",
                "sub/dir/data.bin"
            ]
        );
        assert!(run.contains("export FOO='it'\\''s'"), "{run}");
        assert!(run.contains("exec ./'prog' '--x' 'a b'"), "{run}");
    }
}
