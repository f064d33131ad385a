// SPDX-License-Identifier: Apache-2.0
//! Fencing: before an instance of a lost node is started elsewhere, every
//! volume it had attached gets a higher epoch on enough replicas that the
//! old engine can never complete another write (RELIABILITY.md D3).
//!
//! blockrepl replicas persist the highest epoch they accepted and refuse
//! requests from lower epochs; a write needs `W` replicas, and an attach
//! reaches `R = N − W + 1` of them, so after one attach at a higher epoch
//! no `W`-set is left that would accept the old epoch.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use async_trait::async_trait;
use sheaf_blockrepl::net::Secret;
use sheaf_blockrepl::volume::{Volume as BlockVolume, VolumeConfig};
use tracing::info;

use super::util::ns_name;
use crate::resources::Volume;

/// Raises a volume's epoch on its replicas.
#[async_trait]
pub trait Fencer: Send + Sync + fmt::Debug + 'static {
    /// Makes the volume's replicas refuse every epoch below `epoch` (at
    /// least a read quorum of them must take it). Returns the epoch the
    /// replicas now hold, which may be higher. Errors when too few replicas
    /// answer: the caller must then not start the volume elsewhere.
    async fn fence(&self, volume: &Volume, epoch: u64) -> Result<u64, String>;
}

/// Fences through a short-lived blockrepl engine: attach at `epoch`, detach.
pub struct BlockreplFencer {
    secret: Secret,
    timeout: Duration,
}

impl fmt::Debug for BlockreplFencer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockreplFencer")
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl BlockreplFencer {
    /// A fencer using the cluster's replication secret; gives up after `timeout`.
    pub fn new(secret: Secret, timeout: Duration) -> Self {
        BlockreplFencer { secret, timeout }
    }
}

/// The replica addresses of a volume, in status order.
pub fn replica_addrs(vol: &Volume) -> Vec<SocketAddr> {
    vol.status
        .iter()
        .flat_map(|s| s.replicas.iter().flatten())
        .filter_map(|r| r.address.as_deref()?.parse().ok())
        .collect()
}

#[async_trait]
impl Fencer for BlockreplFencer {
    async fn fence(&self, volume: &Volume, epoch: u64) -> Result<u64, String> {
        let addrs = replica_addrs(volume);
        if addrs.is_empty() {
            // No replica was ever served: nothing can hold a write.
            return Ok(epoch);
        }
        let mut cfg = VolumeConfig::remote(&addrs, self.secret.clone());
        let w = volume.spec.min_write_replicas.unwrap_or(2) as usize;
        cfg.min_write_replicas = Some(w.clamp(1, addrs.len()));
        cfg.min_epoch = epoch.saturating_sub(1);
        cfg.attach_timeout = self.timeout;
        cfg.request_timeout = Duration::from_secs(1);
        let v = BlockVolume::attach(cfg)
            .await
            .map_err(|e| format!("attach at epoch {epoch}: {e}"))?;
        let st = v.status().await.map_err(|e| e.to_string())?;
        let _ = v.detach().await;
        info!(volume = %ns_name(volume), epoch = st.epoch, "volume fenced");
        Ok(st.epoch)
    }
}
