// SPDX-License-Identifier: Apache-2.0
//! The store's view of a disk: a directory of files with positional I/O.
//!
//! [`StdDir`] maps it to real files; the simulator maps it to in-memory files
//! that lose unsynced writes on power loss, tear, misdirect and rot.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// One file of a replica store.
///
/// Methods take `&self`: a checkpoint job writes layer files on another
/// thread while the store thread reads them (positional I/O on one file
/// from two threads is fine).
///
/// Reads past the end of the file return zeros (sparse semantics). Writes are
/// durable only after [`StoreFile::sync`] returns.
#[allow(clippy::len_without_is_empty)] // a file length, not a collection
pub trait StoreFile: Send + Sync + fmt::Debug {
    /// Reads exactly `buf.len()` bytes at `off`; bytes past the end read as zero.
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()>;
    /// Writes all of `buf` at `off`, growing the file if needed.
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()>;
    /// Writes `head` then `tail` contiguously at `off` (a WAL record header
    /// and its data). The default concatenates and calls `write_at`;
    /// real files use one vectored write without copying the data.
    fn write2_at(&self, head: &[u8], tail: &[u8], off: u64) -> io::Result<()> {
        let mut rec = Vec::with_capacity(head.len() + tail.len());
        rec.extend_from_slice(head);
        rec.extend_from_slice(tail);
        self.write_at(&rec, off)
    }
    /// Makes every earlier write durable.
    fn sync(&self) -> io::Result<()>;
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// Truncates or extends the file.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Deallocates a range so it reads as zeros. The default writes zeros.
    fn punch_hole(&self, off: u64, len: u64) -> io::Result<()> {
        let zeros = vec![0u8; len as usize];
        self.write_at(&zeros, off)
    }
}

/// A directory of store files.
pub trait StoreDir: Send + fmt::Debug {
    /// Opens (and with `create`, creates) a file.
    fn open(&self, name: &str, create: bool) -> io::Result<Box<dyn StoreFile>>;
    /// Removes a file; a missing file is not an error.
    fn remove(&self, name: &str) -> io::Result<()>;
    /// Names of the files in the directory.
    fn list(&self) -> io::Result<Vec<String>>;
    /// Makes creations and removals durable.
    fn sync_dir(&self) -> io::Result<()>;
    /// Identifies the lifetime of the page cache holding this directory's
    /// unsynced writes: it must change whenever unsynced writes may have
    /// been lost (a reboot or power loss), and may stay the same across a
    /// mere process restart. The store compares it with the value it
    /// recorded to learn that it may have lost writes it acknowledged.
    ///
    /// The default is a fresh value per process, which is always safe (a
    /// process restart then counts as a power loss).
    fn boot_id(&self) -> u64 {
        process_boot_id()
    }
    /// A value a guest cannot predict (the store starts its WAL
    /// generations at such offsets: a record header forged inside guest
    /// data left in a reused WAL file past its live end must not name
    /// the generation replayed there). The default draws from the
    /// process's random hash keys; the simulator's is seeded.
    fn random(&self) -> u64 {
        use std::hash::{BuildHasher, RandomState};
        RandomState::new().hash_one(process_boot_id())
    }
    /// Whether the store may run checkpoint jobs on a background thread
    /// (real files). `false` runs them inline at deterministic points
    /// ([`crate::store::Store::poll_checkpoint`], the next seal, or an
    /// operation that needs them finished): the simulator.
    fn background_checkpoints(&self) -> bool {
        true
    }
}

/// A value unique to this process (see [`StoreDir::boot_id`]).
fn process_boot_id() -> u64 {
    use std::sync::OnceLock;
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ (u64::from(std::process::id()) << 32) ^ 0x9e37_79b9_7f4a_7c15
    })
}

/// The kernel's boot id (`/proc/sys/kernel/random/boot_id`) folded to 64
/// bits, or the per-process value where it is unavailable.
fn kernel_boot_id() -> u64 {
    use std::sync::OnceLock;
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(|| {
        let Ok(s) = fs::read_to_string("/proc/sys/kernel/random/boot_id") else {
            return process_boot_id();
        };
        let hex: String = s.chars().filter(char::is_ascii_hexdigit).collect();
        if hex.len() < 16 {
            return process_boot_id();
        }
        let hi = u64::from_str_radix(&hex[..16], 16).unwrap_or(0);
        let lo = u64::from_str_radix(&hex[16..hex.len().min(32)], 16).unwrap_or(0);
        hi ^ lo.rotate_left(17)
    })
}

/// Name of the lock file in a replica directory.
pub const DIR_LOCK_FILE: &str = ".sheaf-replica.lock";

