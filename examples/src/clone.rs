// SPDX-License-Identifier: Apache-2.0
//! Volume clones (`spec.source.volume`, a DataVolume's `source.pvc`): a
//! full block copy from the source Volume into the new one.
//!
//! blockrepl's snapshots live inside one volume's replicas; there is no
//! cross-volume copy-on-write clone yet, so the clone reads the source
//! through a replicated engine (attached above the source's epoch, like an
//! import) and writes every non-zero 1 MiB chunk into the destination.
//! The source must be idle (not attached) while it is copied; an instance
//! attaching it meanwhile fences the clone's engine and the clone fails.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sheaf_orchestrator::resources::Volume;
use sheaf_orchestrator::resources::parse_quantity_bytes;
use sheaf_orchestrator::resources::sheaf::VolumePhase;
use sheaf_orchestrator::store::{Store, StoreError, StoreExt};
use tokio::sync::mpsc;

use crate::image::{CHUNK, ImportError, ImportProgress, attach_engine};
use crate::metrics::Metrics;

/// Why a clone cannot start yet or failed.
#[derive(Debug, thiserror::Error)]
pub enum CloneError {
    /// The source is not ready (still importing, attached, missing): retried.
    #[error("{0}")]
    NotReady(String),
    /// The clone failed.
    #[error(transparent)]
    Failed(#[from] ImportError),
}

fn vol_err(v: &str, m: impl Into<String>) -> ImportError {
    ImportError::Volume {
        volume: v.to_string(),
        message: m.into(),
    }
}

/// The source volume if it can be copied now.
pub async fn ready_source(
    store: &Arc<dyn Store>,
    ns: &str,
    src: &str,
) -> Result<Volume, CloneError> {
    let v: Volume = match store.get_typed(ns, src).await {
        Ok(v) => v,
        Err(StoreError::NotFound { .. }) => {
            return Err(CloneError::NotReady(format!(
                "waiting for source volume {ns}/{src} to exist"
            )));
        }
        Err(e) => return Err(CloneError::Failed(e.into())),
    };
    let st = v.status.clone().unwrap_or_default();
    if let Some(a) = &st.attachment {
        return Err(CloneError::NotReady(format!(
            "source volume {ns}/{src} is attached to {}; it is cloned once it is detached",
            a.instance.as_deref().unwrap_or("an instance")
        )));
    }
    match st.phase {
        Some(VolumePhase::Available | VolumePhase::Degraded) => Ok(v),
        p => Err(CloneError::NotReady(format!(
            "waiting for source volume {ns}/{src} (phase {})",
            p.map_or("Pending".to_string(), |p| format!("{p:?}"))
        ))),
    }
}

/// Copies `src` (ready, see [`ready_source`]) into `dst` (whose replicas
/// are served); returns the bytes copied.
pub async fn clone_into(
    store: &Arc<dyn Store>,
    secret_file: &Path,
    src: &Volume,
    dst: &Volume,
    metrics: &Metrics,
    tx: &mpsc::Sender<ImportProgress>,
) -> Result<u64, ImportError> {
    let sname = format!(
        "{}/{}",
        src.metadata.namespace.as_deref().unwrap_or_default(),
        src.metadata.name.as_deref().unwrap_or_default()
    );
    let dname = format!(
        "{}/{}",
        dst.metadata.namespace.as_deref().unwrap_or_default(),
        dst.metadata.name.as_deref().unwrap_or_default()
    );
    let ssize = parse_quantity_bytes(&src.spec.size.0).unwrap_or(0);
    let dsize = parse_quantity_bytes(&dst.spec.size.0).unwrap_or(0);
    if dsize < ssize {
        return Err(vol_err(
            &dname,
            format!("{dsize} bytes cannot hold a clone of {sname} ({ssize} bytes)"),
        ));
    }
    let (from, _) = attach_engine(store, secret_file, src).await?;
    let to = match attach_engine(store, secret_file, dst).await {
        Ok((e, _)) => e,
        Err(e) => {
            let _ = from.detach().await;
            return Err(e);
        }
    };
    let len = from.size().min(ssize);
    let io = |v: &str, m: String| ImportError::Io {
        volume: v.to_string(),
        message: m,
    };
    let res = async {
        let mut off = 0u64;
        let mut last = Instant::now();
        while off < len {
            let want = ((len - off) as usize).min(CHUNK);
            let data = from
                .read(off, want)
                .await
                .map_err(|e| io(&sname, format!("read at {off}: {e}")))?;
            if data.iter().any(|b| *b != 0) {
                let t = Instant::now();
                to.write(off, data)
                    .await
                    .map_err(|e| io(&dname, format!("write at {off}: {e}")))?;
                metrics.observe_io(&dname, "write", t.elapsed(), want as u64);
            }
            off += want as u64;
            if last.elapsed() > Duration::from_millis(100) || off >= len {
                last = Instant::now();
                let _ = tx.send(ImportProgress::new("cloning", off, len, "")).await;
            }
        }
        to.flush()
            .await
            .map_err(|e| io(&dname, format!("flush: {e}")))?;
        Ok::<_, ImportError>(len)
    }
    .await;
    let _ = from.detach().await;
    let _ = to.detach().await;
    res
}
