//! Object names and the host paths built from them.
//!
//! Names reach the host's file system: a node agent keeps a volume's replica
//! in `replicas/{namespace}_{name}` and removes that directory when the
//! volume goes. Two rules keep an API user from steering those paths:
//!
//! - every object's namespace and name are checked as Kubernetes checks them
//!   ([`check_object_name`], [`check_namespace`]) inside the store's create
//!   path, so no API route (typed, generic, subresource or a future one) can
//!   store a name that is not a plain DNS-1123 subdomain;
//! - every path built from a name, a uid or a node name goes through
//!   [`child`] (or is re-checked by [`ensure_child`] before a remove), which
//!   refuses anything that is not one plain component directly under its
//!   parent, and refuses a symbolic link in its place.
//!
//! The second rule holds even for objects stored before the first one
//! existed, or written by another store backend.

use std::path::{Component, Path, PathBuf};

/// Checks a DNS-1123 subdomain (object names): lower-case alphanumerics, `-`
/// and `.`, at most 253, each dot-separated label non-empty and starting and
/// ending with an alphanumeric (so never `.`, `..` or anything with a `/`).
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

/// Checks a DNS-1123 label (namespaces, disk and volume names): at most 63, no dots.
pub fn is_dns_label(s: &str) -> bool {
    s.len() <= 63 && !s.contains('.') && is_dns_subdomain(s)
}

/// Checks a path-segment name (Kubernetes' rule for RBAC objects, whose
/// names such as `system:node` are not subdomains): not empty, not `.` or
/// `..`, no `/` or `%`.
pub fn is_path_segment_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '%', '\0'])
}

/// A namespace or name the store refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The name breaks its kind's rule.
    #[error("metadata.name: Invalid value: {name:?}: {rule}")]
    Name {
        /// The name as given.
        name: String,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// The namespace is not a DNS-1123 label.
    #[error(
        "metadata.namespace: Invalid value: {0:?}: a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', start and end with an alphanumeric character, and be at most 63 characters"
    )]
    Namespace(String),
}

const SUBDOMAIN_RULE: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', must start and end with an alphanumeric character, and be at most 253 characters";
const PATH_SEGMENT_RULE: &str = "may not be '.' or '..' and may not contain '/' or '%'";

/// Checks an object's name as Kubernetes does for its API group: RBAC
/// objects take path-segment names, every other kind a DNS-1123 subdomain.
pub fn check_object_name(group: &str, name: &str) -> Result<(), NameError> {
    let (ok, rule) = if group == "rbac.authorization.k8s.io" {
        (is_path_segment_name(name), PATH_SEGMENT_RULE)
    } else {
        (is_dns_subdomain(name), SUBDOMAIN_RULE)
    };
    if ok {
        Ok(())
    } else {
        Err(NameError::Name {
            name: name.to_string(),
            rule,
        })
    }
}

/// Checks a namespace (empty means cluster-scoped and passes).
pub fn check_namespace(ns: &str) -> Result<(), NameError> {
    if ns.is_empty() || is_dns_label(ns) {
        Ok(())
    } else {
        Err(NameError::Namespace(ns.to_string()))
    }
}

/// A host path built from a name that would leave its parent directory.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    /// The component is not one plain file name.
    #[error("{component:?} is not a plain file name under {}", parent.display())]
    NotAComponent {
        /// The directory it was to go under.
        parent: PathBuf,
        /// The offending component.
        component: String,
    },
    /// The path is not directly under the directory it must stay in.
    #[error("{} is not directly under {}", path.display(), parent.display())]
    Outside {
        /// The directory it must stay in.
        parent: PathBuf,
        /// The path.
        path: PathBuf,
    },
    /// A symbolic link stands where a directory or file of ours should be.
    #[error("{} is a symbolic link; refusing to follow it out of {}", path.display(), parent.display())]
    Symlink {
        /// The directory it must stay in.
        parent: PathBuf,
        /// The path.
        path: PathBuf,
    },
}

