// SPDX-License-Identifier: Apache-2.0
//! Running `qemu-img` on images an API user supplied, which are hostile.
//!
//! - The file is opened as `driver=qcow2,file.driver=file,file.filename=PATH`
//!   through `--image-opts`, so no part of the name is read as a protocol
//!   (`json:`, `nbd:`) and the format is never guessed.
//! - [`inspect_qcow2`] refuses an image with a backing file or an external
//!   data file before anything converts it: either would make qemu-img read
//!   another host file (or a network server) into the volume.
//! - Every run has resource limits set in the child before exec
//!   (`RLIMIT_CPU`, `RLIMIT_AS`, no core dumps) and a wall-clock timeout,
//!   after which the child is killed.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

/// Limits of one `qemu-img` run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// CPU seconds (`RLIMIT_CPU`; the kernel sends SIGXCPU, then SIGKILL).
    pub cpu_seconds: u64,
    /// Address space in bytes (`RLIMIT_AS`).
    pub address_space: u64,
    /// Wall-clock time before the child is killed.
    pub timeout: Duration,
}

impl Limits {
    /// For `qemu-img info`: a header parse.
    pub const INFO: Limits = Limits {
        cpu_seconds: 30,
        address_space: 1 << 30,
        timeout: Duration::from_secs(30),
    };
    /// For `qemu-img convert`: proportional to the image, bounded.
    pub const CONVERT: Limits = Limits {
        cpu_seconds: 3600,
        address_space: 4 << 30,
        timeout: Duration::from_secs(4 * 3600),
    };
}

