// SPDX-License-Identifier: Apache-2.0
//! The guest's serial console log: append-only, capped and rotated.
//!
//! Guest output is hostile: a guest that prints without end must not fill
//! the node's disk. The log keeps at most two files of `limit` bytes each:
//! when `console.log` would pass the limit it is renamed to `console.log.1`
//! (replacing the older one) and a new `console.log` is started. Files are
//! created 0600 (a console may show secrets the guest prints).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Default size at which the console log rotates (per file; two are kept).
pub const DEFAULT_CONSOLE_LOG_BYTES: u64 = 8 << 20;

#[derive(Debug)]
struct Inner {
    file: File,
    written: u64,
}

/// Where the guest's serial console goes: an append-only file the agent
/// and the CLI read (`console`). Cheap to clone.
#[derive(Clone, Debug)]
pub struct ConsoleLog {
    inner: Arc<Mutex<Inner>>,
    path: PathBuf,
    limit: u64,
}

fn open_append(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

impl ConsoleLog {
    /// Opens (creates, appends to) `path`, rotating at
    /// [`DEFAULT_CONSOLE_LOG_BYTES`].
    pub fn open(path: &Path) -> std::io::Result<ConsoleLog> {
        Self::with_limit(path, DEFAULT_CONSOLE_LOG_BYTES)
    }

    /// Opens `path`, rotating when it would pass `limit` bytes (at least 1).
    pub fn with_limit(path: &Path, limit: u64) -> std::io::Result<ConsoleLog> {
        let file = open_append(path)?;
        let written = file.metadata()?.len();
        Ok(ConsoleLog {
            inner: Arc::new(Mutex::new(Inner { file, written })),
            path: path.to_path_buf(),
            limit: limit.max(1),
        })
    }

    /// The rotated-out older file (`<path>.1`).
    pub fn rotated_path(&self) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(".1");
        PathBuf::from(p)
    }

    /// Appends guest output (unbuffered: a line the guest printed is in the
    /// file before the guest continues). Rotates first if the file would
    /// pass the limit; output larger than the limit keeps only its tail.
    pub fn write(&self, mut bytes: &[u8]) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let limit = usize::try_from(self.limit).unwrap_or(usize::MAX);
        if bytes.len() > limit {
            bytes = &bytes[bytes.len() - limit..];
        }
        if g.written.saturating_add(bytes.len() as u64) > self.limit
            && let Err(e) = self.rotate(&mut g)
        {
            tracing::warn!(path = %self.path.display(), error = %e, "console log rotation failed; output dropped");
            return;
        }
        if g.file.write_all(bytes).is_ok() {
            g.written = g.written.saturating_add(bytes.len() as u64);
        }
    }

    fn rotate(&self, g: &mut Inner) -> std::io::Result<()> {
        std::fs::rename(&self.path, self.rotated_path())?;
        g.file = open_append(&self.path)?;
        g.written = 0;
        Ok(())
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn rotates_at_the_limit_and_keeps_two_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let log = ConsoleLog::with_limit(&path, 100).unwrap();
        for i in 0..1000u32 {
            log.write(format!("line {i:04}\n").as_bytes());
        }
        let live = std::fs::read_to_string(&path).unwrap();
        let old = std::fs::read_to_string(log.rotated_path()).unwrap();
        assert!(
            live.len() <= 100 && old.len() <= 100,
            "{} {}",
            live.len(),
            old.len()
        );
        assert!(live.ends_with("line 0999\n"), "{live}");
        // Nothing is lost between the two files: they are consecutive.
        let both = old.clone() + &live;
        let first: u32 = both[5..9].parse().unwrap();
        let expect: String = (first..1000).map(|i| format!("line {i:04}\n")).collect();
        assert_eq!(both, expect);
        let entries = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(entries, 2);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn a_write_larger_than_the_limit_keeps_its_tail_and_reopen_counts_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let log = ConsoleLog::with_limit(&path, 10).unwrap();
        log.write(b"0123456789abcdef");
        assert_eq!(std::fs::read(&path).unwrap(), b"6789abcdef");
        drop(log);
        let log = ConsoleLog::with_limit(&path, 10).unwrap();
        log.write(b"X");
        assert_eq!(std::fs::read(&path).unwrap(), b"X");
        assert_eq!(std::fs::read(log.rotated_path()).unwrap(), b"6789abcdef");
    }
}
