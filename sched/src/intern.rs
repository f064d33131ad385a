// SPDX-License-Identifier: Apache-2.0
//! String interning: label keys and values become `u32` symbols so the hot
//! path compares integers, never strings.

use std::collections::HashMap;

/// An interned string (label key or value, taint key or value).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sym(pub(crate) u32);

impl Sym {
    /// Stands for a string that was never interned.
    pub(crate) const UNKNOWN: Sym = Sym(u32::MAX);
}

/// Maps strings to [`Sym`]s and back. Symbols are never freed: the set of
/// distinct label keys and values in a cluster is small and stable.
#[derive(Clone, Debug, Default)]
pub(crate) struct Interner {
    map: HashMap<Box<str>, u32>,
    strings: Vec<Box<str>>,
}

impl Interner {
    /// The symbol of `s`, creating it if needed.
    pub(crate) fn intern(&mut self, s: &str) -> Sym {
        if let Some(&id) = self.map.get(s) {
            return Sym(id);
        }
        let id = u32::try_from(self.strings.len()).unwrap_or(u32::MAX);
        self.strings.push(s.into());
        self.map.insert(s.into(), id);
        Sym(id)
    }

    /// The symbol of `s` if it was ever interned.
    pub(crate) fn get(&self, s: &str) -> Option<Sym> {
        self.map.get(s).map(|&id| Sym(id))
    }

    /// The string of a symbol.
    pub(crate) fn resolve(&self, sym: Sym) -> &str {
        self.strings.get(sym.0 as usize).map_or("", |s| s)
    }
}

/// Sorted `(key, value)` label pairs.
pub(crate) type Labels = Vec<(Sym, Sym)>;

/// Interns a label map into sorted pairs (creating symbols).
pub(crate) fn intern_labels<'a>(
    interner: &mut Interner,
    labels: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Labels {
    let mut out: Labels = labels
        .into_iter()
        .map(|(k, v)| (interner.intern(k), interner.intern(v)))
        .collect();
    out.sort_unstable();
    out
}

/// Value of `key` in sorted `labels`.
#[inline]
pub(crate) fn label_value(labels: &[(Sym, Sym)], key: Sym) -> Option<Sym> {
    if labels.len() <= 8 {
        labels.iter().find(|(k, _)| *k == key).map(|&(_, v)| v)
    } else {
        labels
            .binary_search_by_key(&key, |&(k, _)| k)
            .ok()
            .map(|i| labels[i].1)
    }
}
