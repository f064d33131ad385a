// SPDX-License-Identifier: Apache-2.0
//! Image uploads: `sheaf image import FILE` streams the file's bytes as the
//! body of the import request (`Content-Type: application/octet-stream`),
//! so a client never names a path on the cluster host. The server writes
//! them to `<data>/uploads/` (an image directory of the policy), imports
//! from there and removes the file afterwards.

use std::path::{Path, PathBuf};

use axum::body::Body;
use futures::StreamExt;
use sheaf_orchestrator::names;
use tokio::io::AsyncWriteExt;

/// A failed upload.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    /// The file name would leave the uploads directory.
    #[error(transparent)]
    Path(#[from] names::PathError),
    /// Writing the file.
    #[error("writing upload {}: {source}", path.display())]
    Io {
        /// The upload file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The client stopped sending.
    #[error("reading the upload: {0}")]
    Body(String),
    /// Nothing was sent.
    #[error("the upload is empty")]
    Empty,
    /// More than the upload size limit was sent.
    #[error("the upload is larger than the limit of {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: u64,
    },
    /// Storing more would leave the file system with less than its reserve.
    #[error(
        "the uploads file system has {free} bytes free; uploads stop at a reserve of {reserve} bytes"
    )]
    NoSpace {
        /// Bytes free when the upload stopped.
        free: u64,
        /// The reserve kept free.
        reserve: u64,
    },
}

impl UploadError {
    /// The HTTP status that fits: 413 too large, 507 no space, else 400.
    pub fn http_status(&self) -> (u16, &'static str) {
        match self {
            UploadError::TooLarge { .. } => (413, "RequestEntityTooLarge"),
            UploadError::NoSpace { .. } => (507, "InsufficientStorage"),
            UploadError::Io { .. } => (500, "InternalError"),
            _ => (400, "BadRequest"),
        }
    }
}

/// How much one upload may store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadLimits {
    /// Largest upload in bytes.
    pub max_bytes: u64,
    /// Bytes the uploads file system must keep free (checked before the
    /// upload and every [`SPACE_CHECK_BYTES`]); an upload that would eat
    /// into it stops, so a client cannot fill the node's disk.
    pub reserve_bytes: u64,
}

impl Default for UploadLimits {
    /// 1 TiB per upload, 2 GiB kept free.
    fn default() -> Self {
        UploadLimits {
            max_bytes: 1 << 40,
            reserve_bytes: 2 << 30,
        }
    }
}

/// How often (in bytes received) free space is checked again.
pub const SPACE_CHECK_BYTES: u64 = 64 << 20;

/// Bytes available to unprivileged writers on the file system of `dir`.
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("path holds a NUL byte"))?;
    // SAFETY: statvfs writes into the zeroed struct we own; `c` is a valid
    // NUL-terminated path for the duration of the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

fn check_space(dir: &Path, reserve: u64) -> Result<(), UploadError> {
    let free = free_bytes(dir).map_err(|source| UploadError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    if free < reserve.saturating_add(SPACE_CHECK_BYTES) {
        return Err(UploadError::NoSpace { free, reserve });
    }
    Ok(())
}

/// An upload file on disk, removed on drop.
#[derive(Debug)]
pub struct Upload {
    path: PathBuf,
    /// Bytes received.
    pub len: u64,
}

impl Upload {
    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Streams `body` into a new file `<dir>/<ns>-<name>-<random>.upload`
/// (created 0600, exclusively), fsynced; a partial file is removed. At most
/// `limits.max_bytes` are accepted and the file system keeps
/// `limits.reserve_bytes` free.
pub async fn receive(
    dir: &Path,
    ns: &str,
    name: &str,
    body: Body,
    limits: UploadLimits,
) -> Result<Upload, UploadError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| UploadError::Io { path, source }
    };
    tokio::fs::create_dir_all(dir).await.map_err(io(dir))?;
    check_space(dir, limits.reserve_bytes)?;
    let file_name = format!("{ns}-{name}-{}.upload", uuid::Uuid::new_v4().simple());
    let path = names::child(dir, &file_name)?;
    let mut f = tokio::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .await
        .map_err(io(&path))?;
    // From here the file is removed whatever happens.
    let mut up = Upload { path, len: 0 };
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| UploadError::Body(e.to_string()))?;
        let len = chunk.len() as u64;
        if up.len.saturating_add(len) > limits.max_bytes {
            return Err(UploadError::TooLarge {
                limit: limits.max_bytes,
            });
        }
        if up.len / SPACE_CHECK_BYTES != (up.len + len) / SPACE_CHECK_BYTES {
            check_space(dir, limits.reserve_bytes)?;
        }
        f.write_all(&chunk).await.map_err(io(&up.path))?;
        up.len += len;
    }
    if up.len == 0 {
        return Err(UploadError::Empty);
    }
    f.sync_all().await.map_err(io(&up.path))?;
    Ok(up)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn upload_lands_private_and_goes_away() {
        let d = tempfile::tempdir().unwrap();
        let up = receive(
            d.path(),
            "default",
            "disk",
            Body::from(vec![7u8; 10_000]),
            UploadLimits::default(),
        )
        .await
        .unwrap();
        assert_eq!(up.len, 10_000);
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(up.path()).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        let p = up.path().to_path_buf();
        drop(up);
        assert!(!p.exists());
        assert!(matches!(
            receive(
                d.path(),
                "default",
                "disk",
                Body::empty(),
                UploadLimits::default()
            )
            .await,
            Err(UploadError::Empty)
        ));
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
        assert!(
            receive(
                d.path(),
                "..",
                "x/y",
                Body::from("x"),
                UploadLimits::default()
            )
            .await
            .is_err()
        );
    }

    #[tokio::test]
    async fn oversized_uploads_and_a_full_disk_are_refused_and_leave_nothing() {
        let d = tempfile::tempdir().unwrap();
        let small = UploadLimits {
            max_bytes: 4096,
            reserve_bytes: 0,
        };
        let chunks = futures::stream::iter(
            (0..4).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![1u8; 2048]))),
        );
        let e = receive(
            d.path(),
            "default",
            "disk",
            Body::from_stream(chunks),
            small,
        )
        .await
        .unwrap_err();
        assert!(matches!(e, UploadError::TooLarge { limit: 4096 }), "{e}");
        assert_eq!(e.http_status().0, 413);
        let up = receive(
            d.path(),
            "default",
            "disk",
            Body::from(vec![1u8; 4096]),
            small,
        )
        .await
        .unwrap();
        assert_eq!(up.len, 4096);
        drop(up);
        // A reserve larger than the whole file system: refused up front.
        let full = UploadLimits {
            max_bytes: u64::MAX,
            reserve_bytes: u64::MAX / 2,
        };
        let e = receive(d.path(), "default", "disk", Body::from("x"), full)
            .await
            .unwrap_err();
        assert!(matches!(e, UploadError::NoSpace { .. }), "{e}");
        assert_eq!(e.http_status().0, 507);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }
}
