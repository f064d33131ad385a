// SPDX-License-Identifier: Apache-2.0
//! Label and field selectors (`app=web,tier in (a,b),!legacy`, `status.nodeName=n1`).

use std::collections::BTreeMap;

use serde_json::Value;

use crate::resources::common::json_path;

/// A selector that failed to parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid selector {input:?}: {reason}")]
pub struct SelectorError {
    /// The selector text.
    pub input: String,
    /// What is wrong.
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Eq(String),
    NotEq(String),
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    NotExists,
}

/// A parsed label selector: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    reqs: Vec<(String, Op)>,
}

fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 317
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b))
}

fn valid_value(v: &str) -> bool {
    v.len() <= 63
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

impl LabelSelector {
    /// Parses the Kubernetes label selector syntax. The empty string selects everything.
    pub fn parse(input: &str) -> Result<Self, SelectorError> {
        let err = |reason: &str| SelectorError {
            input: input.to_string(),
            reason: reason.to_string(),
        };
        let mut reqs = Vec::new();
        if input.trim().is_empty() {
            return Ok(Self { reqs });
        }
        for part in split_top_level(input) {
            let part = part.trim();
            if part.is_empty() {
                return Err(err("empty requirement"));
            }
            let (key, op) = if let Some(k) = part.strip_prefix('!') {
                (k.trim().to_string(), Op::NotExists)
            } else if let Some((k, v)) = part.split_once("!=") {
                (k.trim().to_string(), Op::NotEq(v.trim().to_string()))
            } else if let Some((k, v)) = part.split_once("==") {
                (k.trim().to_string(), Op::Eq(v.trim().to_string()))
            } else if let Some((k, v)) = part.split_once('=') {
                (k.trim().to_string(), Op::Eq(v.trim().to_string()))
            } else if let Some(idx) = part.find(" notin ").or_else(|| part.find(" in ")) {
                let key = part[..idx].trim().to_string();
                let rest = part[idx..].trim_start();
                let (neg, rest) = match rest.strip_prefix("notin") {
                    Some(r) => (true, r),
                    None => (false, rest.strip_prefix("in").unwrap_or(rest)),
                };
                let rest = rest.trim();
                let inner = rest
                    .strip_prefix('(')
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or_else(|| err("set must be in parentheses"))?;
                let vals: Vec<String> = inner
                    .split(',')
                    .map(|v| v.trim().to_string())
                    .filter(|v| !v.is_empty())
                    .collect();
                if vals.is_empty() {
                    return Err(err("empty set"));
                }
                (key, if neg { Op::NotIn(vals) } else { Op::In(vals) })
            } else if part.contains(['<', '>', '(', ')', ' ']) {
                return Err(err("unsupported operator"));
            } else {
                (part.to_string(), Op::Exists)
            };
            if !valid_key(&key) {
                return Err(err(&format!("invalid label key {key:?}")));
            }
            let values_ok = match &op {
                Op::Eq(v) | Op::NotEq(v) => valid_value(v),
                Op::In(vs) | Op::NotIn(vs) => vs.iter().all(|v| valid_value(v)),
                _ => true,
            };
            if !values_ok {
                return Err(err("invalid label value"));
            }
            reqs.push((key, op));
        }
        Ok(Self { reqs })
    }

    /// Whether the selector selects everything.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Whether labels satisfy every requirement.
    pub fn matches(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        self.reqs.iter().all(|(k, op)| {
            let v = labels.and_then(|l| l.get(k));
            match op {
                Op::Eq(x) => v == Some(x),
                Op::NotEq(x) => v != Some(x),
                Op::In(xs) => v.is_some_and(|v| xs.contains(v)),
                Op::NotIn(xs) => v.is_none_or(|v| !xs.contains(v)),
                Op::Exists => v.is_some(),
                Op::NotExists => v.is_none(),
            }
        })
    }

    /// Matches the `metadata.labels` of a JSON object.
    pub fn matches_object(&self, obj: &Value) -> bool {
        if self.reqs.is_empty() {
            return true;
        }
        let labels: Option<BTreeMap<String, String>> =
            json_path(obj, "metadata.labels").and_then(|l| {
                l.as_object().map(|m| {
                    m.iter()
                        .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
                        .collect()
                })
            });
        self.matches(labels.as_ref())
    }
}

/// A parsed field selector: `path=value`, `path==value`, `path!=value`, comma-separated.
///
/// Any dotted path into the object is accepted (a superset of what Kubernetes
/// allows for custom resources); missing fields compare as `""`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    reqs: Vec<(String, bool, String)>,
}

