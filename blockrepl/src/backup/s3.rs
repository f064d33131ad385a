// SPDX-License-Identifier: Apache-2.0
//! A backup target in an S3-compatible bucket, through the `object_store`
//! crate (SigV4 signing, retries, path- or virtual-hosted-style requests).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{BackoffConfig, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig};

use super::{BackupError, BackupTarget, ObjectInfo, check_key, check_prefix};

/// How to reach an S3-compatible bucket.
#[derive(Clone)]
pub struct S3Config {
    /// Endpoint URL, e.g. `http://127.0.0.1:9000`; `None` for AWS itself.
    pub endpoint: Option<String>,
    /// Bucket name (the bucket must exist).
    pub bucket: String,
    /// Region (`us-east-1` for most S3-compatible servers).
    pub region: String,
    /// Access key id.
    pub access_key_id: String,
    /// Secret access key.
    pub secret_access_key: String,
    /// Allow plain `http://` endpoints (tests, in-cluster servers).
    pub allow_http: bool,
    /// Virtual-hosted-style requests (`bucket.host`) instead of path style
    /// (`host/bucket`); most self-hosted servers want path style.
    pub virtual_hosted_style: bool,
    /// Key prefix inside the bucket (a folder, without trailing `/`), so
    /// several clusters can share a bucket.
    pub prefix: Option<String>,
    /// Retries of a failed request (server errors, timeouts, connection
    /// failures) before the operation fails.
    pub max_retries: usize,
    /// Time after which a request is not retried any more.
    pub retry_timeout: Duration,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field("allow_http", &self.allow_http)
            .field("virtual_hosted_style", &self.virtual_hosted_style)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl S3Config {
    /// A path-style configuration for `bucket` at `endpoint` with static
    /// credentials, region `us-east-1`, 3 retries within 30 s.
    pub fn new(
        endpoint: impl Into<String>,
        bucket: impl Into<String>,
        access_key_id: impl Into<String>,
        secret_access_key: impl Into<String>,
    ) -> S3Config {
        let endpoint: String = endpoint.into();
        S3Config {
            allow_http: endpoint.starts_with("http://"),
            endpoint: Some(endpoint),
            bucket: bucket.into(),
            region: "us-east-1".into(),
            access_key_id: access_key_id.into(),
            secret_access_key: secret_access_key.into(),
            virtual_hosted_style: false,
            prefix: None,
            max_retries: 3,
            retry_timeout: Duration::from_secs(30),
        }
    }
}

/// An S3-compatible bucket as a [`BackupTarget`].
#[derive(Debug, Clone)]
pub struct S3Target {
    store: Arc<dyn ObjectStore>,
    name: String,
    bucket: String,
    prefix: Option<String>,
}

impl S3Target {
    /// Builds the client (no request is sent: wrong credentials show up as
    /// [`BackupError::Auth`] on the first operation).
    pub fn new(cfg: &S3Config) -> Result<S3Target, BackupError> {
        if let Some(p) = &cfg.prefix {
            check_key(p)?;
        }
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_secs(2),
                base: 2.0,
            },
            max_retries: cfg.max_retries,
            retry_timeout: cfg.retry_timeout,
        };
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(&cfg.bucket)
            .with_region(&cfg.region)
            .with_access_key_id(&cfg.access_key_id)
            .with_secret_access_key(&cfg.secret_access_key)
            .with_allow_http(cfg.allow_http)
            .with_virtual_hosted_style_request(cfg.virtual_hosted_style)
            .with_retry(retry);
        if let Some(e) = &cfg.endpoint {
            b = b.with_endpoint(e);
        }
        let store = b
            .build()
            .map_err(|e| BackupError::InvalidArgument(format!("S3 configuration: {e}")))?;
        let name = format!(
            "s3:{}/{}",
            cfg.endpoint.as_deref().unwrap_or("aws"),
            cfg.bucket
        );
        Ok(S3Target {
            store: Arc::new(store),
            name,
            bucket: cfg.bucket.clone(),
            prefix: cfg.prefix.clone(),
        })
    }

    fn no_bucket(&self, op: &'static str, key: &str, e: &object_store::Error) -> BackupError {
        BackupError::Target {
            target: self.name.clone(),
            op,
            key: key.to_string(),
            source: format!("bucket {:?} does not exist: {e}", self.bucket).into(),
        }
    }

    fn path(&self, key: &str) -> Path {
        match &self.prefix {
            Some(p) => Path::from(format!("{p}/{key}")),
            None => Path::from(key),
        }
    }

    fn err(&self, op: &'static str, key: &str, e: object_store::Error) -> BackupError {
        if chain_contains(&e, "<Code>NoSuchBucket</Code>") {
            return self.no_bucket(op, key, &e);
        }
        match e {
            object_store::Error::NotFound { .. } => BackupError::NotFound {
                key: key.to_string(),
            },
            object_store::Error::PermissionDenied { source, .. }
            | object_store::Error::Unauthenticated { source, .. } => BackupError::Auth {
                target: self.name.clone(),
                op,
                key: key.to_string(),
                detail: source.to_string(),
            },
            // Listing reports HTTP errors as `Generic`: recognise refused
            // credentials by status and S3 error code.
            e if is_auth_error(&e) => BackupError::Auth {
                target: self.name.clone(),
                op,
                key: key.to_string(),
                detail: e.to_string(),
            },
            e => BackupError::Target {
                target: self.name.clone(),
                op,
                key: key.to_string(),
                source: Box::new(e),
            },
        }
    }
}

