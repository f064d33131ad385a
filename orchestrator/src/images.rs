//! Which host files an API user may name as an image.
//!
//! A Volume's `spec.source.image`, the import subresource's `image` and a
//! VMI's `kernelBoot.container` directory are paths on the cluster host,
//! read as root. Without a rule they could name the cluster's own CA key or
//! tokens. [`ImagePolicy`] is that rule: an explicit allow-list of image
//! directories (the operator's import directories and the server's upload
//! directory), never an arbitrary host path, and never a file inside the
//! cluster's data directory unless the image directory itself was placed
//! there on purpose (`<data>/images`).
//!
//! Paths are resolved with every symbolic link followed before the check,
//! and the resolved path is what callers then open.

use std::path::{Component, Path, PathBuf};

/// A refused image path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageSourceError {
    /// Not an absolute path.
    #[error("image {0:?}: must be an absolute path inside an image directory")]
    NotAbsolute(String),
    /// A `json:`, `nbd:` or other pseudo-protocol name, or a URL where a file is needed.
    #[error(
        "image {0:?}: only files inside an image directory can be named here, not a protocol or URL"
    )]
    Protocol(String),
    /// The file cannot be resolved.
    #[error("image {path:?}: {message}")]
    Unreadable {
        /// The path as given.
        path: String,
        /// Why.
        message: String,
    },
    /// Outside every image directory, or inside a denied one.
    #[error(
        "image {path:?} is not inside an image directory ({allowed}); copy it into one, or upload it (`sheaf image import FILE` uploads)"
    )]
    NotAllowed {
        /// The path as given.
        path: String,
        /// The image directories, comma-separated.
        allowed: String,
    },
    /// A relative part (kernelPath, initrdPath) that is not plain.
    #[error("{what} {value:?}: must be a plain relative path (no `..`)")]
    BadRelative {
        /// Which field.
        what: &'static str,
        /// The value.
        value: String,
    },
    /// Not a regular file.
    #[error("image {0:?}: not a regular file")]
    NotAFile(String),
    /// A URL that is not a plain `http://` or `https://` URL with a host.
    #[error("image URL {url:?}: {message}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// Why.
        message: String,
    },
}

/// Where an image source points, once checked by [`ImagePolicy::source`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    /// A file inside an image directory (symbolic links resolved).
    File(PathBuf),
    /// An `http://` or `https://` URL (downloaded by the importer).
    Url(String),
}

/// Longest URL accepted.
pub const MAX_URL_LEN: usize = 4096;

/// Checks that `url` is a plain `http://` or `https://` URL with a host:
/// no other scheme (`file://`, `ftp://`, `docker://`), no credentials in
/// the authority, no whitespace or control characters. Redirect targets
/// are checked with the same rule.
pub fn check_url(url: &str) -> Result<(), ImageSourceError> {
    let bad = |m: &str| ImageSourceError::BadUrl {
        url: url.chars().take(200).collect(),
        message: m.to_string(),
    };
    if url.len() > MAX_URL_LEN {
        return Err(bad("longer than 4096 bytes"));
    }
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad("contains whitespace or control characters"));
    }
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(bad("not a URL (expected http:// or https://)"));
    };
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return Err(bad(&format!(
            "scheme {scheme:?} is not allowed; only http and https URLs are downloaded"
        )));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if authority.contains('@') {
        return Err(bad("credentials in the URL are not accepted"));
    }
    let host = match authority.rsplit_once(':') {
        Some((h, p)) if !authority.ends_with(']') => {
            if p.parse::<u16>().is_err() {
                return Err(bad(&format!("port {p:?} is not a number below 65536")));
            }
            h
        }
        _ => authority,
    };
    if host.is_empty() || host == "[]" {
        return Err(bad("no host"));
    }
    Ok(())
}

/// The allow-list of image directories.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImagePolicy {
    roots: Vec<PathBuf>,
    denied: Vec<PathBuf>,
}

