// SPDX-License-Identifier: Apache-2.0
//! Bearer-token authentication and the read-only role.

use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::ratelimit::ClientAddr;
use super::{ApiError, ApiState};

/// Who a request runs as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Everything.
    Admin,
    /// Reads only.
    ReadOnly,
}

/// Compares in time independent of where the first difference is.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The role of a bearer token, if it is known.
pub fn role_of(state: &ApiState, token: &str) -> Option<Role> {
    if ct_eq(token.as_bytes(), state.tokens.admin.as_bytes()) {
        Some(Role::Admin)
    } else if state.readonly_enabled && ct_eq(token.as_bytes(), state.tokens.readonly.as_bytes()) {
        Some(Role::ReadOnly)
    } else {
        None
    }
}

/// Paths served without authentication.
fn is_public(path: &str) -> bool {
    // The dashboard's static assets hold no data (see `ui`).
    matches!(path, "/healthz" | "/livez" | "/readyz") || super::ui::is_ui_path(path)
}

/// Middleware: 401 without a valid token, 403 for writes by the read-only role.
pub async fn authenticate(State(state): State<ApiState>, req: Request, next: Next) -> Response {
    let client = req.extensions().get::<ClientAddr>().map(|c| c.0);
    if let Some(ip) = client
        && let Err(t) = state.limiter.request(ip)
    {
        tracing::debug!(%ip, "client over its request rate");
        return ApiError::too_many_requests(
            format!(
                "too many requests from {ip}; retry after {} s",
                t.retry_after_secs
            ),
            t.retry_after_secs,
        )
        .into_response();
    }
    if is_public(req.uri().path()) {
        return next.run(req).await;
    }
    let token = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    let Some(role) = token.and_then(|t| role_of(&state, t)) else {
        tracing::debug!(path = %req.uri().path(), "refused unauthenticated request");
        if let Some(ip) = client {
            if let Err(t) = state.limiter.auth_allowed(ip) {
                return ApiError::too_many_requests(
                    format!(
                        "too many failed authentications from {ip}; retry after {} s",
                        t.retry_after_secs
                    ),
                    t.retry_after_secs,
                )
                .into_response();
            }
            state.limiter.auth_failed(ip);
        }
        return ApiError::unauthorized().into_response();
    };
    if role == Role::ReadOnly
        && !matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS)
    {
        let msg = format!(
            "User \"sheaf-readonly\" cannot {} resource at {}: the read-only role may only get, list and watch",
            req.method().as_str().to_lowercase(),
            req.uri().path()
        );
        return ApiError::forbidden(msg).into_response();
    }
    if role == Role::ReadOnly && is_secret_path(req.uri().path()) {
        // As Kubernetes' `view` role: Secrets hold credentials (cloud-init
        // user data), so reading them is more than viewing.
        let msg = format!(
            "User \"sheaf-readonly\" cannot {} resource \"secrets\" at {}: the read-only role may not read Secrets",
            req.method().as_str().to_lowercase(),
            req.uri().path()
        );
        return ApiError::forbidden(msg).into_response();
    }
    next.run(req).await
}

/// `/api/v1[/watch][/namespaces/NS]/secrets[/...]`.
fn is_secret_path(path: &str) -> bool {
    let mut segs = path.trim_start_matches('/').split('/');
    if (segs.next(), segs.next()) != (Some("api"), Some("v1")) {
        return false;
    }
    let rest: Vec<&str> = segs.filter(|s| !s.is_empty()).collect();
    let rest = rest.strip_prefix(&["watch"]).unwrap_or(&rest);
    matches!(rest, ["secrets", ..] | ["namespaces", _, "secrets", ..])
}

#[cfg(test)]
mod tests {
    #[test]
    fn constant_time_compare() {
        assert!(super::ct_eq(b"abc", b"abc"));
        assert!(!super::ct_eq(b"abc", b"abd"));
        assert!(!super::ct_eq(b"abc", b"ab"));
    }

    #[test]
    fn secret_paths() {
        for p in [
            "/api/v1/secrets",
            "/api/v1/namespaces/default/secrets",
            "/api/v1/namespaces/default/secrets/s1",
            "/api/v1/watch/namespaces/default/secrets",
            "//api/v1//secrets",
        ] {
            assert!(super::is_secret_path(p), "{p}");
        }
        for p in [
            "/api/v1/namespaces",
            "/api/v1/namespaces/secrets",
            "/apis/kubevirt.io/v1/namespaces/default/virtualmachines/secrets",
            "/api/v1/namespaces/default/pods",
        ] {
            assert!(!super::is_secret_path(p), "{p}");
        }
    }
}
