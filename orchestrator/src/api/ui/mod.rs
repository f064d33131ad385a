// SPDX-License-Identifier: Apache-2.0
//! The web dashboard: static assets embedded in the binary, served at `/ui/`
//! by the API server itself (see `docs/dashboard.md`).
//!
//! Authorisation: the assets are public (they hold no cluster data, and a
//! browser navigation cannot carry a bearer token); every byte of data the
//! page shows comes from the ordinary API paths with the token the user
//! pasted, sent in the `Authorization` header (never a cookie, so a
//! cross-site form cannot ride on it). Every response carries a strict
//! Content-Security-Policy: scripts, styles and connections from this origin
//! only, no inline script or style, no frames.

use axum::Router;
use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

/// The policy sent with every dashboard response.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// One embedded file.
struct Asset {
    path: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

macro_rules! asset {
    ($path:literal, $ct:expr) => {
        Asset {
            path: $path,
            content_type: $ct,
            body: include_bytes!(concat!("assets/", $path)),
        }
    };
}

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

static ASSETS: &[Asset] = &[
    asset!("index.html", HTML),
    asset!("style.css", CSS),
    asset!("js/app.js", JS),
    asset!("js/api.js", JS),
    asset!("js/dom.js", JS),
    asset!("js/live.js", JS),
    asset!("js/yaml.js", JS),
    asset!("js/format.js", JS),
    asset!("js/overview.js", JS),
    asset!("js/vms.js", JS),
    asset!("js/vmdetail.js", JS),
    asset!("js/create.js", JS),
    asset!("js/volumes.js", JS),
    asset!("js/nodes.js", JS),
    asset!("js/console.js", JS),
];

/// The embedded file at `path` (relative to `/ui/`), if any.
fn find(path: &str) -> Option<&'static Asset> {
    let path = if path.is_empty() { "index.html" } else { path };
    ASSETS.iter().find(|a| a.path == path)
}

fn headers(resp: &mut Response) {
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // Assets change with the binary: always revalidate.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
}

fn serve(path: &str) -> Response {
    let mut resp = match find(path) {
        Some(a) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, a.content_type)],
            a.body,
        )
            .into_response(),
        None => {
            tracing::debug!(path, "no such dashboard asset");
            (
                StatusCode::NOT_FOUND,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                "not found",
            )
                .into_response()
        }
    };
    headers(&mut resp);
    resp
}

async fn index() -> Response {
    serve("")
}

async fn file(Path(path): Path<String>) -> Response {
    serve(&path)
}

/// `/ui` (redirects to `/ui/`), `/ui/` and `/ui/<asset>`.
pub fn routes() -> Router {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(index))
        .route("/ui/{*path}", get(file))
}

/// Whether `path` is a dashboard path (served without a token).
pub fn is_ui_path(path: &str) -> bool {
    path == "/ui" || path.starts_with("/ui/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_asset_is_found_and_unknown_paths_are_not() {
        assert_eq!(find("").map(|a| a.path), Some("index.html"));
        for a in ASSETS {
            assert!(find(a.path).is_some(), "{}", a.path);
            assert!(!a.body.is_empty(), "{}", a.path);
        }
        for p in ["../Cargo.toml", "js/../../mod.rs", "nope.js", "/etc/passwd"] {
            assert!(find(p).is_none(), "{p}");
        }
    }

    #[test]
    fn ui_paths() {
        assert!(is_ui_path("/ui") && is_ui_path("/ui/") && is_ui_path("/ui/js/app.js"));
        assert!(!is_ui_path("/uix") && !is_ui_path("/api/v1") && !is_ui_path("/"));
    }

    #[test]
    fn no_inline_script_or_external_url_in_assets() {
        for a in ASSETS {
            let text = String::from_utf8_lossy(a.body);
            assert!(
                !text.contains("http://") && !text.contains("https://"),
                "{}",
                a.path
            );
            if a.path.ends_with(".html") {
                assert!(
                    !text.contains("<script>") && !text.contains("style="),
                    "{}",
                    a.path
                );
            }
            if a.path.ends_with(".js") {
                assert!(
                    !text.contains("innerHTML") && !text.contains("eval("),
                    "{}",
                    a.path
                );
            }
        }
    }
}
