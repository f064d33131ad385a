// SPDX-License-Identifier: Apache-2.0
//! The catalog on the target: list, delete, garbage collection, retention.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use tracing::info;

use super::engine::check_id;
use super::{
    BackupError, BackupTarget, Manifest, backups_prefix, check_volume_name, chunks_prefix,
    manifest_key,
};

/// Reads and checks the manifest of backup `id` of `volume`.
pub async fn load_manifest(
    target: &dyn BackupTarget,
    volume: &str,
    id: &str,
) -> Result<Manifest, BackupError> {
    check_volume_name(volume)?;
    check_id(id)?;
    let key = manifest_key(volume, id);
    let bytes = target.get(&key).await?;
    let m = Manifest::decode(&key, &bytes)?;
    if m.volume != volume || m.id != id {
        return Err(BackupError::CorruptManifest {
            key,
            reason: format!("names backup {}/{}", m.volume, m.id),
        });
    }
    Ok(m)
}

/// The catalog: every backup of `volume` on the target, oldest first, read
/// from the target alone. A manifest that cannot be read is an error naming
/// it (so [`gc`] never runs on a partial catalog).
pub async fn list(target: &dyn BackupTarget, volume: &str) -> Result<Vec<Manifest>, BackupError> {
    check_volume_name(volume)?;
    let mut ids: Vec<String> = target
        .list(&backups_prefix(volume))
        .await?
        .into_iter()
        .filter_map(|o| {
            let name = o.key.rsplit('/').next()?;
            name.strip_suffix(".json").map(str::to_string)
        })
        .collect();
    ids.sort();
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        out.push(load_manifest(target, volume, &id).await?);
    }
    Ok(out)
}

/// Deletes backup `id` of `volume` (its manifest). Other backups stay
/// complete, also later incrementals of it: every manifest lists all its
/// chunks. Space comes back with [`gc`].
pub async fn delete(target: &dyn BackupTarget, volume: &str, id: &str) -> Result<(), BackupError> {
    check_volume_name(volume)?;
    check_id(id)?;
    let key = manifest_key(volume, id);
    // NotFound if there is no such backup.
    target.get(&key).await?;
    target.delete(&key).await?;
    info!(volume, id, "backup deleted");
    Ok(())
}

/// What [`gc`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Chunks still referenced by a backup.
    pub chunks_kept: u64,
    /// Unreferenced chunks deleted.
    pub chunks_deleted: u64,
    /// Their stored bytes.
    pub bytes_deleted: u64,
    /// Unreferenced chunks younger than the grace period, left in place.
    pub chunks_young: u64,
}

/// Deletes the chunks of `volume` that no backup references and that are
/// older than `grace` (so the chunks of a backup still running survive).
pub async fn gc(
    target: &dyn BackupTarget,
    volume: &str,
    grace: Duration,
) -> Result<GcReport, BackupError> {
    let manifests = list(target, volume).await?;
    let referenced: HashSet<&str> = manifests
        .iter()
        .flat_map(|m| m.chunks.iter().map(|c| c.sha256.as_str()))
        .collect();
    let now = SystemTime::now();
    let mut report = GcReport::default();
    for o in target.list(&chunks_prefix(volume)).await? {
        let sha = o.key.rsplit('/').next().unwrap_or_default();
        if referenced.contains(sha) {
            report.chunks_kept += 1;
        } else if now.duration_since(o.modified).unwrap_or_default() < grace {
            report.chunks_young += 1;
        } else {
            target.delete(&o.key).await?;
            report.chunks_deleted += 1;
            report.bytes_deleted += o.size;
        }
    }
    info!(volume, ?report, "backup gc done");
    Ok(report)
}

/// Keeps the newest `keep` backups of `volume`, deletes the older ones and
/// then runs [`gc`]. Returns the deleted ids and the gc report.
pub async fn retain(
    target: &dyn BackupTarget,
    volume: &str,
    keep: usize,
    grace: Duration,
) -> Result<(Vec<String>, GcReport), BackupError> {
    let manifests = list(target, volume).await?;
    let drop_n = manifests.len().saturating_sub(keep);
    let mut deleted = Vec::with_capacity(drop_n);
    for m in &manifests[..drop_n] {
        target.delete(&manifest_key(volume, &m.id)).await?;
        deleted.push(m.id.clone());
    }
    let report = gc(target, volume, grace).await?;
    Ok((deleted, report))
}

/// Checks that `target` is usable (what a backup-target setting should be
/// validated with): writes, reads back and deletes a probe object under
/// `probe/`. Refused credentials are [`BackupError::Auth`], a missing
/// bucket or directory a [`BackupError::Target`].
pub async fn check_target(target: &dyn BackupTarget) -> Result<(), BackupError> {
    let key = format!(
        "probe/{}-{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    let body = bytes::Bytes::from_static(b"sheaf backup target probe\n");
    target.put(&key, body.clone()).await?;
    let back = target.get(&key).await?;
    target.delete(&key).await?;
    if back != body {
        return Err(BackupError::Target {
            target: target.describe(),
            op: "probe",
            key,
            source: "the object read back differs from the one written".into(),
        });
    }
    Ok(())
}