fn is_plain_component(c: &str) -> bool {
    if c.is_empty() || c.len() > 255 || c.contains(['/', '\0']) {
        return false;
    }
    let mut comps = Path::new(c).components();
    matches!(
        (comps.next(), comps.next()),
        (Some(Component::Normal(n)), None) if n == c
    )
}

/// `parent/component`, after checking that `component` is one plain file
/// name (not empty, `.`, `..`, nothing with a `/` or NUL) and that no
/// symbolic link stands at the result.
pub fn child(parent: &Path, component: &str) -> Result<PathBuf, PathError> {
    if !is_plain_component(component) {
        return Err(PathError::NotAComponent {
            parent: parent.to_path_buf(),
            component: component.to_string(),
        });
    }
    let path = parent.join(component);
    no_symlink(parent, &path)?;
    Ok(path)
}

/// Checks that an already built `path` is directly under `parent` as one
/// plain component with no symbolic link at it: the check to repeat just
/// before a create or a remove of a path that was built elsewhere.
pub fn ensure_child(parent: &Path, path: &Path) -> Result<(), PathError> {
    let outside = || PathError::Outside {
        parent: parent.to_path_buf(),
        path: path.to_path_buf(),
    };
    if path.parent() != Some(parent) {
        return Err(outside());
    }
    match path.file_name().and_then(|n| n.to_str()) {
        Some(n) if is_plain_component(n) => {}
        _ => return Err(outside()),
    }
    no_symlink(parent, path)
}

fn no_symlink(parent: &Path, path: &Path) -> Result<(), PathError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(PathError::Symlink {
            parent: parent.to_path_buf(),
            path: path.to_path_buf(),
        }),
        _ => Ok(()),
    }
}

/// Removes the directory tree at `path` after [`ensure_child`] passes
/// (a missing directory is not an error).
pub fn remove_dir_under(parent: &Path, path: &Path) -> std::io::Result<()> {
    ensure_child(parent, path).map_err(std::io::Error::other)?;
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_kubernetes_rules() {
        for ok in ["a", "vm-1", "a.b", "0abc", &"a".repeat(253)] {
            assert!(check_object_name("kubevirt.io", ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/../../b",
            "a/b",
            "A",
            "-a",
            "a-",
            "a..b",
            "a_b",
            "a\0",
            &"a".repeat(254),
        ] {
            let e = check_object_name("sheaf.dev", bad).unwrap_err();
            assert!(e.to_string().contains("metadata.name"), "{e}");
        }
        assert!(check_object_name("rbac.authorization.k8s.io", "system:node").is_ok());
        for bad in ["..", ".", "a/b", "a%2f", ""] {
            assert!(check_object_name("rbac.authorization.k8s.io", bad).is_err());
        }
        assert!(check_namespace("").is_ok());
        assert!(check_namespace("default").is_ok());
        for bad in ["..", "a.b", "a/b", "Default", &"a".repeat(64)] {
            assert!(check_namespace(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn child_stays_under_its_parent() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        assert_eq!(child(p, "x").unwrap(), p.join("x"));
        assert_eq!(child(p, "default_vol.1").unwrap(), p.join("default_vol.1"));
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "../b",
            "/etc",
            "a\0b",
            "default_../../x",
        ] {
            assert!(child(p, bad).is_err(), "{bad:?}");
        }
        std::os::unix::fs::symlink("/", p.join("link")).unwrap();
        assert!(matches!(child(p, "link"), Err(PathError::Symlink { .. })));
        assert!(ensure_child(p, &p.join("link")).is_err());
        assert!(ensure_child(p, &p.join("a/b")).is_err());
        assert!(ensure_child(p, &p.join("..")).is_err());
        assert!(ensure_child(p, Path::new("/etc")).is_err());
        assert!(ensure_child(p, &p.join("ok")).is_ok());
        // A refused remove leaves the target alone.
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), b"x").unwrap();
        assert!(remove_dir_under(p, outside.path()).is_err());
        assert!(outside.path().join("keep").exists());
        std::fs::create_dir(p.join("gone")).unwrap();
        remove_dir_under(p, &p.join("gone")).unwrap();
        assert!(!p.join("gone").exists());
        remove_dir_under(p, &p.join("gone")).unwrap();
    }
}
