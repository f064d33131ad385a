// SPDX-License-Identifier: Apache-2.0
//! Guest I/O latency of a launcher's disks: one histogram per disk and
//! operation (read, write, flush), kept by the runtime's disk backend (the
//! sheaf-vmm runtime times every virtio-blk request it serves from the
//! volume) and written by the launcher about once a second to
//! `io-metrics.json` in its directory ([`super::files::IO_METRICS`]), where
//! node tooling and the cluster binary's `/metrics` read it.
//!
//! ```text
//!   guest virtio-blk ─► TimedBackend (DiskIoStats) ─► VolumeBackend ─► engine ─► replicas
//!                               │ every second
//!                               ▼
//!                     <launcher dir>/io-metrics.json  (IoMetrics: cumulative snapshots)
//! ```
//!
//! The counters live as long as the launcher: a new instance (restart,
//! failover, migration) starts from zero, like a Prometheus counter reset.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Upper bounds (seconds) of the latency buckets (`+Inf` is implied).
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// A lock-free latency histogram of one operation.
#[derive(Debug, Default)]
pub struct OpHistogram {
    /// Observations per bucket (not cumulative); the last slot is `+Inf`.
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    count: AtomicU64,
    sum_nanos: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
}

impl OpHistogram {
    /// Records one operation of `bytes` that took `d` (`ok`: it succeeded).
    pub fn observe(&self, d: Duration, bytes: u64, ok: bool) {
        let s = d.as_secs_f64();
        let i = LATENCY_BUCKETS
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(
            u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if !ok {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// A cumulative snapshot (Prometheus `le` buckets).
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut acc = 0;
        let buckets = LATENCY_BUCKETS
            .iter()
            .enumerate()
            .map(|(i, _)| {
                acc += self.buckets[i].load(Ordering::Relaxed);
                acc
            })
            .collect();
        HistogramSnapshot {
            buckets,
            count: self.count.load(Ordering::Relaxed),
            sum_seconds: self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            bytes: self.bytes.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

/// Cumulative state of one histogram.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HistogramSnapshot {
    /// Observations `<=` each of [`LATENCY_BUCKETS`] (cumulative).
    pub buckets: Vec<u64>,
    /// All observations (the `+Inf` bucket).
    pub count: u64,
    /// Sum of the latencies.
    pub sum_seconds: f64,
    /// Bytes moved.
    #[serde(default)]
    pub bytes: u64,
    /// Operations that failed (counted in the histogram too).
    #[serde(default)]
    pub errors: u64,
}

/// The live counters of one disk.
#[derive(Debug, Default)]
pub struct DiskIoStats {
    /// Reads.
    pub read: OpHistogram,
    /// Writes (including write-zeroes and discards).
    pub write: OpHistogram,
    /// Flushes.
    pub flush: OpHistogram,
}

impl DiskIoStats {
    /// A snapshot labelled with the disk and its volume.
    pub fn snapshot(&self, disk: &str, volume: &str) -> DiskIoMetrics {
        DiskIoMetrics {
            disk: disk.to_string(),
            volume: volume.to_string(),
            read: self.read.snapshot(),
            write: self.write.snapshot(),
            flush: self.flush.snapshot(),
        }
    }
}

/// One disk in `io-metrics.json`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DiskIoMetrics {
    /// Disk name in the instance spec.
    pub disk: String,
    /// `namespace/name` of the Volume.
    pub volume: String,
    /// Reads.
    pub read: HistogramSnapshot,
    /// Writes.
    pub write: HistogramSnapshot,
    /// Flushes.
    pub flush: HistogramSnapshot,
}

/// `io-metrics.json`: guest I/O of one launcher.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IoMetrics {
    /// Instance `namespace/name`.
    pub instance: String,
    /// Instance uid.
    pub uid: String,
    /// Whether the disks are timed (`false`: the runtime serves them
    /// without going through a timed backend, e.g. QEMU over NBD).
    pub timed: bool,
    /// Per disk.
    pub disks: Vec<DiskIoMetrics>,
}

impl IoMetrics {
    /// Writes `dir/io-metrics.json` atomically.
    pub fn save(&self, dir: &Path) -> std::io::Result<()> {
        let tmp = dir.join(".io-metrics.json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec(self).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(tmp, dir.join(super::files::IO_METRICS))
    }

    /// Reads `dir/io-metrics.json` (`None` if absent or unreadable).
    pub fn load(dir: &Path) -> Option<IoMetrics> {
        let b = std::fs::read(dir.join(super::files::IO_METRICS)).ok()?;
        serde_json::from_slice(&b).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_is_cumulative() {
        let h = OpHistogram::default();
        h.observe(Duration::from_micros(50), 512, true);
        h.observe(Duration::from_millis(3), 4096, true);
        h.observe(Duration::from_secs(10), 0, false);
        let s = h.snapshot();
        assert_eq!(s.count, 3);
        assert_eq!(s.buckets[0], 1);
        assert_eq!(s.buckets[5], 2); // <= 5 ms
        assert_eq!(*s.buckets.last().unwrap_or(&0), 2); // 10 s only in +Inf
        assert_eq!(s.bytes, 4608);
        assert_eq!(s.errors, 1);
        assert!(
            (s.sum_seconds - 10.003_05).abs() < 1e-6,
            "{}",
            s.sum_seconds
        );
    }

    #[test]
    fn file_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let st = DiskIoStats::default();
        st.write.observe(Duration::from_millis(1), 4096, true);
        let m = IoMetrics {
            instance: "default/demo".into(),
            uid: "u".into(),
            timed: true,
            disks: vec![st.snapshot("root", "default/disk")],
        };
        m.save(dir.path()).unwrap();
        assert_eq!(IoMetrics::load(dir.path()), Some(m));
    }
}