/// An exclusive `flock` on a lock file, held while a directory is served
/// (a replica's, or the control plane's store): two servers on one directory
/// would each overwrite the other's commits. Released when dropped (or when
/// the process dies).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

/// What [`DirLock::acquire`] can meet.
#[derive(Debug)]
pub enum DirLockError {
    /// Someone holds it; the pid it wrote, if any.
    Held(Option<u32>),
    /// The lock file could not be opened or locked.
    Io(io::Error),
}

impl DirLock {
    /// Takes the lock of replica directory `dir` ([`DIR_LOCK_FILE`]) without
    /// waiting.
    pub fn acquire(dir: &Path) -> Result<DirLock, DirLockError> {
        Self::acquire_file(&dir.join(DIR_LOCK_FILE))
    }

    /// Takes the lock on the file `path` (created 0600, never through a
    /// symbolic link) without waiting, and writes this process's id into it.
    pub fn acquire_file(path: &Path) -> Result<DirLock, DirLockError> {
        use std::io::{Read, Seek, Write};
        use std::os::fd::AsRawFd;
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(DirLockError::Io)?;
        // SAFETY: flock on a descriptor we own; no memory is involved.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut pid = String::new();
                let _ = f.read_to_string(&mut pid);
                return Err(DirLockError::Held(pid.trim().parse().ok()));
            }
            return Err(DirLockError::Io(e));
        }
        f.set_len(0)
            .and_then(|_| f.rewind())
            .and_then(|_| write!(f, "{}", std::process::id()))
            .map_err(DirLockError::Io)?;
        Ok(DirLock { _file: f })
    }
}

/// A store directory on the local file system.
#[derive(Debug, Clone)]
pub struct StdDir {
    path: PathBuf,
}

impl StdDir {
    /// Uses `path` (created if missing) as a store directory.
    pub fn new(path: impl AsRef<Path>) -> io::Result<StdDir> {
        fs::create_dir_all(path.as_ref())?;
        Ok(StdDir {
            path: path.as_ref().to_path_buf(),
        })
    }

    /// The directory path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[derive(Debug)]
struct StdFile {
    file: File,
}

impl StoreFile for StdFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let n = self.file.read_at(&mut buf[done..], off + done as u64)?;
            if n == 0 {
                buf[done..].fill(0);
                break;
            }
            done += n;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.file.write_all_at(buf, off)
    }

    fn write2_at(&self, head: &[u8], tail: &[u8], off: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let iov = [
            libc::iovec {
                iov_base: head.as_ptr() as *mut libc::c_void,
                iov_len: head.len(),
            },
            libc::iovec {
                iov_base: tail.as_ptr() as *mut libc::c_void,
                iov_len: tail.len(),
            },
        ];
        let n = loop {
            // SAFETY: both iovecs describe live, readable slices borrowed for
            // the call (pwritev only reads them); the descriptor is owned by
            // `self.file` and open.
            let n = unsafe {
                libc::pwritev(self.file.as_raw_fd(), iov.as_ptr(), 2, off as libc::off_t)
            };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        // A short vectored write: finish the rest with plain writes.
        if n < head.len() {
            self.file.write_all_at(&head[n..], off + n as u64)?;
            self.file.write_all_at(tail, off + head.len() as u64)
        } else if n < head.len() + tail.len() {
            let t = n - head.len();
            self.file.write_all_at(&tail[t..], off + n as u64)
        } else {
            Ok(())
        }
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }

    fn punch_hole(&self, off: u64, len: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let end = off + len;
        if end > self.len()? {
            // Punching past EOF would not extend the file; callers expect zeros
            // in range, which reads past EOF already give.
            let cur = self.len()?;
            if off >= cur {
                return Ok(());
            }
            return self.punch_hole(off, cur - off);
        }
        // SAFETY: fallocate only reads its integer arguments; the descriptor is
        // owned by `self.file` and stays open for the duration of the call.
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off as libc::off_t,
                len as libc::off_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            // File systems without hole punching: write zeros instead.
            let zeros = vec![0u8; len as usize];
            self.file.write_all_at(&zeros, off)
        }
    }
}

impl StoreDir for StdDir {
    fn open(&self, name: &str, create: bool) -> io::Result<Box<dyn StoreFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            // Replica data is the guest's disk: owner only, from creation.
            .mode(0o600)
            .open(self.path.join(name))?;
        Ok(Box::new(StdFile { file }))
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        match fs::remove_file(self.path.join(name)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }

    fn list(&self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.path)? {
            let entry = entry?;
            if let Some(name) = entry.file_name().to_str() {
                out.push(name.to_string());
            }
        }
        out.sort();
        Ok(out)
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.path)?.sync_all()
    }

    fn boot_id(&self) -> u64 {
        kernel_boot_id()
    }
}
