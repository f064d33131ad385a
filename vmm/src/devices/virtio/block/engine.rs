// SPDX-License-Identifier: Apache-2.0
//! Picks the [`AsyncBlockBackend`] for a configured disk.

use std::io;
use std::sync::Arc;

use super::backend::{BlockBackend, FileBackend};
use super::seam::{AsyncBlockBackend, SyncAdapter, ThreadPoolBackend};
use super::uring::{IoUringBackend, UringError};
use crate::config::{DEFAULT_IO_THREADS, DiskConfig, IoEngine};

/// Opens `disk` with its configured engine. With [`IoEngine::Auto`] a
/// kernel that refuses io_uring gets the thread pool and a warning.
pub fn open_disk(disk: &DiskConfig) -> io::Result<Arc<dyn AsyncBlockBackend>> {
    let threads = || usize::from(disk.io_threads.unwrap_or(DEFAULT_IO_THREADS));
    let file = || FileBackend::open(&disk.path, disk.read_only, disk.id.clone());
    let uring = || IoUringBackend::open(&disk.path, disk.read_only, disk.id.clone(), true);
    Ok(match disk.io_engine {
        IoEngine::Sync => Arc::new(SyncAdapter::new(Arc::new(file()?))),
        IoEngine::Threads => Arc::new(ThreadPoolBackend::new(Arc::new(file()?), threads())?),
        IoEngine::IoUring => match uring() {
            Ok(b) => Arc::new(b),
            Err(UringError::Open { source, .. }) => return Err(source),
            Err(UringError::Setup(e)) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("io_engine io_uring: io_uring_setup failed: {e}"),
                ));
            }
        },
        IoEngine::Auto => match uring() {
            Ok(b) => Arc::new(b),
            Err(UringError::Open { source, .. }) => return Err(source),
            Err(UringError::Setup(e)) => {
                tracing::warn!(
                    path = %disk.path.display(),
                    error = %e,
                    "io_uring unavailable, disk uses the thread-pool engine"
                );
                Arc::new(ThreadPoolBackend::new(Arc::new(file()?), threads())?)
            }
        },
    })
}

/// Wraps an embedder's synchronous backend in the default thread pool.
pub fn pooled(backend: Arc<dyn BlockBackend>) -> io::Result<Arc<dyn AsyncBlockBackend>> {
    Ok(Arc::new(ThreadPoolBackend::new(
        backend,
        usize::from(DEFAULT_IO_THREADS),
    )?))
}
