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
/// (created 0600, exclusively), fsynced; a partial file is removed.
pub async fn receive(dir: &Path, ns: &str, name: &str, body: Body) -> Result<Upload, UploadError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| UploadError::Io { path, source }
    };
    tokio::fs::create_dir_all(dir).await.map_err(io(dir))?;
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
        f.write_all(&chunk).await.map_err(io(&up.path))?;
        up.len += chunk.len() as u64;
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
        let up = receive(d.path(), "default", "disk", Body::from(vec![7u8; 10_000]))
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
            receive(d.path(), "default", "disk", Body::empty()).await,
            Err(UploadError::Empty)
        ));
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
        assert!(
            receive(d.path(), "..", "x/y", Body::from("x"))
                .await
                .is_err()
        );
    }
}