/// Whether an error (or one of its sources) is S3 refusing the
/// credentials.
fn is_auth_error(e: &(dyn std::error::Error + 'static)) -> bool {
    [
        "403 Forbidden",
        "401 Unauthorized",
        "<Code>InvalidAccessKeyId</Code>",
        "<Code>SignatureDoesNotMatch</Code>",
        "<Code>AccessDenied</Code>",
    ]
    .iter()
    .any(|m| chain_contains(e, m))
}

/// Whether the message of an error or of one of its sources contains `mark`.
fn chain_contains(e: &(dyn std::error::Error + 'static), mark: &str) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.to_string().contains(mark) {
            return true;
        }
        cur = err.source();
    }
    false
}

#[async_trait::async_trait]
impl BackupTarget for S3Target {
    async fn put(&self, key: &str, data: Bytes) -> Result<(), BackupError> {
        check_key(key)?;
        self.store
            .put(&self.path(key), PutPayload::from(data))
            .await
            .map(|_| ())
            .map_err(|e| self.err("put", key, e))
    }

    async fn get(&self, key: &str) -> Result<Bytes, BackupError> {
        check_key(key)?;
        let r = self
            .store
            .get(&self.path(key))
            .await
            .map_err(|e| self.err("get", key, e))?;
        r.bytes().await.map_err(|e| self.err("get", key, e))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackupError> {
        check_prefix(prefix)?;
        let p = prefix.trim_end_matches('/');
        let path = match (&self.prefix, p.is_empty()) {
            (Some(b), true) => Some(Path::from(b.as_str())),
            (Some(b), false) => Some(Path::from(format!("{b}/{p}"))),
            (None, true) => None,
            (None, false) => Some(Path::from(p)),
        };
        let metas: Vec<_> =
            self.store
                .list(path.as_ref())
                .try_collect()
                .await
                .map_err(|e| match e {
                    // Listing a folder that has no objects is not an error:
                    // only a missing bucket is.
                    e @ object_store::Error::NotFound { .. } => self.no_bucket("list", prefix, &e),
                    e => self.err("list", prefix, e),
                })?;
        let strip = self.prefix.as_ref().map(|b| format!("{b}/"));
        Ok(metas
            .into_iter()
            .filter_map(|m| {
                let full = m.location.to_string();
                let key = match &strip {
                    Some(s) => full.strip_prefix(s.as_str())?.to_string(),
                    None => full,
                };
                Some(ObjectInfo {
                    key,
                    size: m.size,
                    modified: SystemTime::from(m.last_modified),
                })
            })
            .collect())
    }

    async fn delete(&self, key: &str) -> Result<(), BackupError> {
        check_key(key)?;
        match self.store.delete(&self.path(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err("delete", key, e)),
        }
    }

    fn describe(&self) -> String {
        self.name.clone()
    }
}
