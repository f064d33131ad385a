// SPDX-License-Identifier: Apache-2.0
//! The one error type of the binding layer, and the stable [`ErrorKind`]
//! each foreign boundary translates (C status codes, Python exceptions).

use std::io;
use std::path::PathBuf;

/// What kind of failure an [`Error`] is. Bindings map kinds, never
/// variants, so new variants do not change the foreign surface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A caller-supplied value is unusable (bad string, range, JSON...).
    InvalidArgument,
    /// The object is in the wrong state for the operation.
    State,
    /// A host I/O operation failed (files, sockets).
    Io,
    /// The operation did not finish in time.
    Timeout,
    /// The named object does not exist.
    NotFound,
    /// The credentials were refused (HTTP 401/403).
    PermissionDenied,
    /// The VMM failed (KVM, guest image, devices).
    Vmm,
    /// The replicated volume failed (quorum, fencing, replicas).
    Volume,
    /// No node can take the request.
    Unschedulable,
    /// Any other scheduler failure.
    Sched,
    /// The cluster API answered with an error or could not be reached.
    Cluster,
}

impl ErrorKind {
    /// A stable lower-case name (`"invalid_argument"`, `"vmm"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::State => "state",
            ErrorKind::Io => "io",
            ErrorKind::Timeout => "timeout",
            ErrorKind::NotFound => "not_found",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::Vmm => "vmm",
            ErrorKind::Volume => "volume",
            ErrorKind::Unschedulable => "unschedulable",
            ErrorKind::Sched => "sched",
            ErrorKind::Cluster => "cluster",
        }
    }
}

/// Errors of the binding layer, named after the operation that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A caller-supplied value is unusable.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A VM operation that its current state does not allow.
    #[error("cannot {op} a VM that is {state}")]
    VmState {
        /// The operation.
        op: &'static str,
        /// The VM's state.
        state: String,
    },
    /// A VMM call failed.
    #[error("VM {op} failed")]
    Vmm {
        /// The operation.
        op: &'static str,
        /// The VMM error.
        #[source]
        source: sheaf_vmm::Error,
    },
    /// A disk image could not be opened.
    #[error("cannot open disk {path}")]
    OpenDisk {
        /// The image path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A volume operation failed.
    #[error("volume {op} failed")]
    Volume {
        /// The operation.
        op: &'static str,
        /// The blockrepl error.
        #[source]
        source: sheaf_blockrepl::Error,
    },
    /// Starting an async runtime or a replica server socket failed.
    #[error("{op} failed")]
    Io {
        /// The operation.
        op: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A scheduler call failed.
    #[error("{0}")]
    Sched(#[from] sheaf_sched::SchedError),
    /// A JSON document does not decode.
    #[error("cannot decode {what}")]
    Json {
        /// What was decoded.
        what: &'static str,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// A kubeconfig is missing, malformed or uses an unsupported feature.
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The TLS client could not be configured.
    #[error("TLS setup failed: {0}")]
    Tls(String),
    /// The API server could not be reached or the exchange failed.
    #[error("{method} {url} failed")]
    Http {
        /// HTTP method.
        method: String,
        /// Full URL.
        url: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The API server answered with an error status.
    #[error("{method} {path}: HTTP {status} {reason}: {message}")]
    Api {
        /// HTTP method.
        method: String,
        /// Request path.
        path: String,
        /// HTTP status code.
        status: u16,
        /// Kubernetes `Status.reason` (e.g. `NotFound`).
        reason: String,
        /// Kubernetes `Status.message`.
        message: String,
    },
    /// An operation did not finish in time.
    #[error("{op} timed out after {ms} ms")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The limit.
        ms: u64,
    },
}

/// Result alias of the binding layer.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The stable kind bindings translate.
    pub fn kind(&self) -> ErrorKind {
        use sheaf_blockrepl::Error as B;
        use sheaf_sched::SchedError as S;
        match self {
            Error::InvalidArgument(_) | Error::Json { .. } => ErrorKind::InvalidArgument,
            Error::VmState { .. } => ErrorKind::State,
            Error::Vmm { source, .. } => match source {
                sheaf_vmm::Error::Config(_) => ErrorKind::InvalidArgument,
                sheaf_vmm::Error::InvalidState { .. } => ErrorKind::State,
                sheaf_vmm::Error::Timeout { .. } => ErrorKind::Timeout,
                _ => ErrorKind::Vmm,
            },
            Error::OpenDisk { source, .. } | Error::Io { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => ErrorKind::NotFound,
                io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
                _ => ErrorKind::Io,
            },
            Error::Volume { source, .. } => match source {
                B::Unaligned { .. }
                | B::OutOfRange { .. }
                | B::TooLarge { .. }
                | B::InvalidArgument(_) => ErrorKind::InvalidArgument,
                B::Detached => ErrorKind::State,
                _ => ErrorKind::Volume,
            },
            Error::Sched(e) => match e {
                S::Unschedulable(_) => ErrorKind::Unschedulable,
                S::Gang { cause, .. } if matches!(**cause, S::Unschedulable(_)) => {
                    ErrorKind::Unschedulable
                }
                S::UnknownNode { .. } => ErrorKind::NotFound,
                _ => ErrorKind::Sched,
            },
            Error::Kubeconfig { .. } | Error::Tls(_) => ErrorKind::InvalidArgument,
            Error::Http { .. } => ErrorKind::Cluster,
            Error::Api { status, .. } => match status {
                404 => ErrorKind::NotFound,
                401 | 403 => ErrorKind::PermissionDenied,
                _ => ErrorKind::Cluster,
            },
            Error::Timeout { .. } => ErrorKind::Timeout,
        }
    }

    /// The HTTP status of an API error, if this is one.
    pub fn http_status(&self) -> Option<u16> {
        match self {
            Error::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The message with its whole `source()` chain, `": "`-separated: what
    /// bindings show (`sheaf_last_error()`, Python exception text).
    pub fn report(&self) -> String {
        let mut s = self.to_string();
        let mut src = std::error::Error::source(self);
        while let Some(e) = src {
            let m = e.to_string();
            if !s.ends_with(&m) {
                s.push_str(": ");
                s.push_str(&m);
            }
            src = e.source();
        }
        s
    }

    pub(crate) fn volume(op: &'static str) -> impl FnOnce(sheaf_blockrepl::Error) -> Error {
        move |source| Error::Volume { op, source }
    }

    pub(crate) fn vmm(op: &'static str) -> impl FnOnce(sheaf_vmm::Error) -> Error {
        move |source| Error::Vmm { op, source }
    }

    pub(crate) fn io(op: &'static str) -> impl FnOnce(io::Error) -> Error {
        move |source| Error::Io { op, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_includes_the_source_chain_once() {
        let e = Error::Volume {
            op: "write",
            source: sheaf_blockrepl::Error::Store {
                op: "append",
                source: io::Error::other("disk on fire"),
            },
        };
        assert_eq!(
            e.report(),
            "volume write failed: store append failed: disk on fire"
        );
        assert_eq!(e.kind(), ErrorKind::Volume);
    }

    #[test]
    fn kinds_follow_the_cause() {
        let e = Error::Volume {
            op: "read",
            source: sheaf_blockrepl::Error::Unaligned { offset: 1, len: 2 },
        };
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let e = Error::Api {
            method: "GET".into(),
            path: "/x".into(),
            status: 404,
            reason: "NotFound".into(),
            message: "gone".into(),
        };
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert_eq!(e.http_status(), Some(404));
    }
}
