// SPDX-License-Identifier: Apache-2.0
//! The store directory lock and file modes: two servers must never open one
//! store (each would overwrite the other's commits), and the store file —
//! which holds every Secret — is readable by its owner only.

use std::fs::OpenOptions;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use sheaf_blockrepl::store::disk::{DirLock, DirLockError};

use super::{StoreError, StoreResult};

/// Name of the lock file next to the store file.
pub const LOCK_FILE: &str = ".sheaf-store.lock";

/// Takes an exclusive `flock` on `<dir>/.sheaf-store.lock` (created 0600)
/// and writes this process's id into it (blockrepl's [`DirLock`], the same
/// lock the replica servers take). The lock lives as long as the returned
/// value; a second opener gets an error naming the holder.
pub(crate) fn lock_dir(dir: &Path) -> StoreResult<DirLock> {
    let path = dir.join(LOCK_FILE);
    DirLock::acquire_file(&path).map_err(|e| match e {
        DirLockError::Held(pid) => StoreError::Backend(format!(
            "the store in {} is already open in another process{}; two servers may not share a store",
            dir.display(),
            pid.map(|p| format!(" (pid {p})")).unwrap_or_default(),
        )),
        DirLockError::Io(e) => StoreError::Backend(format!("locking {}: {e}", path.display())),
    })
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
