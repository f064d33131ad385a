// SPDX-License-Identifier: Apache-2.0
//! Image import: a raw or qcow2 file on the cluster host becomes the
//! contents of a replicated sheaf Volume.
//!
//! ```text
//!   qemu-img info ─► size, format ─► Volume (create or reuse) ─► Available
//!     └ qcow2: qemu-img convert -O raw (sparse, in <data>/tmp)
//!   blockrepl engine attach (epoch > the volume's) ─► 1 MiB writes
//!   (all-zero chunks skipped) ─► flush ─► detach ─► status.epoch recorded
//! ```
//!
//! The import attaches the volume like a launcher does, with a higher epoch
//! than any attachment so far, and records the epoch it used in the
//! Volume's status, so the next instance attaches above it. If an instance
//! attaches the volume during the import, the import's engine is fenced and
//! the import fails.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sheaf_blockrepl::net::Secret;
use sheaf_blockrepl::volume::{Volume as BlockVolume, VolumeConfig};
use sheaf_orchestrator::controllers::fence::replica_addrs;
use sheaf_orchestrator::controllers::util::condition_true;
use sheaf_orchestrator::controllers::volume::SOURCE_IMPORTED;
use sheaf_orchestrator::images::ImagePolicy;
use sheaf_orchestrator::names;
use sheaf_orchestrator::resources::Volume;
use sheaf_orchestrator::resources::sheaf::{ReplicaState, VolumePhase};
use sheaf_orchestrator::store::{GroupKind, Store, StoreError, StoreExt, UpdateScope};
use tokio::sync::mpsc;

use crate::metrics::Metrics;

/// Chunk written per request.
pub const CHUNK: usize = 1 << 20;

/// Annotation recording where a volume's contents came from.
pub const IMAGE_ANNOTATION: &str = "sheaf.dev/imported-image";

/// What to import.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImportOptions {
    /// Absolute path of a raw or qcow2 image on the cluster host.
    pub image: String,
    /// Volume size in bytes (default: the image's virtual size rounded up to 1 MiB).
    #[serde(default)]
    pub size: Option<u64>,
    /// Replicas of a new volume (default 3).
    #[serde(default)]
    pub replicas: Option<u32>,
}

/// One progress line of an import.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ImportProgress {
    /// `downloading`, `converting`, `waiting`, `copying`, `cloning`, `done` or `error`.
    pub phase: String,
    /// Bytes handled.
    #[serde(default)]
    pub done: u64,
    /// Bytes to handle.
    #[serde(default)]
    pub total: u64,
    /// Details (error message, format, epoch).
    #[serde(default)]
    pub message: String,
}

impl ImportProgress {
    /// A progress line.
    pub fn new(phase: &str, done: u64, total: u64, message: impl Into<String>) -> Self {
        ImportProgress {
            phase: phase.into(),
            done,
            total,
            message: message.into(),
        }
    }
    /// A final error line.
    pub fn error(message: String) -> Self {
        Self::new("error", 0, 0, message)
    }
}

/// Import failures.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The image file.
    #[error("image {path}: {message}")]
    Image {
        /// File.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The Volume object.
    #[error("volume {volume}: {message}")]
    Volume {
        /// `ns/name`.
        volume: String,
        /// Why.
        message: String,
    },
    /// The store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Block I/O through the replicated engine.
    #[error("writing volume {volume}: {message}")]
    Io {
        /// `ns/name`.
        volume: String,
        /// Why.
        message: String,
    },
}

/// Format and virtual size of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    /// `raw` or `qcow2`.
    pub format: String,
    /// Guest-visible size in bytes.
    pub virtual_size: u64,
}

