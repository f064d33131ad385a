// SPDX-License-Identifier: Apache-2.0
//! The store directory lock and file modes: two servers must never open one
//! store (each would overwrite the other's commits), and the store file —
//! which holds every Secret — is readable by its owner only.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use super::{StoreError, StoreResult};

/// Name of the lock file next to the store file.
pub const LOCK_FILE: &str = ".sheaf-store.lock";

/// Takes an exclusive `flock` on `<dir>/.sheaf-store.lock` (created 0600)
/// and writes this process's id into it. The lock lives as long as the
/// returned file; a second opener gets an error naming the holder.
pub(crate) fn lock_dir(dir: &Path) -> StoreResult<File> {
    let path = dir.join(LOCK_FILE);
    let io = |what: &str, e: std::io::Error| {
        StoreError::Backend(format!("{what} {}: {e}", path.display()))
    };
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|e| io("opening the store lock", e))?;
    // SAFETY: flock on a file descriptor we own; no memory is involved.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut holder = String::new();
            let _ = f.read_to_string(&mut holder);
            let holder = holder.trim();
            return Err(StoreError::Backend(format!(
                "the store in {} is already open in another process{}; two servers may not share a store",
                dir.display(),
                if holder.is_empty() {
                    String::new()
                } else {
                    format!(" (pid {holder})")
                },
            )));
        }
        return Err(io("locking", err));
    }
    f.set_len(0)
        .and_then(|_| f.seek(SeekFrom::Start(0)))
        .and_then(|_| write!(f, "{}", std::process::id()))
        .map_err(|e| io("writing", e))?;
    Ok(f)
}

/// Creates `path` 0600 if missing, and takes group/other access away from
/// an existing one, before the database opens it.
pub(crate) fn private_file(path: &Path) -> StoreResult<()> {
    let err = |e: std::io::Error| StoreError::Backend(format!("{}: {e}", path.display()));
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(err)?;
    let mode = f.metadata().map_err(err)?.permissions().mode();
    if mode & 0o077 != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(mode & 0o700))
            .map_err(err)?;
    }
    Ok(())
}
