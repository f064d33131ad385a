// SPDX-License-Identifier: Apache-2.0
//! Volume sources: a Volume applied with `spec.source.image` (a raw or
//! qcow2 file on the cluster host, or an `http(s)://` URL), or with
//! `spec.source.volume` (a clone of another Volume), is filled by the
//! cluster process, so `kubectl apply` of a VM and its Volume (or a
//! KubeVirt VM with `dataVolumeTemplates`) works without `sheaf image
//! import` first.
//!
//! ```text
//!   Volume (spec.source) ─► volume controller: replicas placed, served,
//!        │                   phase stays Creating until Imported=True
//!        ▼
//!   importer (this module, every second), status.progress "42.0%":
//!     image: URL ─► download (DATA/tmp, checksum) ─┐  Imported=False/Importing "downloading 4.0/16.0 MiB (25%)"
//!            file (image directory) ───────────────┴► import_path (qcow2 checked + converted) ─► copy
//!     volume: clone (full copy; waits while the source is busy)
//!        └► Imported=True "raw image, N bytes, epoch E"
//!        └► Imported=False/ImportFailed "<error>" (temp files removed, volume stays Creating)
//! ```
//!
//! A failed import is not retried for the same source while the cluster
//! runs (fix the source, then change `spec.source` or delete and re-create
//! the volume, or restart the cluster).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sheaf_orchestrator::controllers::util::{condition, set_condition};
use sheaf_orchestrator::controllers::volume::SOURCE_IMPORTED;
use sheaf_orchestrator::images::ImagePolicy;
use sheaf_orchestrator::resources::{ConditionStatus, Volume};
use sheaf_orchestrator::store::{ListOptions, Store, StoreExt, UpdateScope};
use tokio::sync::mpsc;

use sheaf_orchestrator::images::ImageSource;
use sheaf_orchestrator::resources::parse_quantity_bytes;

use crate::clone::{CloneError, clone_into, ready_source};
use crate::download::{DownloadLimits, download};
use crate::image::{ImportOptions, ImportProgress, import_path, wait_available};
use crate::metrics::Metrics;

/// What the importer needs.
#[derive(Debug, Clone)]
pub struct SourceImporter {
    /// The cluster's store.
    pub store: Arc<dyn Store>,
    /// Replication secret.
    pub secret_file: PathBuf,
    /// Scratch space (qcow2 conversion).
    pub tmp_dir: PathBuf,
    /// Import I/O metrics.
    pub metrics: Metrics,
    /// Where image files may come from.
    pub images: ImagePolicy,
    /// Bounds of http(s) downloads.
    pub limits: DownloadLimits,
}

