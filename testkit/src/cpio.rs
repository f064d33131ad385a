// SPDX-License-Identifier: Apache-2.0
//! A deterministic initramfs writer: cpio "newc" archives, gzip-compressed.
//!
//! Entries are kept sorted by path, so parents come before children and the
//! same inputs always give the same bytes (every mtime, uid and gid is 0).
//! Parent directories are created implicitly.
//!
//! ```
//! use sheaf_testkit::cpio::Initramfs;
//!
//! let mut fs = Initramfs::new();
//! fs.file("init", b"#!/bin/sh\necho hi\n".to_vec(), 0o755)
//!     .symlink("bin/sh", "busybox")
//!     .char_dev("dev/console", 5, 1, 0o600);
//! let cpio = fs.to_cpio();
//! assert!(cpio.starts_with(b"070701"));
//! ```

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::Path;

use flate2::Compression;
use flate2::write::GzEncoder;

use crate::error::{Result, io_err};

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;

#[derive(Debug, Clone)]
enum Entry {
    Dir { mode: u32 },
    File { data: Vec<u8>, mode: u32 },
    Symlink { target: String },
    CharDev { major: u32, minor: u32, mode: u32 },
}

/// An in-memory initramfs under construction.
#[derive(Debug, Clone, Default)]
pub struct Initramfs {
    entries: BTreeMap<String, Entry>,
}

fn normalize(path: &str) -> String {
    path.trim_start_matches('/')
        .trim_end_matches('/')
        .to_string()
}

impl Initramfs {
    /// An empty archive.
    pub fn new() -> Self {
        Self::default()
    }

    fn parents(&mut self, path: &str) {
        let mut end = 0;
        while let Some(i) = path[end..].find('/') {
            let dir = &path[..end + i];
            self.entries
                .entry(dir.to_string())
                .or_insert(Entry::Dir { mode: 0o755 });
            end += i + 1;
        }
    }

    /// Adds a directory (mode bits only, e.g. `0o755`).
    pub fn dir(&mut self, path: &str) -> &mut Self {
        let path = normalize(path);
        self.parents(&path);
        self.entries.insert(path, Entry::Dir { mode: 0o755 });
        self
    }

    /// Adds a regular file with the given permission bits.
    pub fn file(&mut self, path: &str, data: Vec<u8>, mode: u32) -> &mut Self {
        let path = normalize(path);
        self.parents(&path);
        self.entries.insert(
            path,
            Entry::File {
                data,
                mode: mode & 0o7777,
            },
        );
        self
    }

    /// Adds a symbolic link at `path` pointing to `target`.
    pub fn symlink(&mut self, path: &str, target: &str) -> &mut Self {
        let path = normalize(path);
        self.parents(&path);
        self.entries.insert(
            path,
            Entry::Symlink {
                target: target.to_string(),
            },
        );
        self
    }

    /// Adds a character device node (for example `dev/console`, 5:1).
    pub fn char_dev(&mut self, path: &str, major: u32, minor: u32, mode: u32) -> &mut Self {
        let path = normalize(path);
        self.parents(&path);
        self.entries.insert(
            path,
            Entry::CharDev {
                major,
                minor,
                mode: mode & 0o7777,
            },
        );
        self
    }

    /// Whether an entry exists at `path`.
    pub fn contains(&self, path: &str) -> bool {
        self.entries.contains_key(&normalize(path))
    }

    /// The uncompressed cpio newc archive.
    pub fn to_cpio(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (ino, (name, entry)) in self.entries.iter().enumerate() {
            let ino = ino as u32 + 1;
            match entry {
                Entry::Dir { mode } => {
                    push_entry(&mut out, ino, name, S_IFDIR | mode, 2, &[], 0, 0)
                }
                Entry::File { data, mode } => {
                    push_entry(&mut out, ino, name, S_IFREG | mode, 1, data, 0, 0)
                }
                Entry::Symlink { target } => push_entry(
                    &mut out,
                    ino,
                    name,
                    S_IFLNK | 0o777,
                    1,
                    target.as_bytes(),
                    0,
                    0,
                ),
                Entry::CharDev { major, minor, mode } => {
                    push_entry(&mut out, ino, name, S_IFCHR | mode, 1, &[], *major, *minor)
                }
            }
        }
        push_entry(&mut out, 0, "TRAILER!!!", 0, 1, &[], 0, 0);
        out
    }

    /// The archive, gzip-compressed (fast level: the kernel unpacks any level).
    pub fn to_cpio_gz(&self) -> Vec<u8> {
        let cpio = self.to_cpio();
        let mut enc = GzEncoder::new(Vec::with_capacity(cpio.len() / 2), Compression::fast());
        // Writing to a Vec cannot fail.
        let _ = enc.write_all(&cpio);
        enc.finish().unwrap_or_default()
    }

    /// Writes the gzip-compressed archive to `path`.
    pub fn write_gz(&self, path: &Path) -> Result<()> {
        fs::write(path, self.to_cpio_gz()).map_err(io_err("write initramfs", path))
    }
}

#[allow(clippy::too_many_arguments)]
fn push_entry(
    out: &mut Vec<u8>,
    ino: u32,
    name: &str,
    mode: u32,
    nlink: u32,
    data: &[u8],
    rdev_major: u32,
    rdev_minor: u32,
) {
    let namesize = name.len() + 1;
    let header = format!(
        "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}\
         {dmaj:08x}{dmin:08x}{rmaj:08x}{rmin:08x}{namesize:08x}{check:08x}",
        uid = 0,
        gid = 0,
        mtime = 0,
        size = data.len(),
        dmaj = 0,
        dmin = 0,
        rmaj = rdev_major,
        rmin = rdev_minor,
        check = 0,
    );
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad4(out);
    out.extend_from_slice(data);
    pad4(out);
}

fn pad4(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};

    use super::*;

    #[test]
    fn parents_are_created_and_sorted_first() {
        let mut fs = Initramfs::new();
        fs.file("a/b/c.txt", b"x".to_vec(), 0o644);
        assert!(fs.contains("a"));
        assert!(fs.contains("a/b"));
        let cpio = fs.to_cpio();
        let text = String::from_utf8_lossy(&cpio);
        let a = text.find("a\0").unwrap();
        let ab = text.find("a/b\0").unwrap();
        let abc = text.find("a/b/c.txt\0").unwrap();
        assert!(a < ab && ab < abc);
        assert!(text.contains("TRAILER!!!"));
    }

    #[test]
    fn deterministic() {
        let mut a = Initramfs::new();
        a.file("x", vec![1, 2, 3], 0o755).symlink("y", "x");
        let mut b = Initramfs::new();
        b.symlink("y", "x").file("x", vec![1, 2, 3], 0o755);
        assert_eq!(a.to_cpio_gz(), b.to_cpio_gz());
    }

    /// Cross-check with the system `cpio` when it is installed.
    #[test]
    fn system_cpio_reads_it() {
        if Command::new("cpio").arg("--version").output().is_err() {
            eprintln!("cpio not installed; skipping");
            return;
        }
        let mut fs = Initramfs::new();
        fs.file("dir/hello", b"hello\n".to_vec(), 0o644)
            .symlink("link", "dir/hello")
            .char_dev("dev/console", 5, 1, 0o600);
        let mut child = Command::new("cpio")
            .args(["-t", "-v", "--quiet"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(&fs.to_cpio())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let listing = String::from_utf8_lossy(&out.stdout);
        assert!(listing.contains("dir/hello"), "{listing}");
        assert!(listing.contains("link -> dir/hello"), "{listing}");
        assert!(listing.contains("crw-------"), "{listing}");
    }
}
