// SPDX-License-Identifier: Apache-2.0
//! Watch responses: newline-delimited JSON events over a chunked body.
//!
//! `{"type":"ADDED","object":{...}}` per line; `BOOKMARK` events every
//! bookmark interval when asked (`allowWatchBookmarks=true`), carrying only a
//! resourceVersion up to which everything was delivered; an `ERROR` event with
//! a 410 `Status` when the requested version is older than the history (the
//! client then lists again, as with Kubernetes).

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Value, json};

use super::table::{self, IncludeObject};
use super::{ApiError, ApiState};
use crate::resources::KindInfo;
use crate::store::{EventType, GroupKind, StoreError, WatchOptions, WatchStream};

/// Parsed watch parameters.
#[derive(Debug, Clone)]
pub struct WatchParams {
    /// Store options.
    pub opts: WatchOptions,
    /// Send bookmarks.
    pub bookmarks: bool,
    /// End the watch after this long.
    pub timeout: Duration,
    /// Emit Tables instead of objects.
    pub table: Option<IncludeObject>,
}

/// Parses a `resourceVersion` parameter: `""`/`"0"` mean "now, with initial
/// state"; anything else must be a version number.
pub fn parse_rv(q: &HashMap<String, String>) -> Result<Option<u64>, ApiError> {
    match q.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => Ok(None),
        Some(s) => s
            .parse::<u64>()
            .map(Some)
            .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {s:?}"))),
    }
}

fn line(v: &Value) -> Bytes {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    Bytes::from(b)
}

fn error_event(e: &ApiError) -> Bytes {
    line(&json!({"type": "ERROR", "object": e.to_status()}))
}

fn response(body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::OK;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    r
}

struct Pump {
    events: WatchStream,
    kind: KindInfo,
    table: Option<IncludeObject>,
    bookmarks: bool,
    tick: tokio::time::Interval,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    progress: u64,
    sent_bookmark: u64,
    done: bool,
}

impl Pump {
    fn render(&self, type_: EventType, object: Value) -> Bytes {
        let object = match self.table {
            Some(include) => {
                table::table(&self.kind, std::slice::from_ref(&object), "", None, include)
            }
            None => object,
        };
        line(&json!({"type": type_.as_str(), "object": object}))
    }

    fn bookmark(&mut self) -> Option<Bytes> {
        if !self.bookmarks || self.progress <= self.sent_bookmark {
            return None;
        }
        self.sent_bookmark = self.progress;
        Some(line(&json!({"type": "BOOKMARK", "object": {
            "apiVersion": self.kind.api_version(),
            "kind": self.kind.kind,
            "metadata": {"resourceVersion": self.progress.to_string()},
        }})))
    }

    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if self.done {
                return None;
            }
            tokio::select! {
                ev = self.events.next() => match ev {
                    None => return None,
                    Some(Ok(ev)) if ev.type_ == EventType::Bookmark => self.progress = self.progress.max(ev.resource_version),
                    Some(Ok(ev)) => {
                        self.progress = self.progress.max(ev.resource_version);
                        return Some(self.render(ev.type_, ev.object));
                    }
                    Some(Err(e)) => {
                        self.done = true;
                        return Some(error_event(&ApiError::from_store(&self.kind, e)));
                    }
                },
                _ = self.tick.tick() => {
                    if let Some(b) = self.bookmark() {
                        return Some(b);
                    }
                }
                _ = &mut self.deadline => return None,
            }
        }
    }
}

/// Serves a watch.
pub async fn serve(
    state: &ApiState,
    kind: &KindInfo,
    ns: Option<&str>,
    params: WatchParams,
) -> Result<Response, ApiError> {
    let gk = GroupKind::new(kind.group, kind.kind);
    let mut opts = params.opts.clone();
    opts.progress = params.bookmarks;
    let start = opts.resource_version.unwrap_or(0);
    let events = match state.store.watch(&gk, ns, &opts).await {
        Ok(s) => s,
        Err(e @ StoreError::Gone { .. }) => {
            // Like Kubernetes: a 200 response carrying one ERROR event with a 410 Status.
            let chunk = error_event(&ApiError::from_store(kind, e));
            return Ok(response(Body::from(chunk)));
        }
        Err(e) => return Err(ApiError::from_store(kind, e)),
    };
    let mut tick = tokio::time::interval(state.bookmark_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.reset();
    let pump = Pump {
        events,
        kind: kind.clone(),
        table: params.table,
        bookmarks: params.bookmarks,
        tick,
        deadline: Box::pin(tokio::time::sleep(params.timeout)),
        progress: start,
        sent_bookmark: start,
        done: false,
    };
    let stream = futures::stream::unfold(pump, |mut p| async move {
        p.next_chunk()
            .await
            .map(|c| (Ok::<_, std::convert::Infallible>(c), p))
    });
    Ok(response(Body::from_stream(stream)))
}