#[derive(Debug, Default)]
struct State {
    /// Volumes being imported.
    running: HashSet<String>,
    /// Volume → source whose import failed.
    failed: HashMap<String, String>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets the `Imported` condition of `ns/name` and its `status.progress`.
async fn set_imported(
    store: &Arc<dyn Store>,
    ns: &str,
    name: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
    progress: Option<String>,
) {
    let res = store
        .modify_typed(ns, name, UpdateScope::Status, |v: &mut Volume| {
            let st = v.status.get_or_insert_with(Default::default);
            set_condition(&mut st.conditions, SOURCE_IMPORTED, status, reason, message);
            st.progress = progress.clone();
        })
        .await;
    if let Err(e) = res {
        tracing::debug!(volume = %format!("{ns}/{name}"), error = %e, "setting Imported");
    }
}

/// Overall percent of an import: a download counts for 0–80 %, the copy
/// into the volume for the rest (all of it without a download).
fn overall_percent(p: &ImportProgress, downloaded: bool) -> Option<f64> {
    let frac = |p: &ImportProgress| {
        if p.total > 0 {
            p.done.min(p.total) as f64 / p.total as f64
        } else {
            0.0
        }
    };
    let (base, span) = if downloaded {
        (80.0, 20.0)
    } else {
        (0.0, 100.0)
    };
    match p.phase.as_str() {
        "downloading" if p.total > 0 => Some(80.0 * frac(p)),
        "downloading" => None,
        "converting" | "waiting" => Some(base),
        "copying" | "cloning" => Some(base + span * frac(p)),
        _ => None,
    }
}

fn progress_message(p: &ImportProgress) -> String {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    match p.phase.as_str() {
        "copying" if p.total > 0 => format!(
            "copying {:.1}/{:.1} MiB ({}%)",
            mib(p.done),
            mib(p.total),
            p.done * 100 / p.total
        ),
        "downloading" | "cloning" if p.total > 0 => format!(
            "{} {:.1}/{:.1} MiB ({}%)",
            p.phase,
            mib(p.done),
            mib(p.total),
            p.done * 100 / p.total
        ),
        "downloading" => format!("downloading {:.1} MiB", mib(p.done)),
        "waiting" => "waiting for the replicas".into(),
        "converting" => "converting qcow2 to raw".into(),
        other => format!("{other} {}", p.message).trim().to_string(),
    }
}

impl SourceImporter {
    /// Runs the importer until aborted.
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        let state = Arc::new(Mutex::new(State::default()));
        tokio::spawn(async move {
            loop {
                self.scan(&state).await;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    }

    async fn scan(&self, state: &Arc<Mutex<State>>) {
        let vols: Vec<Volume> = match self.store.list_typed(None, &ListOptions::default()).await {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(error = %e, "listing volumes");
                return;
            }
        };
        for v in vols {
            let Some(src) = v.spec.source.clone() else {
                continue;
            };
            let image = match (&src.image, &src.volume) {
                (Some(i), _) => i.clone(),
                (None, Some(c)) => format!("volume:{c}"),
                _ => continue,
            };
            let (Some(ns), Some(name)) = (v.metadata.namespace.clone(), v.metadata.name.clone())
            else {
                continue;
            };
            if v.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let st = v.status.clone().unwrap_or_default();
            if condition(&st.conditions, SOURCE_IMPORTED)
                .is_some_and(|c| c.status == ConditionStatus::True)
            {
                continue;
            }
            let key = format!("{ns}/{name}");
            {
                let mut g = lock(state);
                if g.running.contains(&key) || g.failed.get(&key) == Some(&image) {
                    continue;
                }
                g.running.insert(key.clone());
            }
            let me = self.clone();
            let state = state.clone();
            tokio::spawn(async move {
                let res = me.import(&ns, &name, &src).await;
                let mut g = lock(&state);
                g.running.remove(&key);
                if res.is_err() {
                    g.failed.insert(key, image);
                }
            });
        }
    }

    /// Fills `ns/name` from `src`; `Err` (recorded, not retried) on failure,
    /// `Ok` also while a clone waits for its source (retried next scan).
    async fn import(
        &self,
        ns: &str,
        name: &str,
        src: &sheaf_orchestrator::resources::sheaf::VolumeSource,
    ) -> Result<(), String> {
        let store = &self.store;
        let what = src
            .image
            .clone()
            .or_else(|| src.volume.as_ref().map(|v| format!("volume {ns}/{v}")))
            .unwrap_or_default();
        let fail = async |msg: String| {
            tracing::warn!(volume = %format!("{ns}/{name}"), source = %what, error = %msg, "volume source import failed");
            set_imported(
                store,
                ns,
                name,
                ConditionStatus::False,
                "ImportFailed",
                &msg,
                None,
            )
            .await;
            Err(msg)
        };
        let checked = match &src.image {
            Some(image) => match self.images.source(image) {
                Ok(s) => Some(s),
                Err(e) => return fail(e.to_string()).await,
            },
            None => None,
        };
        let clone_src = match (&checked, &src.volume) {
            (None, Some(c)) => match ready_source(store, ns, c).await {
                Ok(v) => Some(v),
                Err(CloneError::NotReady(m)) => {
                    set_imported(
                        store,
                        ns,
                        name,
                        ConditionStatus::False,
                        "Importing",
                        &m,
                        None,
                    )
                    .await;
                    return Ok(());
                }
                Err(CloneError::Failed(e)) => return fail(e.to_string()).await,
            },
            (None, None) => return Ok(()),
            _ => None,
        };
        tracing::info!(volume = %format!("{ns}/{name}"), source = %what, "filling the volume from its source");
        let first = if matches!(checked, Some(ImageSource::Url(_))) {
            "downloading"
        } else {
            "waiting for the replicas"
        };
        set_imported(
            store,
            ns,
            name,
            ConditionStatus::False,
            "Importing",
            first,
            Some("0.0%".into()),
        )
        .await;
        let downloaded = matches!(checked, Some(ImageSource::Url(_)));
        let (tx, mut rx) = mpsc::channel::<ImportProgress>(64);
        let reporter = {
            let store = store.clone();
            let (ns, name) = (ns.to_string(), name.to_string());
            tokio::spawn(async move {
                let mut last = Instant::now() - Duration::from_secs(1);
                while let Some(p) = rx.recv().await {
                    if last.elapsed() >= Duration::from_millis(500) {
                        last = Instant::now();
                        let msg = progress_message(&p);
                        let pct = overall_percent(&p, downloaded).map(|f| format!("{f:.1}%"));
                        set_imported(
                            &store,
                            &ns,
                            &name,
                            ConditionStatus::False,
                            "Importing",
                            &msg,
                            pct,
                        )
                        .await;
                    }
                }
            })
        };
        let t0 = Instant::now();
        let res = self.fill(ns, name, src, checked, clone_src, tx).await;
        let _ = reporter.await;
        match res {
            Ok(m) => {
                let msg = format!("{m} in {:.1} s", t0.elapsed().as_secs_f64());
                tracing::info!(volume = %format!("{ns}/{name}"), %msg, "volume source imported");
                set_imported(
                    store,
                    ns,
                    name,
                    ConditionStatus::True,
                    "Imported",
                    &msg,
                    Some("100.0%".into()),
                )
                .await;
                Ok(())
            }
            Err(e) => fail(e).await,
        }
    }

    /// The import proper: download or file, or clone; the final message.
    async fn fill(
        &self,
        ns: &str,
        name: &str,
        src: &sheaf_orchestrator::resources::sheaf::VolumeSource,
        checked: Option<ImageSource>,
        clone_src: Option<Volume>,
        tx: mpsc::Sender<ImportProgress>,
    ) -> Result<String, String> {
        let store = &self.store;
        if let Some(from) = clone_src {
            let dst = wait_available(store, ns, name, Duration::from_secs(60)).await?;
            let n = clone_into(store, &self.secret_file, &from, &dst, &self.metrics, &tx)
                .await
                .map_err(|e| e.to_string())?;
            return Ok(format!(
                "cloned from {ns}/{}, {n} bytes (full copy)",
                from.metadata.name.as_deref().unwrap_or_default()
            ));
        }
        let Some(checked) = checked else {
            return Err("no source".into());
        };
        let image = src.image.clone().unwrap_or_default();
        let mut _download = None;
        let mut digest = None;
        let path = match checked {
            ImageSource::File(_) if src.checksum.is_some() => {
                return Err(format!(
                    "image {image}: spec.source.checksum is checked for http(s) sources only"
                ));
            }
            ImageSource::File(p) => p,
            ImageSource::Url(url) => {
                let vol: Volume = store.get_typed(ns, name).await.map_err(|e| e.to_string())?;
                let size = parse_quantity_bytes(&vol.spec.size.0).unwrap_or(0);
                // A raw image must fit the volume; a qcow2 of a fitting
                // virtual size is at most a little larger (its metadata).
                let mut limits = self.limits.clone();
                limits.max_bytes = limits
                    .max_bytes
                    .min(size.saturating_add(size / 16).saturating_add(16 << 20));
                let d = download(
                    &url,
                    &self.tmp_dir,
                    &format!("{ns}-{name}"),
                    src.checksum.as_deref(),
                    &limits,
                    &tx,
                )
                .await
                .map_err(|e| e.to_string())?;
                let p = d.path.clone();
                digest = d.digest.clone();
                _download = Some(d); // removed when this function returns
                p
            }
        };
        let opts = ImportOptions {
            image,
            size: None,
            replicas: None,
        };
        let done = import_path(
            store,
            &self.secret_file,
            &self.tmp_dir,
            &path,
            ns,
            name,
            &opts,
            &self.metrics,
            tx,
        )
        .await
        .map_err(|e| e.to_string())?;
        Ok(match digest {
            Some(d) => format!("{}, {d} verified", done.message),
            None => done.message,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_readable() {
        let p = ImportProgress {
            phase: "copying".into(),
            done: 4 << 20,
            total: 16 << 20,
            message: String::new(),
        };
        assert_eq!(progress_message(&p), "copying 4.0/16.0 MiB (25%)");
        let p = ImportProgress {
            phase: "waiting".into(),
            done: 0,
            total: 0,
            message: "replicas".into(),
        };
        assert_eq!(progress_message(&p), "waiting for the replicas");
    }
}
