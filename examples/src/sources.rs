// SPDX-License-Identifier: Apache-2.0
//! Volume sources: a Volume applied with `spec.source.image` (a raw or
//! qcow2 file on the cluster host) is filled by the cluster process, so
//! `kubectl apply` of a VM and its Volume works without `sheaf image import`
//! first.
//!
//! ```text
//!   Volume (spec.source.image) ─► volume controller: replicas placed, served,
//!        │                         phase stays Creating until Imported=True
//!        ▼
//!   importer (this module, every second): Imported=False/Importing "copying 4.0/16.0 MiB (25%)"
//!        └─ import_image (same path as `sheaf image import`) ─► Imported=True "raw image, N bytes, epoch E"
//!                                                            └► Imported=False/ImportFailed "<error>"
//! ```
//!
//! A failed import is not retried for the same image path while the
//! cluster runs (fix the file, then change `spec.source.image` or delete
//! and re-create the volume, or restart the cluster); `http(s)://` sources
//! are refused with a clear condition message.

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

use crate::image::{ImportOptions, ImportProgress, import_image};
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
}

#[derive(Debug, Default)]
struct State {
    /// Volumes being imported.
    running: HashSet<String>,
    /// Volume → image path whose import failed.
    failed: HashMap<String, String>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets the `Imported` condition of `ns/name`.
async fn set_imported(
    store: &Arc<dyn Store>,
    ns: &str,
    name: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    let res = store
        .modify_typed(ns, name, UpdateScope::Status, |v: &mut Volume| {
            let st = v.status.get_or_insert_with(Default::default);
            set_condition(&mut st.conditions, SOURCE_IMPORTED, status, reason, message);
        })
        .await;
    if let Err(e) = res {
        tracing::debug!(volume = %format!("{ns}/{name}"), error = %e, "setting Imported");
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
            let Some(image) = v.spec.source.as_ref().and_then(|s| s.image.clone()) else {
                continue;
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
                let res = me.import(&ns, &name, &image).await;
                let mut g = lock(&state);
                g.running.remove(&key);
                if res.is_err() {
                    g.failed.insert(key, image);
                }
            });
        }
    }

    async fn import(&self, ns: &str, name: &str, image: &str) -> Result<(), String> {
        let store = &self.store;
        let fail = async |msg: String| {
            tracing::warn!(volume = %format!("{ns}/{name}"), %image, error = %msg, "image source import failed");
            set_imported(
                store,
                ns,
                name,
                ConditionStatus::False,
                "ImportFailed",
                &msg,
            )
            .await;
            Err(msg)
        };
        if image.starts_with("http://") || image.starts_with("https://") {
            return fail(format!(
                "image {image}: URLs are not supported yet; give an absolute path of a raw or \
                 qcow2 file inside an image directory"
            ))
            .await;
        }
        if let Err(e) = self.images.resolve(image) {
            return fail(e.to_string()).await;
        }
        tracing::info!(volume = %format!("{ns}/{name}"), %image, "importing the volume's image source");
        set_imported(
            store,
            ns,
            name,
            ConditionStatus::False,
            "Importing",
            "waiting for the replicas",
        )
        .await;
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
                        set_imported(
                            &store,
                            &ns,
                            &name,
                            ConditionStatus::False,
                            "Importing",
                            &msg,
                        )
                        .await;
                    }
                }
            })
        };
        let opts = ImportOptions {
            image: image.to_string(),
            size: None,
            replicas: None,
        };
        let t0 = Instant::now();
        let res = import_image(
            store,
            &self.secret_file,
            &self.tmp_dir,
            &self.images,
            ns,
            name,
            &opts,
            &self.metrics,
            tx,
        )
        .await;
        let _ = reporter.await;
        match res {
            Ok(p) => {
                let msg = format!("{} in {:.1} s", p.message, t0.elapsed().as_secs_f64());
                tracing::info!(volume = %format!("{ns}/{name}"), %msg, "image source imported");
                set_imported(store, ns, name, ConditionStatus::True, "Imported", &msg).await;
                Ok(())
            }
            Err(e) => fail(e.to_string()).await,
        }
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
