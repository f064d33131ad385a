// SPDX-License-Identifier: Apache-2.0
//! Label selectors compiled to symbols.
//!
//! A selector is compiled once per scheduling cycle (looking symbols up, so an
//! unknown value simply cannot match) or once per bound VM (interning them).

use std::collections::BTreeMap;

use crate::intern::{Interner, Sym, label_value};
use crate::types::{LabelSelector, NodeSelectorTerm, Operator, Requirement};

/// One compiled requirement.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum CReq {
    /// Value is one of the (sorted) symbols.
    In(Sym, Vec<Sym>),
    /// Absent, or value not one of the symbols.
    NotIn(Sym, Vec<Sym>),
    /// Key present.
    Exists(Sym),
    /// Key absent.
    DoesNotExist(Sym),
    /// Integer value greater than.
    Gt(Sym, i64),
    /// Integer value less than.
    Lt(Sym, i64),
    /// Can never match (unknown key or values, malformed number).
    Never,
}

/// A compiled selector: all requirements must hold (empty matches all).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct CSelector {
    pub(crate) reqs: Vec<CReq>,
}

impl CSelector {
    /// Compiles with symbol lookup only (for requests being scheduled).
    pub(crate) fn lookup(interner: &Interner, sel: &LabelSelector) -> Self {
        compile(&sel.match_labels, &sel.match_expressions, |s| {
            interner.get(s)
        })
    }

    /// Compiles a node selector term with lookup only.
    pub(crate) fn lookup_term(interner: &Interner, term: &NodeSelectorTerm) -> Self {
        compile(&BTreeMap::new(), &term.match_expressions, |s| {
            interner.get(s)
        })
    }

    /// Compiles a plain `key=value` map with lookup only.
    pub(crate) fn lookup_map(interner: &Interner, map: &BTreeMap<String, String>) -> Self {
        compile(map, &[], |s| interner.get(s))
    }

    /// Compiles, interning every string (for VMs bound in a snapshot).
    pub(crate) fn intern(interner: &mut Interner, sel: &LabelSelector) -> Self {
        compile(&sel.match_labels, &sel.match_expressions, |s| {
            Some(interner.intern(s))
        })
    }

    /// True when the selector can never match anything.
    pub(crate) fn is_never(&self) -> bool {
        self.reqs.iter().any(|r| matches!(r, CReq::Never))
    }

    /// The first `In` requirement: an index can enumerate its candidates.
    pub(crate) fn first_in(&self) -> Option<(Sym, &[Sym])> {
        self.reqs.iter().find_map(|r| match r {
            CReq::In(k, v) => Some((*k, v.as_slice())),
            _ => None,
        })
    }

    /// True when the selector is exactly one `key=value` requirement, so the
    /// label-pair index alone answers it.
    pub(crate) fn single_pair(&self) -> Option<(Sym, Sym)> {
        match self.reqs.as_slice() {
            [CReq::In(k, v)] if v.len() == 1 => Some((*k, v[0])),
            _ => None,
        }
    }

    /// Whether `labels` (sorted pairs) satisfy the selector. `interner` is
    /// needed only for `Gt`/`Lt`.
    #[inline]
    pub(crate) fn matches(&self, labels: &[(Sym, Sym)], interner: &Interner) -> bool {
        self.reqs.iter().all(|r| r.matches(labels, interner))
    }
}

impl CReq {
    #[inline]
    fn matches(&self, labels: &[(Sym, Sym)], interner: &Interner) -> bool {
        match self {
            CReq::In(k, vs) => label_value(labels, *k).is_some_and(|v| vs.contains(&v)),
            CReq::NotIn(k, vs) => label_value(labels, *k).is_none_or(|v| !vs.contains(&v)),
            CReq::Exists(k) => label_value(labels, *k).is_some(),
            CReq::DoesNotExist(k) => label_value(labels, *k).is_none(),
            CReq::Gt(k, n) => label_value(labels, *k)
                .and_then(|v| interner.resolve(v).parse::<i64>().ok())
                .is_some_and(|x| x > *n),
            CReq::Lt(k, n) => label_value(labels, *k)
                .and_then(|v| interner.resolve(v).parse::<i64>().ok())
                .is_some_and(|x| x < *n),
            CReq::Never => false,
        }
    }
}

/// Whether a plain label map satisfies `sel` (string comparison; used for a
/// request's own labels, which may not be interned yet).
pub(crate) fn matches_map(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    sel.match_labels
        .iter()
        .all(|(k, v)| labels.get(k) == Some(v))
        && sel.match_expressions.iter().all(|e| {
            let val = labels.get(&e.key);
            let num = |v: Option<&String>| v.and_then(|v| v.parse::<i64>().ok());
            let bound = || e.values.first().and_then(|v| v.parse::<i64>().ok());
            match e.operator {
                Operator::In => val.is_some_and(|v| e.values.contains(v)),
                Operator::NotIn => val.is_none_or(|v| !e.values.contains(v)),
                Operator::Exists => val.is_some(),
                Operator::DoesNotExist => val.is_none(),
                Operator::Gt => matches!((num(val), bound()), (Some(x), Some(b)) if x > b),
                Operator::Lt => matches!((num(val), bound()), (Some(x), Some(b)) if x < b),
            }
        })
}

