// SPDX-License-Identifier: Apache-2.0
//! Statically linked builds of workspace programs, to run inside the
//! nested-KVM box (whose L1 has no libc).
//!
//! Builds with `RUSTFLAGS='-C target-feature=+crt-static' cargo build
//! --target x86_64-unknown-linux-gnu` into a target directory of its own
//! (`$CARGO_TARGET_DIR/static`, or `target/static`), so it neither fights
//! the caller's build over the lock nor invalidates its cache.
//!
//! ```no_run
//! # fn main() -> sheaf_testkit::Result<()> {
//! let probe = sheaf_testkit::static_build::build_example("sheaf-testkit", "kvm_probe")?;
//! # let _ = probe;
//! # Ok(())
//! # }
//! ```

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tracing::info;

use crate::error::{Result, TestkitError, io_err};
use crate::kernel::elf;

/// The target triple of static builds.
pub const TARGET: &str = "x86_64-unknown-linux-gnu";

/// Environment variable that overrides the static builds' target directory.
pub const TARGET_DIR_ENV: &str = "SHEAF_STATIC_TARGET_DIR";

/// Which cargo target to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `--example NAME`
    Example(String),
    /// `--bin NAME`
    Bin(String),
    /// `--test NAME` (an integration test binary; run it with test-harness
    /// arguments such as `--exact name --nocapture`).
    Test(String),
    /// `--lib` unit tests of the package.
    LibTests,
}

/// A static build (builder).
#[derive(Debug, Clone)]
pub struct StaticBuild {
    package: String,
    target: Target,
    release: bool,
    features: Vec<String>,
    target_dir: Option<PathBuf>,
}

/// Builds `--example name` of `package` statically (dev profile) and returns
/// the executable.
pub fn build_example(package: &str, name: &str) -> Result<PathBuf> {
    StaticBuild::new(package, Target::Example(name.into())).build()
}

/// Builds the integration test `name` of `package` statically and returns
/// the test executable.
pub fn build_test(package: &str, name: &str) -> Result<PathBuf> {
    StaticBuild::new(package, Target::Test(name.into())).build()
}

/// The workspace root (where the root `Cargo.toml` is).
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

/// The static builds' target directory.
pub fn target_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(TARGET_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    match std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join("static"),
        None => workspace_root().join("target").join("static"),
    }
}

impl StaticBuild {
    /// A dev-profile build of `target` in `package`.
    pub fn new(package: &str, target: Target) -> Self {
        Self {
            package: package.into(),
            target,
            release: false,
            features: Vec::new(),
            target_dir: None,
        }
    }

    /// Builds with `--release`.
    pub fn release(mut self, release: bool) -> Self {
        self.release = release;
        self
    }

    /// Enables a cargo feature.
    pub fn feature(mut self, feature: &str) -> Self {
        self.features.push(feature.into());
        self
    }

