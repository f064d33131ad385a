// SPDX-License-Identifier: Apache-2.0
//! Types and helpers shared by several kinds.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `True`, `False` or `Unknown`, as in every Kubernetes condition.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[schemars(inline)]
pub enum ConditionStatus {
    /// The condition holds.
    True,
    /// The condition does not hold.
    False,
    /// Not known.
    #[default]
    Unknown,
}

/// A status condition (`Ready`, `LiveMigratable`, `Paused`, ...).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Condition type, e.g. `Ready`.
    #[serde(rename = "type")]
    pub type_: String,
    /// Whether the condition holds.
    pub status: ConditionStatus,
    /// Machine-readable reason for the last transition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Human-readable detail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When the condition was last probed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_probe_time: Option<Time>,
    /// When the status last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
    /// When the reporter last confirmed the condition (node heartbeats).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_time: Option<Time>,
}

impl Condition {
    /// A condition of the given type and status, stamped now.
    pub fn new(type_: &str, status: ConditionStatus) -> Self {
        Self {
            type_: type_.to_string(),
            status,
            last_transition_time: Some(now()),
            ..Default::default()
        }
    }
}

/// The current time as a Kubernetes [`Time`] (second precision, like the API server).
pub fn now() -> Time {
    let ts = jiff::Timestamp::now();
    let secs = ts.as_second();
    Time(jiff::Timestamp::from_second(secs).unwrap_or(ts))
}

/// Reads a value at a dotted path (`status.nodeName`, `metadata.labels.app`).
pub fn json_path<'a>(obj: &'a Value, path: &str) -> Option<&'a Value> {
    let mut cur = obj;
    for part in path.split('.') {
        if part.is_empty() {
            continue;
        }
        cur = match cur {
            Value::Object(m) => m.get(part)?,
            Value::Array(a) => a.get(part.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(cur)
}

/// The string at a dotted path, or `""`.
pub fn json_str<'a>(obj: &'a Value, path: &str) -> &'a str {
    json_path(obj, path).and_then(Value::as_str).unwrap_or("")
}

/// Kubernetes' short human duration: `45s`, `3m`, `5h`, `2d`, `3y`.
pub fn human_duration(secs: i64) -> String {
    let secs = secs.max(0);
    if secs < 120 {
        format!("{secs}s")
    } else if secs < 60 * 60 {
        format!("{}m", secs / 60)
    } else if secs < 48 * 3600 {
        let h = secs / 3600;
        let m = (secs % 3600) / 60;
        if h < 8 && m > 0 {
            format!("{h}h{m}m")
        } else {
            format!("{h}h")
        }
    } else if secs < 365 * 86400 * 2 {
        format!("{}d", secs / 86400)
    } else {
        format!("{}y", secs / (365 * 86400))
    }
}

/// The `Age` cell for an object: time since `metadata.creationTimestamp`.
pub fn age_cell(obj: &Value) -> Value {
    let ts = json_str(obj, "metadata.creationTimestamp");
    match ts.parse::<jiff::Timestamp>() {
        Ok(t) => {
            let now = jiff::Timestamp::now();
            Value::String(human_duration(now.as_second() - t.as_second()))
        }
        Err(_) => Value::String("<unknown>".into()),
    }
}

/// The status (`True`/`False`) of condition `type_` in `status.conditions`, or `""`.
pub fn condition_cell(obj: &Value, type_: &str) -> Value {
    let found = json_path(obj, "status.conditions")
        .and_then(Value::as_array)
        .and_then(|c| c.iter().find(|c| json_str(c, "type") == type_))
        .map(|c| json_str(c, "status").to_string());
    Value::String(found.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_kubectl() {
        assert_eq!(human_duration(5), "5s");
        assert_eq!(human_duration(600), "10m");
        assert_eq!(human_duration(3600 + 120), "1h2m");
        assert_eq!(human_duration(30 * 3600), "30h");
        assert_eq!(human_duration(5 * 86400), "5d");
    }

    #[test]
    fn json_path_walks_maps_and_arrays() {
        let v = serde_json::json!({"status": {"interfaces": [{"ipAddress": "10.0.0.2"}]}});
        assert_eq!(json_str(&v, "status.interfaces.0.ipAddress"), "10.0.0.2");
        assert_eq!(json_str(&v, "status.nope"), "");
    }
}