fn canonical(p: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(p).ok()
}

impl ImagePolicy {
    /// Images may come from under any of `roots`; nothing under any of
    /// `denied` (the data directory: keys, tokens, replica data) is allowed
    /// unless the root it is under is itself inside that denied directory.
    pub fn new(roots: Vec<PathBuf>, denied: Vec<PathBuf>) -> Self {
        ImagePolicy { roots, denied }
    }

    /// The image directories.
    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    /// The directories kept out (unless an image directory lies inside).
    pub fn denied(&self) -> &[PathBuf] {
        &self.denied
    }

    fn allowed_list(&self) -> String {
        if self.roots.is_empty() {
            return "none configured".into();
        }
        self.roots
            .iter()
            .map(|r| r.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Checks that the resolved `real` path is allowed.
    fn check(&self, given: &str, real: &Path) -> Result<(), ImageSourceError> {
        let denied: Vec<PathBuf> = self.denied.iter().filter_map(|d| canonical(d)).collect();
        let ok = self.roots.iter().filter_map(|r| canonical(r)).any(|root| {
            real.starts_with(&root)
                && denied
                    .iter()
                    .all(|d| !real.starts_with(d) || root.starts_with(d))
        });
        if ok {
            Ok(())
        } else {
            Err(ImageSourceError::NotAllowed {
                path: given.to_string(),
                allowed: self.allowed_list(),
            })
        }
    }

    /// Checks a Volume's `spec.source.image`: an `http(s)://` URL (checked
    /// with [`check_url`]; downloaded, never read from the host) or a file
    /// inside an image directory ([`ImagePolicy::resolve`]). `file://` and
    /// every other scheme are refused.
    pub fn source(&self, image: &str) -> Result<ImageSource, ImageSourceError> {
        let lower = image.get(..8).unwrap_or(image).to_ascii_lowercase();
        if lower.starts_with("http://") || lower.starts_with("https://") {
            check_url(image)?;
            return Ok(ImageSource::Url(image.to_string()));
        }
        if image.contains("://") {
            check_url(image)?;
        }
        self.resolve(image).map(ImageSource::File)
    }

    /// Resolves `path` (absolute, symbolic links followed) to a regular file
    /// inside an image directory.
    pub fn resolve(&self, path: &str) -> Result<PathBuf, ImageSourceError> {
        if path.contains("://") || path.starts_with("json:") || path.starts_with("nbd:") {
            return Err(ImageSourceError::Protocol(path.to_string()));
        }
        let p = Path::new(path);
        if !p.is_absolute() {
            return Err(ImageSourceError::NotAbsolute(path.to_string()));
        }
        let real = std::fs::canonicalize(p).map_err(|e| ImageSourceError::Unreadable {
            path: path.to_string(),
            message: e.to_string(),
        })?;
        self.check(path, &real)?;
        if !real.is_file() {
            return Err(ImageSourceError::NotAFile(path.to_string()));
        }
        Ok(real)
    }

    /// Resolves `rel` (a `kernelBoot` kernelPath or initrdPath; a leading `/`
    /// means the root of `base`) inside directory `base`: `rel` must be a
    /// plain relative path and the result an allowed regular file.
    pub fn resolve_in(
        &self,
        base: &str,
        what: &'static str,
        rel: &str,
    ) -> Result<PathBuf, ImageSourceError> {
        let trimmed = rel.trim_start_matches('/');
        let plain = !trimmed.is_empty()
            && Path::new(trimmed)
                .components()
                .all(|c| matches!(c, Component::Normal(_)));
        if !plain {
            return Err(ImageSourceError::BadRelative {
                what,
                value: rel.to_string(),
            });
        }
        let joined = Path::new(base).join(trimmed);
        self.resolve(&joined.to_string_lossy())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_files_in_image_directories() {
        let t = tempfile::tempdir().unwrap();
        let data = t.path().join("data");
        let images = data.join("images");
        let extra = t.path().join("extra");
        std::fs::create_dir_all(&images).unwrap();
        std::fs::create_dir_all(&extra).unwrap();
        std::fs::write(data.join("ca.key"), b"secret").unwrap();
        std::fs::write(images.join("a.img"), b"x").unwrap();
        std::fs::write(extra.join("b.img"), b"x").unwrap();
        std::fs::write(t.path().join("outside.img"), b"x").unwrap();
        std::os::unix::fs::symlink(data.join("ca.key"), images.join("key.img")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", extra.join("passwd.img")).unwrap();
        let s = |p: &Path| p.to_str().unwrap().to_string();

        let pol = ImagePolicy::new(vec![images.clone(), extra.clone()], vec![data.clone()]);
        assert!(pol.resolve(&s(&images.join("a.img"))).is_ok());
        assert!(pol.resolve(&s(&extra.join("b.img"))).is_ok());
        for bad in [
            data.join("ca.key"),
            t.path().join("outside.img"),
            images.join("key.img"),
            extra.join("passwd.img"),
            images.join("../ca.key"),
            PathBuf::from("/etc/shadow"),
        ] {
            let e = pol.resolve(&s(&bad)).unwrap_err();
            assert!(
                matches!(e, ImageSourceError::NotAllowed { .. }),
                "{}: {e}",
                bad.display()
            );
        }
        assert!(matches!(
            pol.resolve("rel.img"),
            Err(ImageSourceError::NotAbsolute(_))
        ));
        for p in [
            "json:{\"file.filename\":\"/etc/shadow\"}",
            "nbd:127.0.0.1:1",
            "http://x/y",
        ] {
            assert!(
                matches!(pol.resolve(p), Err(ImageSourceError::Protocol(_))),
                "{p}"
            );
        }
        assert!(matches!(
            pol.resolve(&s(&images)),
            Err(ImageSourceError::NotAFile(_))
        ));

        // A root that contains the data directory still keeps it out.
        let wide = ImagePolicy::new(vec![t.path().to_path_buf()], vec![data.clone()]);
        assert!(wide.resolve(&s(&t.path().join("outside.img"))).is_ok());
        assert!(wide.resolve(&s(&data.join("ca.key"))).is_err());
        assert!(wide.resolve(&s(&images.join("a.img"))).is_err());

        // URLs: http and https only.
        assert_eq!(
            pol.source("https://example.com/a.qcow2").unwrap(),
            ImageSource::Url("https://example.com/a.qcow2".into())
        );
        assert!(pol.source("HTTP://127.0.0.1:8080/a.img").is_ok());
        assert_eq!(
            pol.source(&s(&images.join("a.img"))).unwrap(),
            ImageSource::File(images.join("a.img").canonicalize().unwrap())
        );
        for bad in [
            "file:///etc/shadow",
            "ftp://h/x",
            "docker://quay.io/x",
            "http://",
            "http:///etc/shadow",
            "http://user:pw@h/x",
            "http://h:99999/x",
            "http://h/a b",
        ] {
            assert!(
                matches!(pol.source(bad), Err(ImageSourceError::BadUrl { .. })),
                "{bad}: {:?}",
                pol.source(bad)
            );
        }
        assert!(pol.source("/etc/shadow").is_err());
        assert!(check_url("http://[::1]:8080/x").is_ok());

        // kernelBoot parts.
        let base = s(&images);
        assert!(pol.resolve_in(&base, "kernelPath", "/a.img").is_ok());
        for bad in ["../ca.key", "/../ca.key", "", "/", "a/../../ca.key"] {
            assert!(
                matches!(
                    pol.resolve_in(&base, "kernelPath", bad),
                    Err(ImageSourceError::BadRelative { .. })
                ),
                "{bad}"
            );
        }
        assert!(pol.resolve_in("/etc", "kernelPath", "shadow").is_err());
        assert!(
            ImagePolicy::default()
                .resolve(&s(&images.join("a.img")))
                .is_err()
        );
    }
}