    /// Uses this target directory instead of [`target_dir`].
    pub fn target_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.target_dir = Some(dir.into());
        self
    }

    fn command(&self) -> (Command, String) {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let target_dir = self.target_dir.clone().unwrap_or_else(target_dir);
        let mut args: Vec<String> = Vec::new();
        let test = matches!(self.target, Target::Test(_) | Target::LibTests);
        if test {
            args.extend(["test".into(), "--no-run".into()]);
        } else {
            args.push("build".into());
        }
        args.extend([
            "--manifest-path".into(),
            workspace_root().join("Cargo.toml").display().to_string(),
            "-p".into(),
            self.package.clone(),
            "--target".into(),
            TARGET.into(),
            "--target-dir".into(),
            target_dir.display().to_string(),
            "--message-format=json-render-diagnostics".into(),
        ]);
        match &self.target {
            Target::Example(n) => args.extend(["--example".into(), n.clone()]),
            Target::Bin(n) => args.extend(["--bin".into(), n.clone()]),
            Target::Test(n) => args.extend(["--test".into(), n.clone()]),
            Target::LibTests => args.push("--lib".into()),
        }
        if self.release {
            args.push("--release".into());
        }
        if !self.features.is_empty() {
            args.extend(["--features".into(), self.features.join(",")]);
        }
        let mut cmd = Command::new(&cargo);
        cmd.args(&args)
            .current_dir(workspace_root())
            .env("RUSTFLAGS", "-C target-feature=+crt-static")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("CARGO_TARGET_DIR")
            .env_remove("CARGO_BUILD_TARGET")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let line = format!(
            "RUSTFLAGS='-C target-feature=+crt-static' {} {}",
            Path::new(&cargo).display(),
            args.join(" ")
        );
        (cmd, line)
    }

    /// Runs cargo and returns the path of the static executable.
    pub fn build(&self) -> Result<PathBuf> {
        let (mut cmd, line) = self.command();
        info!(command = %line, "static build");
        let out = cmd.output().map_err(|source| TestkitError::Spawn {
            program: "cargo".into(),
            source,
        })?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            return Err(TestkitError::StaticBuild {
                command: line,
                status: out.status.to_string(),
                stderr_tail: crate::tail(&stderr, 40),
            });
        }
        let want = match &self.target {
            Target::Example(n) | Target::Bin(n) | Target::Test(n) => Some(n.replace('-', "_")),
            Target::LibTests => None,
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let exe = find_executable(&stdout, want.as_deref(), &self.target).ok_or_else(|| {
            TestkitError::StaticBuildNoArtifact {
                target: format!("{:?} of {}", self.target, self.package),
            }
        })?;
        let bytes = std::fs::read(&exe).map_err(io_err("read built program", &exe))?;
        if elf::is_static(&bytes) != Some(true) {
            return Err(TestkitError::NotStatic { path: exe });
        }
        Ok(exe)
    }
}

/// Finds the executable in cargo's JSON messages.
fn find_executable(json_lines: &str, want: Option<&str>, target: &Target) -> Option<PathBuf> {
    let kind = match target {
        Target::Example(_) => "example",
        Target::Bin(_) => "bin",
        Target::Test(_) => "test",
        Target::LibTests => "lib",
    };
    let mut found = None;
    for line in json_lines.lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let t = &msg["target"];
        let name_ok =
            want.is_none_or(|w| t["name"].as_str().map(|n| n.replace('-', "_")) == Some(w.into()));
        let kind_ok = t["kind"].as_array().is_some_and(|ks| {
            ks.iter().any(|k| {
                k.as_str()
                    .is_some_and(|k| k == kind || (kind == "lib" && k.ends_with("lib")))
            })
        });
        if name_ok && kind_ok {
            found = Some(PathBuf::from(exe));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_executable_in_cargo_json() {
        let json = r#"{"reason":"compiler-artifact","target":{"name":"dep","kind":["lib"]},"executable":null}
{"reason":"compiler-artifact","target":{"name":"kvm_probe","kind":["example"]},"executable":"/t/x86_64-unknown-linux-gnu/debug/examples/kvm_probe"}
{"reason":"build-finished","success":true}"#;
        assert_eq!(
            find_executable(
                json,
                Some("kvm_probe"),
                &Target::Example("kvm_probe".into())
            ),
            Some(PathBuf::from(
                "/t/x86_64-unknown-linux-gnu/debug/examples/kvm_probe"
            ))
        );
        assert_eq!(
            find_executable(json, Some("other"), &Target::Example("other".into())),
            None
        );
    }

    #[test]
    fn command_line_shape() {
        let (_, line) = StaticBuild::new("sheaf-vmm", Target::Test("linux_boot".into()))
            .release(true)
            .command();
        assert!(line.contains("+crt-static"));
        assert!(line.contains("test --no-run"));
        assert!(line.contains("--target x86_64-unknown-linux-gnu"));
        assert!(line.contains("--test linux_boot"));
        assert!(line.contains("--release"));
    }
}