/// A `qemu-img` failure.
#[derive(Debug, thiserror::Error)]
pub enum QemuImgError {
    /// Could not run it.
    #[error("qemu-img {op} (install qemu-utils): {source}")]
    Spawn {
        /// Subcommand.
        op: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// It ran over its wall-clock limit and was killed.
    #[error("qemu-img {op} ran longer than {0:?} and was killed", limit)]
    Timeout {
        /// Subcommand.
        op: &'static str,
        /// The limit.
        limit: Duration,
    },
    /// It failed.
    #[error("qemu-img {op}: {message}")]
    Failed {
        /// Subcommand.
        op: &'static str,
        /// Its stderr, or the signal that ended it.
        message: String,
    },
    /// The image is refused.
    #[error("{0}")]
    Refused(String),
}

/// `--image-opts` for a qcow2 file at `path` (commas escaped as `,,`).
pub fn image_opts(path: &Path) -> String {
    format!(
        "driver=qcow2,file.driver=file,file.filename={}",
        path.to_string_lossy().replace(',', ",,")
    )
}

/// Runs `qemu-img ARGS` under `limits`: (stdout) on success.
pub async fn run(op: &'static str, args: &[&str], limits: Limits) -> Result<Vec<u8>, QemuImgError> {
    let out = run_status(op, args, limits).await?;
    if !out.status.success() {
        return Err(failure(op, &out));
    }
    Ok(out.stdout)
}

/// The error for a run that ended unsuccessfully.
fn failure(op: &'static str, out: &std::process::Output) -> QemuImgError {
    use std::os::unix::process::ExitStatusExt as _;
    let message = match out.status.signal() {
        Some(sig) => format!(
            "killed by signal {sig} (CPU or memory limit reached?) {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        None => String::from_utf8_lossy(&out.stderr).trim().to_string(),
    };
    QemuImgError::Failed { op, message }
}

/// Runs `qemu-img ARGS` under `limits` and returns how it ended, whatever
/// its exit status (only a spawn failure or the timeout is an error).
async fn run_status(
    op: &'static str,
    args: &[&str],
    limits: Limits,
) -> Result<std::process::Output, QemuImgError> {
    let mut cmd = tokio::process::Command::new("qemu-img");
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let Limits {
        cpu_seconds,
        address_space,
        ..
    } = limits;
    // SAFETY: the closure runs in the forked child before exec and only
    // calls setrlimit(2), which is async-signal-safe, on its own limits.
    unsafe {
        cmd.pre_exec(move || {
            let set = |res, v: u64| {
                let l = libc::rlimit {
                    rlim_cur: v,
                    rlim_max: v,
                };
                if libc::setrlimit(res, &l) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            };
            set(libc::RLIMIT_CPU, cpu_seconds)?;
            set(libc::RLIMIT_AS, address_space)?;
            set(libc::RLIMIT_CORE, 0)?;
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|source| QemuImgError::Spawn { op, source })?;
    let out = match tokio::time::timeout(limits.timeout, child.wait_with_output()).await {
        Ok(r) => r.map_err(|source| QemuImgError::Spawn { op, source })?,
        // Dropping the future drops the child: kill_on_drop kills it.
        Err(_) => {
            return Err(QemuImgError::Timeout {
                op,
                limit: limits.timeout,
            });
        }
    };
    Ok(out)
}

/// Checks `qemu-img info --output=json` of a qcow2 image: refuses a
/// backing file (of any name: a path, `json:`, `nbd:`) and an external data
/// file; returns the virtual size.
pub fn inspect_qcow2(info: &Value) -> Result<u64, QemuImgError> {
    for key in [
        "backing-filename",
        "full-backing-filename",
        "backing-filename-format",
    ] {
        if let Some(b) = info.get(key) {
            return Err(QemuImgError::Refused(format!(
                "qcow2 images with a backing file are refused (backing file {b}); \
                 flatten it first: qemu-img convert -O qcow2 IN OUT"
            )));
        }
    }
    if let Some(d) = info.pointer("/format-specific/data/data-file") {
        return Err(QemuImgError::Refused(format!(
            "qcow2 images with an external data file are refused (data file {d})"
        )));
    }
    if info.get("format").and_then(Value::as_str) != Some("qcow2") {
        return Err(QemuImgError::Refused(format!(
            "qemu-img reports format {} where qcow2 was expected",
            info.get("format").unwrap_or(&Value::Null)
        )));
    }
    info.get("virtual-size")
        .and_then(Value::as_u64)
        .ok_or_else(|| QemuImgError::Refused("qemu-img info reports no virtual-size".into()))
}

/// `qemu-img info` of the qcow2 image at `path`, checked by [`inspect_qcow2`].
pub async fn qcow2_size(path: &Path) -> Result<u64, QemuImgError> {
    let opts = image_opts(path);
    let out = run(
        "info",
        &["info", "--output=json", "--image-opts", &opts],
        Limits::INFO,
    )
    .await?;
    let v: Value = serde_json::from_slice(&out)
        .map_err(|e| QemuImgError::Refused(format!("qemu-img info output: {e}")))?;
    inspect_qcow2(&v)
}

/// `qemu-img check` of the qcow2 image at `path`: refuses an image whose
/// metadata is corrupt (exit status 2: e.g. a truncated download whose
/// tables point past the end of the file, which `convert` would silently
/// read as zeros). Leaked clusters (status 3) cost space, not data: accepted.
pub async fn check_qcow2(path: &Path) -> Result<(), QemuImgError> {
    let opts = image_opts(path);
    let out = run_status("check", &["check", "--image-opts", &opts], Limits::CONVERT).await?;
    match out.status.code() {
        Some(0 | 3) => Ok(()),
        Some(2) => {
            let text = format!(
                "{}\n{}",
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            );
            let first = text
                .lines()
                .find(|l| l.starts_with("ERROR"))
                .unwrap_or("corruptions found")
                .trim()
                .to_string();
            Err(QemuImgError::Refused(format!(
                "the qcow2 image is corrupt (qemu-img check: {first}); \
                 was the download truncated?"
            )))
        }
        _ => Err(failure("check", &out)),
    }
}

/// Converts the qcow2 image at `src` to a sparse raw file `dst`, after
/// [`check_qcow2`] (the caller has already run [`qcow2_size`]).
pub async fn convert_to_raw(src: &Path, dst: &Path) -> Result<(), QemuImgError> {
    check_qcow2(src).await?;
    let opts = image_opts(src);
    let dst = dst.to_string_lossy();
    run(
        "convert",
        &["convert", "--image-opts", &opts, "-O", "raw", &dst],
        Limits::CONVERT,
    )
    .await
    .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn no_qemu_img() -> bool {
        let missing = std::process::Command::new("qemu-img")
            .arg("--version")
            .output()
            .is_err();
        if missing {
            eprintln!("SKIP: no qemu-img");
        }
        missing
    }

    #[test]
    fn backing_and_data_files_are_refused() {
        let ok = json!({"format": "qcow2", "virtual-size": 4096});
        assert_eq!(inspect_qcow2(&ok).unwrap(), 4096);
        let backed = json!({"format": "qcow2", "virtual-size": 4096,
            "backing-filename": "/etc/shadow"});
        assert!(
            inspect_qcow2(&backed)
                .unwrap_err()
                .to_string()
                .contains("backing file")
        );
        let data = json!({"format": "qcow2", "virtual-size": 4096,
            "format-specific": {"type": "qcow2", "data": {"data-file": "/etc/shadow"}}});
        assert!(
            inspect_qcow2(&data)
                .unwrap_err()
                .to_string()
                .contains("data file")
        );
        assert!(inspect_qcow2(&json!({"format": "raw", "virtual-size": 1})).is_err());
        assert!(inspect_qcow2(&json!({"format": "qcow2"})).is_err());
    }

    #[test]
    fn commas_are_escaped() {
        assert_eq!(
            image_opts(Path::new("/a,b")),
            "driver=qcow2,file.driver=file,file.filename=/a,,b"
        );
    }

    #[tokio::test]
    async fn limits_and_timeouts_hold() {
        if no_qemu_img() {
            return;
        }
        // An address-space limit too small for qemu-img to start.
        let tiny = Limits {
            cpu_seconds: 10,
            address_space: 16 << 20,
            timeout: Duration::from_secs(10),
        };
        assert!(run("info", &["--version"], tiny).await.is_err());
        assert!(run("info", &["--version"], Limits::INFO).await.is_ok());
    }

    #[tokio::test]
    async fn truncated_qcow2_is_refused_before_convert() {
        if no_qemu_img() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let raw = tmp.path().join("a.raw");
        let data: Vec<u8> = (0..4u32 << 20).map(|i| (i / 4096) as u8 | 1).collect();
        std::fs::write(&raw, &data).unwrap();
        let q = tmp.path().join("a.qcow2");
        let st = std::process::Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "qcow2"])
            .arg(&raw)
            .arg(&q)
            .status()
            .unwrap();
        assert!(st.success());
        check_qcow2(&q).await.unwrap();
        let full = std::fs::read(&q).unwrap();
        let cut = tmp.path().join("cut.qcow2");
        std::fs::write(&cut, &full[..full.len() / 2]).unwrap();
        let out = tmp.path().join("out.raw");
        let e = convert_to_raw(&cut, &out).await.unwrap_err().to_string();
        assert!(e.contains("corrupt"), "{e}");
        assert!(!out.exists());
    }
}