fn img_err(path: &Path, message: impl Into<String>) -> ImportError {
    ImportError::Image {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Reads an image's format and size: qcow2 is recognised by its magic
/// (`QFI\xfb`), checked (no backing or data file) and sized with a
/// confined `qemu-img info`; everything else is raw.
pub async fn probe_image(path: &Path) -> Result<ImageInfo, ImportError> {
    let mut f = std::fs::File::open(path).map_err(|e| img_err(path, e.to_string()))?;
    let meta = f.metadata().map_err(|e| img_err(path, e.to_string()))?;
    if !meta.is_file() {
        return Err(img_err(path, "not a regular file"));
    }
    let mut magic = [0u8; 4];
    let n = f
        .read(&mut magic)
        .map_err(|e| img_err(path, e.to_string()))?;
    if n == 4 && &magic == b"QFI\xfb" {
        let size = crate::qemu_img::qcow2_size(path)
            .await
            .map_err(|e| img_err(path, e.to_string()))?;
        return Ok(ImageInfo {
            format: "qcow2".into(),
            virtual_size: size,
        });
    }
    if meta.len() == 0 {
        return Err(img_err(path, "empty image"));
    }
    Ok(ImageInfo {
        format: "raw".into(),
        virtual_size: meta.len(),
    })
}

fn round_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

/// Imports `opts.image` into Volume `ns/name` (created if missing), sending
/// progress lines to `tx`; returns the final (`done`) line.
#[allow(clippy::too_many_arguments)]
pub async fn import_image(
    store: &Arc<dyn Store>,
    secret_file: &Path,
    tmp_dir: &Path,
    images: &ImagePolicy,
    ns: &str,
    name: &str,
    opts: &ImportOptions,
    metrics: &Metrics,
    tx: mpsc::Sender<ImportProgress>,
) -> Result<ImportProgress, ImportError> {
    // Only a file inside an image directory, symbolic links resolved.
    let path = images
        .resolve(&opts.image)
        .map_err(|e| img_err(Path::new(&opts.image), e.to_string()))?;
    import_path(
        store,
        secret_file,
        tmp_dir,
        &path,
        ns,
        name,
        opts,
        metrics,
        tx,
    )
    .await
}

/// Imports the already checked file `path` (resolved through the image
/// policy, or a download under the data dir's tmp) into Volume `ns/name`;
/// `opts.image` is what the volume's annotation records (path or URL).
#[allow(clippy::too_many_arguments)]
pub async fn import_path(
    store: &Arc<dyn Store>,
    secret_file: &Path,
    tmp_dir: &Path,
    path: &Path,
    ns: &str,
    name: &str,
    opts: &ImportOptions,
    metrics: &Metrics,
    tx: mpsc::Sender<ImportProgress>,
) -> Result<ImportProgress, ImportError> {
    let path = path.to_path_buf();
    let vname = format!("{ns}/{name}");
    let vol_err = |m: String| ImportError::Volume {
        volume: vname.clone(),
        message: m,
    };
    let info = probe_image(&path).await?;
    let size = opts
        .size
        .unwrap_or_else(|| round_up(info.virtual_size, 1 << 20));
    if size < info.virtual_size || !size.is_multiple_of(4096) {
        return Err(vol_err(format!(
            "size {size} must be a multiple of 4096 and hold the image ({} bytes)",
            info.virtual_size
        )));
    }

    // The volume: reuse (if big enough and idle) or create.
    let existing = match store.get_typed::<Volume>(ns, name).await {
        Ok(v) => Some(v),
        Err(StoreError::NotFound { .. }) => None,
        Err(e) => return Err(e.into()),
    };
    if let Some(v) = &existing {
        let cap = sheaf_orchestrator::resources::parse_quantity_bytes(&v.spec.size.0).unwrap_or(0);
        if cap < info.virtual_size {
            return Err(vol_err(format!(
                "exists with {cap} bytes, the image needs {}",
                info.virtual_size
            )));
        }
    } else {
        let obj = json!({
            "apiVersion": "sheaf.dev/v1", "kind": "Volume",
            "metadata": {"name": name, "namespace": ns,
                "annotations": {IMAGE_ANNOTATION: opts.image}},
            "spec": {"size": size.to_string(), "replicas": opts.replicas.unwrap_or(3)},
        });
        store
            .create(&GroupKind::of::<Volume>(), ns, obj)
            .await
            .map_err(|e| vol_err(e.to_string()))?;
    }
    let _ = tx
        .send(ImportProgress::new(
            "waiting",
            0,
            info.virtual_size,
            "replicas",
        ))
        .await;
    let vol = wait_available(store, ns, name, Duration::from_secs(60))
        .await
        .map_err(vol_err)?;
    if let Some(a) = vol.status.as_ref().and_then(|s| s.attachment.as_ref()) {
        return Err(vol_err(format!(
            "attached to {} on {}; stop it before importing",
            a.instance.as_deref().unwrap_or("?"),
            a.node_name
        )));
    }

    // qcow2 → sparse raw next to the data.
    let mut converted = None;
    let raw_path = if info.format == "qcow2" {
        let _ = tx
            .send(ImportProgress::new(
                "converting",
                0,
                info.virtual_size,
                "qcow2 → raw",
            ))
            .await;
        std::fs::create_dir_all(tmp_dir).map_err(|e| img_err(tmp_dir, e.to_string()))?;
        let out = names::child(tmp_dir, &format!("import-{ns}-{name}.raw"))
            .map_err(|e| img_err(tmp_dir, e.to_string()))?;
        // Removed on failure too (a partial conversion can be large).
        if let Err(e) = crate::qemu_img::convert_to_raw(&path, &out).await {
            let _ = std::fs::remove_file(&out);
            return Err(img_err(&path, e.to_string()));
        }
        converted = Some(out.clone());
        out
    } else {
        path.clone()
    };
    let res = copy_into(
        store,
        secret_file,
        &vol,
        &raw_path,
        info.virtual_size,
        metrics,
        &tx,
    )
    .await;
    if let Some(c) = converted {
        let _ = std::fs::remove_file(c);
    }
    let epoch = res?;
    store
        .modify_typed(ns, name, UpdateScope::Main, |v: &mut Volume| {
            v.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(IMAGE_ANNOTATION.into(), opts.image.clone());
        })
        .await?;
    Ok(ImportProgress::new(
        "done",
        info.virtual_size,
        info.virtual_size,
        format!(
            "{} image, {} bytes, epoch {epoch}",
            info.format, info.virtual_size
        ),
    ))
}

/// A volume with a pending `spec.source` (image or clone) stays `Creating` (no
/// instance may attach it); it can be imported into once every replica is
/// served and at least `minWriteReplicas` are healthy.
fn source_ready(v: &Volume) -> bool {
    let Some(st) = &v.status else { return false };
    let pending = v
        .spec
        .source
        .as_ref()
        .is_some_and(|s| s.image.is_some() || s.volume.is_some())
        && !condition_true(&st.conditions, SOURCE_IMPORTED);
    let reps = st.replicas.clone().unwrap_or_default();
    let w = v
        .spec
        .min_write_replicas
        .unwrap_or(2)
        .clamp(1, reps.len().max(1) as u32) as usize;
    let healthy = reps
        .iter()
        .filter(|r| r.state == Some(ReplicaState::Healthy))
        .count();
    pending
        && st.phase == Some(VolumePhase::Creating)
        && !reps.is_empty()
        && reps.iter().all(|r| r.address.is_some())
        && healthy >= w
}

/// Waits until `ns/name` can be written (served, or pending its source).
pub async fn wait_available(
    store: &Arc<dyn Store>,
    ns: &str,
    name: &str,
    timeout: Duration,
) -> Result<Volume, String> {
    let t0 = Instant::now();
    loop {
        let v: Volume = store.get_typed(ns, name).await.map_err(|e| e.to_string())?;
        let phase = v.status.as_ref().and_then(|s| s.phase);
        if matches!(
            phase,
            Some(VolumePhase::Available | VolumePhase::Degraded | VolumePhase::Attached)
        ) || source_ready(&v)
        {
            return Ok(v);
        }
        if t0.elapsed() > timeout {
            return Err(format!(
                "not available after {timeout:?} (phase {phase:?}); are enough nodes Ready?"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Attaches a replicated engine to `vol` above every epoch so far and
/// records its epoch in the Volume's status (the next attachment must go
/// above it): (engine, epoch).
pub async fn attach_engine(
    store: &Arc<dyn Store>,
    secret_file: &Path,
    vol: &Volume,
) -> Result<(BlockVolume, u64), ImportError> {
    let ns = vol.metadata.namespace.clone().unwrap_or_default();
    let name = vol.metadata.name.clone().unwrap_or_default();
    let vname = format!("{ns}/{name}");
    let io_err = |m: String| ImportError::Io {
        volume: vname.clone(),
        message: m,
    };
    let secret = Secret::from_file(secret_file).map_err(|e| io_err(format!("secret: {e}")))?;
    let addrs = replica_addrs(vol);
    if addrs.is_empty() {
        return Err(io_err("no replica is served yet".into()));
    }
    let st = vol.status.clone().unwrap_or_default();
    let mut cfg = VolumeConfig::remote(&addrs, secret);
    let w = vol.spec.min_write_replicas.unwrap_or(2) as usize;
    cfg.min_write_replicas = Some(w.clamp(1, addrs.len()));
    cfg.min_epoch = st.epoch.unwrap_or(0);
    cfg.attach_timeout = Duration::from_secs(20);
    let engine = BlockVolume::attach(cfg)
        .await
        .map_err(|e| io_err(format!("attach: {e}")))?;
    let epoch = match engine.status().await {
        Ok(s) => s.epoch,
        Err(e) => {
            let _ = engine.detach().await;
            return Err(io_err(e.to_string()));
        }
    };
    let rec = store
        .modify_typed(&ns, &name, UpdateScope::Status, |v: &mut Volume| {
            let s = v.status.get_or_insert_with(Default::default);
            s.epoch = Some(s.epoch.unwrap_or(0).max(epoch));
        })
        .await;
    if let Err(e) = rec {
        let _ = engine.detach().await;
        return Err(e.into());
    }
    Ok((engine, epoch))
}

/// Writes the raw file into the volume; returns the engine's epoch.
async fn copy_into(
    store: &Arc<dyn Store>,
    secret_file: &Path,
    vol: &Volume,
    raw: &Path,
    len: u64,
    metrics: &Metrics,
    tx: &mpsc::Sender<ImportProgress>,
) -> Result<u64, ImportError> {
    let ns = vol.metadata.namespace.clone().unwrap_or_default();
    let name = vol.metadata.name.clone().unwrap_or_default();
    let vname = format!("{ns}/{name}");
    let io_err = |m: String| ImportError::Io {
        volume: vname.clone(),
        message: m,
    };
    let (engine, epoch) = attach_engine(store, secret_file, vol).await?;
    let result = async {
        let mut f =
            std::fs::File::open(raw).map_err(|e| io_err(format!("{}: {e}", raw.display())))?;
        let mut off = 0u64;
        let mut buf = vec![0u8; CHUNK];
        let mut last_report = Instant::now();
        while off < len {
            let want = ((len - off) as usize).min(CHUNK);
            f.read_exact(&mut buf[..want])
                .map_err(|e| io_err(format!("{} at {off}: {e}", raw.display())))?;
            let padded = round_up(want as u64, 4096) as usize;
            buf[want..padded].fill(0);
            if buf[..padded].iter().any(|b| *b != 0) {
                let t = Instant::now();
                engine
                    .write(off, Bytes::copy_from_slice(&buf[..padded]))
                    .await
                    .map_err(|e| io_err(format!("write at {off}: {e}")))?;
                metrics.observe_io(&vname, "write", t.elapsed(), padded as u64);
            }
            off += want as u64;
            if last_report.elapsed() > Duration::from_millis(100) || off >= len {
                last_report = Instant::now();
                let _ = tx.send(ImportProgress::new("copying", off, len, "")).await;
            }
        }
        let t = Instant::now();
        engine
            .flush()
            .await
            .map_err(|e| io_err(format!("flush: {e}")))?;
        metrics.observe_io(&vname, "flush", t.elapsed(), 0);
        Ok::<_, ImportError>(())
    }
    .await;
    let _ = engine.detach().await;
    result.map(|_| epoch)
}

/// Writes a demo disk image for the probe guest: `records` valid records
/// of its on-disk log (`probe.log`, base sector 2048), so the guest prints
/// `log: found <records> records` when it boots from the imported volume.
pub fn write_probe_disk(path: &Path, size: u64, records: u64, token: &str) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::File::create(path)?;
    f.set_len(size)?;
    for k in 0..records {
        let rec = probe_log_record(k, token.as_bytes());
        f.seek(SeekFrom::Start((2048 + 8 * k) * 512))?;
        f.write_all(&rec)?;
    }
    f.sync_all()
}

fn fnv1a(data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Record `k` of the probe guest's log (vmm/guest/probe.rs `log_record`).
pub fn probe_log_record(k: u64, token: &[u8]) -> [u8; 512] {
    let mut out = [0u8; 512];
    out[..8].copy_from_slice(b"SHEAFLOG");
    out[8..16].copy_from_slice(&k.to_le_bytes());
    let n = token.len().min(32);
    out[16..16 + n].copy_from_slice(&token[..n]);
    for (i, b) in out.iter_mut().enumerate().take(504).skip(48) {
        *b = (k.wrapping_mul(31).wrapping_add(i as u64) & 0xff) as u8;
    }
    let sum = fnv1a(&out[..504]);
    out[504..].copy_from_slice(&sum.to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn raw_and_qcow2_are_recognised() {
        let d = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let raw = d.path().join("a.raw");
        write_probe_disk(&raw, 4 << 20, 3, "t").unwrap_or_else(|e| panic!("{e}"));
        let i = probe_image(&raw).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            i,
            ImageInfo {
                format: "raw".into(),
                virtual_size: 4 << 20
            }
        );
        let q = d.path().join("a.qcow2");
        let st = std::process::Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "qcow2"])
            .arg(&raw)
            .arg(&q)
            .status();
        if st.is_ok_and(|s| s.success()) {
            let i = probe_image(&q).await.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                i,
                ImageInfo {
                    format: "qcow2".into(),
                    virtual_size: 4 << 20
                }
            );
        }
        assert!(probe_image(&d.path().join("missing")).await.is_err());
        let empty = d.path().join("empty");
        std::fs::write(&empty, b"").unwrap_or_else(|e| panic!("{e}"));
        assert!(
            probe_image(&empty)
                .await
                .unwrap_err()
                .to_string()
                .contains("empty image")
        );
    }

    /// Issue 18 item 2: each crafted qcow2 that would make qemu-img read
    /// another host file or a network server is refused before conversion.
    #[tokio::test]
    async fn crafted_qcow2_images_are_refused() {
        if std::process::Command::new("qemu-img")
            .arg("--version")
            .output()
            .is_err()
        {
            eprintln!("SKIP: no qemu-img (scripts/setup installs qemu-utils)");
            return;
        }
        let d = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let secret = d.path().join("secret");
        std::fs::write(&secret, vec![b's'; 1 << 20]).unwrap_or_else(|e| panic!("{e}"));
        let create = |name: &str, args: &[&str]| {
            let p = d.path().join(name);
            let st = std::process::Command::new("qemu-img")
                .args(["create", "-f", "qcow2"])
                .args(args)
                .arg(&p)
                .arg("1M")
                .output()
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(
                st.status.success(),
                "{}",
                String::from_utf8_lossy(&st.stderr)
            );
            p
        };
        let sec = secret.to_str().unwrap_or_default();
        let json_backing = format!("json:{{\"file.driver\":\"file\",\"file.filename\":\"{sec}\"}}");
        let data_file = format!("data_file={}", d.path().join("data.raw").display());
        let cases = [
            (
                "backing.qcow2",
                vec!["-u", "-F", "raw", "-b", sec],
                "backing file",
            ),
            (
                "json.qcow2",
                vec!["-u", "-F", "raw", "-b", json_backing.as_str()],
                "backing file",
            ),
            (
                "nbd.qcow2",
                vec!["-u", "-F", "raw", "-b", "nbd:127.0.0.1:10809"],
                "backing file",
            ),
            (
                "datafile.qcow2",
                vec!["-o", data_file.as_str()],
                "data file",
            ),
        ];
        for (name, args, want) in cases {
            let p = create(name, &args);
            let e = probe_image(&p).await.unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("refused"), "{name}: {e}");
        }
        // A qcow2 header that lies (truncated after the magic).
        let t = d.path().join("truncated.qcow2");
        std::fs::write(&t, b"QFI\xfb\0\0\0\x03").unwrap_or_else(|e| panic!("{e}"));
        assert!(probe_image(&t).await.is_err());
        // A plain qcow2 still passes.
        let ok = create("plain.qcow2", &[]);
        assert_eq!(
            probe_image(&ok)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .virtual_size,
            1 << 20
        );
    }

    #[test]
    fn records_match_the_probe_format() {
        let r = probe_log_record(5, b"x");
        assert_eq!(&r[..8], b"SHEAFLOG");
        assert_eq!(
            u64::from_le_bytes(r[8..16].try_into().unwrap_or_default()),
            5
        );
        assert_eq!(
            u64::from_le_bytes(r[504..].try_into().unwrap_or_default()),
            fnv1a(&r[..504])
        );
    }
}
