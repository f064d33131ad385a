// SPDX-License-Identifier: Apache-2.0
//! The reference in-memory target (tests, docs, measuring the engine
//! without a store behind it).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::SystemTime;

use bytes::Bytes;

use super::{BackupError, BackupTarget, ObjectInfo, check_key, check_prefix};

/// Objects in a map; lost with the process.
#[derive(Debug, Default)]
pub struct MemoryTarget {
    objects: Mutex<BTreeMap<String, (Bytes, SystemTime)>>,
}

impl MemoryTarget {
    /// An empty target.
    pub fn new() -> MemoryTarget {
        MemoryTarget::default()
    }

    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (Bytes, SystemTime)>> {
        // A panic while holding the lock cannot leave the map inconsistent
        // (every operation is one map call).
        self.objects
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[async_trait::async_trait]
impl BackupTarget for MemoryTarget {
    async fn put(&self, key: &str, data: Bytes) -> Result<(), BackupError> {
        check_key(key)?;
        self.map()
            .insert(key.to_string(), (data, SystemTime::now()));
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Bytes, BackupError> {
        check_key(key)?;
        self.map()
            .get(key)
            .map(|(b, _)| b.clone())
            .ok_or_else(|| BackupError::NotFound {
                key: key.to_string(),
            })
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackupError> {
        check_prefix(prefix)?;
        Ok(self
            .map()
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (b, t))| ObjectInfo {
                key: k.clone(),
                size: b.len() as u64,
                modified: *t,
            })
            .collect())
    }

    async fn delete(&self, key: &str) -> Result<(), BackupError> {
        check_key(key)?;
        self.map().remove(key);
        Ok(())
    }

    fn describe(&self) -> String {
        "memory".into()
    }
}
