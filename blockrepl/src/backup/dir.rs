// SPDX-License-Identifier: Apache-2.0
//! A backup target in a local or NFS-mounted directory: one file per
//! object, keys as relative paths.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use super::{BackupError, BackupTarget, ObjectInfo, check_key, check_prefix};

/// Temporary files of unfinished puts start with this (keys never start
/// with `.`, so listing skips them).
const TMP_PREFIX: &str = ".tmp-";

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// A directory holding one file per object. A put writes a temporary file
/// in the object's folder, syncs it, renames it over the key and syncs the
/// folder, so an object is either complete or absent after a crash (on NFS
/// this relies on the server honouring `fsync` and atomic rename, as NFSv3+
/// servers do).
#[derive(Debug, Clone)]
pub struct DirectoryTarget {
    root: PathBuf,
}

impl DirectoryTarget {
    /// A target rooted at `root`, created if missing.
    pub fn new(root: impl AsRef<Path>) -> Result<DirectoryTarget, BackupError> {
        let root = root.as_ref().to_path_buf();
        fs::create_dir_all(&root).map_err(|e| BackupError::Target {
            target: root.display().to_string(),
            op: "create",
            key: String::new(),
            source: Box::new(e),
        })?;
        Ok(DirectoryTarget { root })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file that holds `key` (tests damage it).
    pub fn path_of(&self, key: &str) -> Result<PathBuf, BackupError> {
        check_key(key)?;
        Ok(self.root.join(key))
    }

    fn err(&self, op: &'static str, key: &str, e: io::Error) -> BackupError {
        if e.kind() == io::ErrorKind::NotFound && op == "get" {
            return BackupError::NotFound {
                key: key.to_string(),
            };
        }
        if e.kind() == io::ErrorKind::PermissionDenied {
            return BackupError::Auth {
                target: self.describe(),
                op,
                key: key.to_string(),
                detail: e.to_string(),
            };
        }
        BackupError::Target {
            target: self.describe(),
            op,
            key: key.to_string(),
            source: Box::new(e),
        }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        op: &'static str,
        key: &str,
        f: impl FnOnce() -> io::Result<T> + Send + 'static,
    ) -> Result<T, BackupError> {
        match tokio::task::spawn_blocking(f).await {
            Ok(r) => r.map_err(|e| self.err(op, key, e)),
            Err(e) => Err(self.err(op, key, io::Error::other(e))),
        }
    }
}

fn put_file(path: &Path, data: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other("object path has no folder"))?;
    fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::other("bad object file name"))?;
    let seq = TMP_SEQ.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!("{TMP_PREFIX}{name}.{}.{seq}", std::process::id()));
    let res = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        fs::File::open(dir)?.sync_all()
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

fn list_dir(root: &Path, dir: &Path, out: &mut Vec<ObjectInfo>) -> io::Result<()> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for ent in rd {
        let ent = ent?;
        let name = ent.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.starts_with('.') {
            continue;
        }
        let ft = ent.file_type()?;
        let path = ent.path();
        if ft.is_dir() {
            list_dir(root, &path, out)?;
        } else if ft.is_file() {
            let md = ent.metadata()?;
            let Ok(rel) = path.strip_prefix(root) else {
                continue;
            };
            let Some(key) = rel.to_str() else { continue };
            out.push(ObjectInfo {
                key: key.to_string(),
                size: md.len(),
                modified: md.modified()?,
            });
        }
    }
    Ok(())
}

#[async_trait::async_trait]
impl BackupTarget for DirectoryTarget {
    async fn put(&self, key: &str, data: Bytes) -> Result<(), BackupError> {
        let path = self.path_of(key)?;
        self.blocking("put", key, move || put_file(&path, &data))
            .await
    }

    async fn get(&self, key: &str) -> Result<Bytes, BackupError> {
        let path = self.path_of(key)?;
        self.blocking("get", key, move || fs::read(path).map(Bytes::from))
            .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackupError> {
        check_prefix(prefix)?;
        let root = self.root.clone();
        let start = root.join(prefix);
        self.blocking("list", prefix, move || {
            let mut out = Vec::new();
            list_dir(&root, &start, &mut out)?;
            Ok(out)
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<(), BackupError> {
        let path = self.path_of(key)?;
        self.blocking("delete", key, move || match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        })
        .await
    }

    fn describe(&self) -> String {
        format!("dir:{}", self.root.display())
    }
}