fn compile(
    match_labels: &BTreeMap<String, String>,
    exprs: &[Requirement],
    mut sym: impl FnMut(&str) -> Option<Sym>,
) -> CSelector {
    let mut reqs = Vec::with_capacity(match_labels.len() + exprs.len());
    for (k, v) in match_labels {
        match (sym(k), sym(v)) {
            (Some(k), Some(v)) => reqs.push(CReq::In(k, vec![v])),
            _ => reqs.push(CReq::Never),
        }
    }
    for e in exprs {
        let key = sym(&e.key);
        let mut values: Vec<Sym> = e.values.iter().filter_map(|v| sym(v)).collect();
        values.sort_unstable();
        values.dedup();
        let req = match (e.operator, key) {
            (Operator::In, Some(k)) if !values.is_empty() => CReq::In(k, values),
            (Operator::In, _) => CReq::Never,
            (Operator::NotIn, Some(k)) if !values.is_empty() => CReq::NotIn(k, values),
            (Operator::NotIn, _) => continue,
            (Operator::Exists, Some(k)) => CReq::Exists(k),
            (Operator::Exists, None) => CReq::Never,
            (Operator::DoesNotExist, Some(k)) => CReq::DoesNotExist(k),
            (Operator::DoesNotExist, None) => continue,
            (Operator::Gt | Operator::Lt, None) => CReq::Never,
            (op, Some(k)) => match e.values.first().and_then(|v| v.parse::<i64>().ok()) {
                Some(n) if e.values.len() == 1 => {
                    if op == Operator::Gt {
                        CReq::Gt(k, n)
                    } else {
                        CReq::Lt(k, n)
                    }
                }
                _ => CReq::Never,
            },
        };
        reqs.push(req);
    }
    // Put the cheapest, most selective requirements first.
    reqs.sort_by_key(|r| match r {
        CReq::Never => 0,
        CReq::In(..) => 1,
        CReq::Exists(_) | CReq::DoesNotExist(_) => 2,
        CReq::NotIn(..) => 3,
        CReq::Gt(..) | CReq::Lt(..) => 4,
    });
    CSelector { reqs }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(i: &mut Interner, pairs: &[(&str, &str)]) -> Vec<(Sym, Sym)> {
        let mut v: Vec<_> = pairs
            .iter()
            .map(|(k, v)| (i.intern(k), i.intern(v)))
            .collect();
        v.sort_unstable();
        v
    }

    fn req(key: &str, op: Operator, values: &[&str]) -> Requirement {
        Requirement {
            key: key.into(),
            operator: op,
            values: values.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn operators() {
        let mut i = Interner::default();
        let l = labels(&mut i, &[("app", "web"), ("gen", "7")]);
        let cases = [
            (req("app", Operator::In, &["web", "db"]), true),
            (req("app", Operator::In, &["db"]), false),
            (req("app", Operator::In, &["nope-unknown"]), false),
            (req("app", Operator::NotIn, &["db"]), true),
            (req("app", Operator::NotIn, &["web"]), false),
            (req("zzz-unknown", Operator::NotIn, &["web"]), true),
            (req("app", Operator::Exists, &[]), true),
            (req("zzz-unknown", Operator::Exists, &[]), false),
            (req("app", Operator::DoesNotExist, &[]), false),
            (req("zzz-unknown", Operator::DoesNotExist, &[]), true),
            (req("gen", Operator::Gt, &["6"]), true),
            (req("gen", Operator::Gt, &["7"]), false),
            (req("gen", Operator::Lt, &["8"]), true),
            (req("gen", Operator::Lt, &["x"]), false),
            (req("app", Operator::Gt, &["1"]), false),
        ];
        for (r, want) in cases {
            let sel = LabelSelector {
                match_labels: BTreeMap::new(),
                match_expressions: vec![r.clone()],
            };
            assert_eq!(CSelector::lookup(&i, &sel).matches(&l, &i), want, "{r:?}");
        }
        assert!(CSelector::lookup(&i, &LabelSelector::default()).matches(&l, &i));
        assert!(CSelector::lookup(&i, &LabelSelector::eq("app", "web")).matches(&l, &i));
        assert!(!CSelector::lookup(&i, &LabelSelector::eq("app", "db")).matches(&l, &i));
    }

    #[test]
    fn single_pair_and_first_in() {
        let mut i = Interner::default();
        let s = CSelector::intern(&mut i, &LabelSelector::eq("app", "web"));
        assert!(s.single_pair().is_some());
        assert!(s.first_in().is_some());
        assert!(!s.is_never());
    }
}
