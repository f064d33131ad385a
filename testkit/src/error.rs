// SPDX-License-Identifier: Apache-2.0
//! The crate's error type.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Errors from building guest images, running QEMU and the nested-KVM box.
///
/// `Debug` prints the message and its sources (console tails with real line
/// breaks), so a test's `.unwrap()` shows something readable.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum TestkitError {
    /// A host tool the harness needs is not installed.
    #[error("`{tool}` not found ({why}): run scripts/setup")]
    ToolMissing {
        /// The program or file that is missing.
        tool: String,
        /// What it is needed for.
        why: &'static str,
    },
    /// No Debian cloud kernel was found under /boot.
    #[error(
        "no guest kernel found ({searched}): run scripts/setup (installs linux-image-cloud-amd64)"
    )]
    KernelNotFound {
        /// What was searched.
        searched: String,
    },
    /// A kernel module is neither a file nor built into the kernel.
    #[error("kernel module `{module}` not found for kernel {version}")]
    ModuleNotFound {
        /// Module name.
        module: String,
        /// Kernel version.
        version: String,
    },
    /// busybox is not statically linked (the `busybox` package instead of `busybox-static`).
    #[error("{} is dynamically linked: install busybox-static (scripts/setup)", path.display())]
    BusyboxNotStatic {
        /// Path of the busybox binary.
        path: PathBuf,
    },
    /// An I/O operation on a path failed.
    #[error("{op} {}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A child process could not be started.
    #[error("failed to start {program}")]
    Spawn {
        /// The program.
        program: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A name given for a file inside a guest is not a safe relative path.
    #[error("invalid guest file name `{name}`: {why}")]
    InvalidName {
        /// The offending name.
        name: String,
        /// Why it was rejected.
        why: &'static str,
    },
    /// A vmlinux ELF could not be extracted from a bzImage.
    #[error("cannot extract vmlinux from bzImage: {reason}")]
    ExtractVmlinux {
        /// What went wrong.
        reason: String,
    },
    /// A `cargo build` of a static test program failed.
    #[error("static build `{command}` failed ({status}):\n{stderr_tail}")]
    StaticBuild {
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// The end of its stderr.
        stderr_tail: String,
    },
    /// A static build succeeded but produced no matching executable.
    #[error("static build of `{target}` produced no executable")]
    StaticBuildNoArtifact {
        /// The target that was asked for.
        target: String,
    },
    /// A built program is not statically linked.
    #[error("{} is not statically linked", path.display())]
    NotStatic {
        /// The program.
        path: PathBuf,
    },
    /// QEMU did not finish in time; it was killed.
    #[error("{what} timed out after {after:?}; console tail:\n{console_tail}")]
    Timeout {
        /// What timed out.
        what: &'static str,
        /// The timeout.
        after: Duration,
        /// The last lines of the serial console.
        console_tail: String,
    },
    /// QEMU exited with a failure status before the guest finished.
    #[error("qemu exited with {status}; qemu stderr: {stderr}; console tail:\n{console_tail}")]
    QemuFailed {
        /// QEMU's exit status.
        status: String,
        /// QEMU's own stderr.
        stderr: String,
        /// The last lines of the serial console.
        console_tail: String,
    },
    /// The nested-KVM box itself failed (before or after the program ran).
    #[error("nested-KVM box failed: {reason}; console tail:\n{console_tail}")]
    BoxFailed {
        /// What went wrong.
        reason: String,
        /// The last lines of the serial console.
        console_tail: String,
    },
    /// An image build script failed.
    #[error("building the {what} failed ({status}); log tail:\n{log_tail}")]
    ImageBuild {
        /// What was being built.
        what: &'static str,
        /// The script's exit status.
        status: String,
        /// The end of its log.
        log_tail: String,
    },
    /// The archive of files copied out of the box could not be read.
    #[error("cannot read files copied out of the box")]
    FilesOut(#[source] io::Error),
}

impl fmt::Debug for TestkitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")?;
        let mut source = std::error::Error::source(self);
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, TestkitError>;

/// Wraps an `io::Error` with the operation and path.
pub(crate) fn io_err(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(io::Error) -> TestkitError {
    let path = path.into();
    move |source| TestkitError::Io { op, path, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_message_and_source() {
        let e = io_err("read", "/x")(io::Error::other("boom"));
        assert_eq!(format!("{e:?}"), "read /x: boom");
        let e = TestkitError::ToolMissing {
            tool: "qemu-system-x86_64".into(),
            why: "tests",
        };
        assert!(format!("{e:?}").contains("run scripts/setup"));
    }
}