impl FieldSelector {
    /// Parses a field selector. The empty string selects everything.
    pub fn parse(input: &str) -> Result<Self, SelectorError> {
        let err = |reason: &str| SelectorError {
            input: input.to_string(),
            reason: reason.to_string(),
        };
        let mut reqs = Vec::new();
        if input.trim().is_empty() {
            return Ok(Self { reqs });
        }
        for part in input.split(',') {
            let (k, eq, v) = if let Some((k, v)) = part.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = part.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = part.split_once('=') {
                (k, true, v)
            } else {
                return Err(err("expected path=value or path!=value"));
            };
            let k = k.trim();
            if k.is_empty()
                || !k
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b))
            {
                return Err(err(&format!("invalid field path {k:?}")));
            }
            reqs.push((k.to_string(), eq, v.trim().to_string()));
        }
        Ok(Self { reqs })
    }

    /// Whether the selector selects everything.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Whether the object satisfies every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        self.reqs.iter().all(|(path, eq, want)| {
            let got = match json_path(obj, path) {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
            };
            (got == *want) == *eq
        })
    }
}

impl std::fmt::Display for LabelSelector {
    /// The selector in Kubernetes syntax; [`LabelSelector::parse`] reads it back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (k, op)) in self.reqs.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            match op {
                Op::Eq(v) => write!(f, "{k}={v}")?,
                Op::NotEq(v) => write!(f, "{k}!={v}")?,
                Op::In(vs) => write!(f, "{k} in ({})", vs.join(","))?,
                Op::NotIn(vs) => write!(f, "{k} notin ({})", vs.join(","))?,
                Op::Exists => f.write_str(k)?,
                Op::NotExists => write!(f, "!{k}")?,
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for FieldSelector {
    /// The selector in Kubernetes syntax; [`FieldSelector::parse`] reads it back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (path, eq, v)) in self.reqs.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{path}{}{v}", if *eq { "=" } else { "!=" })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn label_selector_syntax() {
        let s = LabelSelector::parse("app=web, tier in (a,b),!legacy,env!=prod,kubevirt.io/vm")
            .unwrap();
        assert!(s.matches(Some(&labels(&[
            ("app", "web"),
            ("tier", "b"),
            ("kubevirt.io/vm", "x")
        ]))));
        assert!(!s.matches(Some(&labels(&[
            ("app", "web"),
            ("tier", "c"),
            ("kubevirt.io/vm", "x")
        ]))));
        assert!(!s.matches(Some(&labels(&[
            ("app", "web"),
            ("tier", "a"),
            ("legacy", "1"),
            ("kubevirt.io/vm", "x")
        ]))));
        assert!(!s.matches(Some(&labels(&[
            ("app", "web"),
            ("tier", "a"),
            ("env", "prod"),
            ("kubevirt.io/vm", "x")
        ]))));
        let n = LabelSelector::parse("tier notin (a)").unwrap();
        assert!(n.matches(None));
        assert!(LabelSelector::parse("").unwrap().matches(None));
    }

    #[test]
    fn bad_label_selectors() {
        for bad in ["a=b,", "x in a,b", "a>1", "a in ()", "bad key=1", "a=b c"] {
            assert!(LabelSelector::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn field_selectors() {
        let obj = serde_json::json!({"metadata": {"name": "a"}, "status": {"nodeName": "n1", "ready": true}});
        assert!(
            FieldSelector::parse("metadata.name=a,status.nodeName==n1")
                .unwrap()
                .matches(&obj)
        );
        assert!(
            FieldSelector::parse("status.ready=true")
                .unwrap()
                .matches(&obj)
        );
        assert!(
            !FieldSelector::parse("status.nodeName!=n1")
                .unwrap()
                .matches(&obj)
        );
        assert!(FieldSelector::parse("status.phase=").unwrap().matches(&obj));
        assert!(FieldSelector::parse("nonsense").is_err());
    }

    #[test]
    fn selectors_print_back_to_what_they_parse_from() {
        for text in [
            "",
            "app=web,tier in (a,b),!legacy,env!=prod,x notin (y),has",
        ] {
            let l = LabelSelector::parse(text).unwrap();
            assert_eq!(LabelSelector::parse(&l.to_string()).unwrap(), l);
        }
        let f = FieldSelector::parse("status.nodeName=n1,metadata.name!=x").unwrap();
        assert_eq!(f.to_string(), "status.nodeName=n1,metadata.name!=x");
        assert_eq!(FieldSelector::parse(&f.to_string()).unwrap(), f);
    }
}
