// SPDX-License-Identifier: Apache-2.0
//! Kubernetes `Status` errors: the one place where store and validation
//! errors become HTTP responses.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::resources::{FieldError, KindInfo, ValidationError};
use crate::store::StoreError;

/// An API error rendered as a Kubernetes `Status` object.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status code.
    pub code: u16,
    /// `Status.reason` (`NotFound`, `Invalid`, ...).
    pub reason: &'static str,
    /// Human message, as kubectl prints it.
    pub message: String,
    /// `Status.details`, if any.
    pub details: Option<Value>,
}

impl ApiError {
    pub(crate) fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }
    fn with_details(mut self, details: Value) -> Self {
        self.details = Some(details);
        self
    }
    /// 400 BadRequest.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }
    /// 401 Unauthorized.
    pub fn unauthorized() -> Self {
        Self::new(401, "Unauthorized", "Unauthorized")
    }
    /// 403 Forbidden.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(403, "Forbidden", message)
    }
    /// 404 NotFound for an object.
    pub fn not_found(kind: &KindInfo, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} {name:?} not found", kind.qualified()),
        )
        .with_details(json!({"name": name, "group": kind.group, "kind": kind.plural}))
    }
    /// 404 NotFound for a path that serves nothing.
    pub fn no_route(path: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        )
    }
    /// 405 MethodNotAllowed.
    pub fn method_not_allowed(method: &str, what: &str) -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            format!("{method} is not supported on {what}"),
        )
    }
    /// 406 NotAcceptable.
    pub fn not_acceptable(accept: &str) -> Self {
        Self::new(
            406,
            "NotAcceptable",
            format!("only application/json is served, not {accept:?}"),
        )
    }
    /// 410 Expired (too old resource version).
    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }
    /// 413 RequestEntityTooLarge.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            413,
            "RequestEntityTooLarge",
            format!("the request body is larger than the limit of {limit} bytes"),
        )
    }
    /// 429 TooManyRequests, with `Retry-After: retry_after_secs`.
    pub fn too_many_requests(message: impl Into<String>, retry_after_secs: u64) -> Self {
        Self::new(429, "TooManyRequests", message)
            .with_details(json!({"retryAfterSeconds": retry_after_secs}))
    }
    /// 415 UnsupportedMediaType.
    pub fn unsupported_media(ct: &str, allowed: &[&str]) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format ({ct:?}); accepted media types include: {}",
                allowed.join(", ")
            ),
        )
    }
    /// 500 InternalError.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalError", message)
    }

    /// 422 Invalid (or 400 for strict-decoding errors), with `details.causes`.
    pub fn invalid(kind: &KindInfo, name: &str, err: &ValidationError) -> Self {
        let causes: Vec<Value> = err.field_errors().iter().map(cause).collect();
        let details =
            json!({"name": name, "group": kind.group, "kind": kind.kind, "causes": causes});
        match err {
            ValidationError::Malformed(m) => Self::bad_request(m.clone()),
            ValidationError::UnknownFields(_) => Self::bad_request(format!(
                "{} in version {:?} cannot be handled as a {}: {err}",
                kind.kind, kind.version, kind.kind
            ))
            .with_details(details),
            ValidationError::Invalid(errs) => {
                let list: Vec<String> = errs.iter().map(ToString::to_string).collect();
                let joined = if list.len() == 1 {
                    list[0].clone()
                } else {
                    format!("[{}]", list.join(", "))
                };
                Self::new(
                    422,
                    "Invalid",
                    format!("{} {name:?} is invalid: {joined}", kind.kind_qualified()),
                )
                .with_details(details)
            }
        }
    }

    /// Translates a store error for `kind`.
    pub fn from_store(kind: &KindInfo, e: StoreError) -> Self {
        match e {
            StoreError::NotFound { name, .. } => Self::not_found(kind, &name),
            StoreError::AlreadyExists { name, .. } => Self::new(
                409,
                "AlreadyExists",
                format!("{} {name:?} already exists", kind.qualified()),
            )
            .with_details(json!({"name": name, "group": kind.group, "kind": kind.plural})),
            StoreError::Conflict { name, message, .. } => Self::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} {name:?}: {message}",
                    kind.qualified()
                ),
            )
            .with_details(json!({"name": name, "group": kind.group, "kind": kind.plural})),
            StoreError::Invalid { name, message, .. } => Self::new(
                422,
                "Invalid",
                format!("{} {name:?} is invalid: {message}", kind.kind_qualified()),
            )
            .with_details(json!({"name": name, "group": kind.group, "kind": kind.kind})),
            StoreError::Gone { .. } => Self::gone(e.to_string()),
            StoreError::BadRequest(m) => Self::bad_request(m),
            StoreError::Backend(m) => {
                tracing::error!(error = %m, "store backend failure");
                Self::internal(m)
            }
        }
    }

    /// The `Status` object.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

fn cause(e: &FieldError) -> Value {
    json!({"reason": e.kind.cause_reason(), "message": e.message(), "field": e.field})
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self.to_status()).unwrap_or_default();
        let mut r = (code, body).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if self.code == 429
            && let Some(secs) = self
                .details
                .as_ref()
                .and_then(|d| d.get("retryAfterSeconds"))
                .and_then(Value::as_u64)
        {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.code == 401 {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"sheaf\""),
            );
        }
        r
    }
}
