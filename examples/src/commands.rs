// SPDX-License-Identifier: Apache-2.0
//! The client side of `sheaf`'s commands that talk to a running cluster:
//! VM and VMI verbs, waiting for a move, the serial console and image
//! import (the `sheaf` binary parses arguments and calls these).

use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use serde_json::{Value, json};

use crate::client::ApiClient;
use crate::image::ImportProgress;

/// The KubeVirt subresource API prefix of namespace `ns`.
pub fn kv(ns: &str) -> String {
    format!("/apis/subresources.kubevirt.io/v1/namespaces/{ns}")
}

/// `PUT .../virtualmachines/VM/{start,stop,restart}` and a one-line answer.
pub async fn vm_verb(c: &ApiClient, ns: &str, vm: &str, verb: &str) -> anyhow::Result<()> {
    c.json(
        "PUT",
        &format!("{}/virtualmachines/{vm}/{verb}", kv(ns)),
        Some(("application/json", &json!({}))),
    )
    .await?;
    let done = match verb {
        "start" => "was scheduled to start",
        "stop" => "was scheduled to stop",
        _ => "was scheduled to restart",
    };
    println!("VM {ns}/{vm} {done}");
    Ok(())
}

/// `PUT .../virtualmachineinstances/VM/{pause,unpause}` and a one-line answer.
pub async fn vmi_verb(c: &ApiClient, ns: &str, vm: &str, verb: &str) -> anyhow::Result<()> {
    c.json(
        "PUT",
        &format!("{}/virtualmachineinstances/{vm}/{verb}", kv(ns)),
        Some(("application/json", &json!({}))),
    )
    .await?;
    let done = if verb == "pause" {
        "paused"
    } else {
        "unpaused"
    };
    println!("VMI {ns}/{vm} was {done}");
    Ok(())
}

/// The node VM `vm`'s instance is on, if any.
pub async fn vmi_node(c: &ApiClient, ns: &str, vm: &str) -> anyhow::Result<Option<String>> {
    let v = c
        .get(&format!(
            "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/{vm}"
        ))
        .await?;
    Ok(v["status"]["nodeName"].as_str().map(str::to_string))
}

/// Waits until VM `vm`'s instance is Running on a node other than `from`.
pub async fn wait_moved(
    c: &ApiClient,
    ns: &str,
    vm: &str,
    from: Option<&str>,
    limit: Duration,
) -> anyhow::Result<String> {
    let t0 = Instant::now();
    loop {
        let r = c
            .send(
                "GET",
                &format!("/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/{vm}"),
                None,
                Bytes::new(),
            )
            .await?;
        if r.status == 200 {
            let v: Value = serde_json::from_slice(&r.body)?;
            let node = v["status"]["nodeName"].as_str();
            if v["status"]["phase"] == "Running" && node.is_some() && node != from {
                return Ok(node.unwrap_or_default().to_string());
            }
        }
        if t0.elapsed() > limit {
            bail!("VM {ns}/{vm} is not Running on another node after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Raw terminal mode for the console; restored on drop.
#[derive(Debug)]
pub struct RawMode(Option<libc::termios>);

impl RawMode {
    /// Puts stdin in raw mode if it is a terminal.
    pub fn enter() -> RawMode {
        // SAFETY: isatty only inspects the descriptor.
        if unsafe { libc::isatty(0) } != 1 {
            return RawMode(None);
        }
        // SAFETY: termios is plain data; tcgetattr fills it for fd 0, which is a tty.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `t` is a valid, writable termios.
        if unsafe { libc::tcgetattr(0, &mut t) } != 0 {
            return RawMode(None);
        }
        let old = t;
        // SAFETY: cfmakeraw edits the struct in place.
        unsafe { libc::cfmakeraw(&mut t) };
        // Keep output post-processing so "\n" still returns the carriage.
        t.c_oflag |= libc::OPOST;
        // SAFETY: setting attributes of our own terminal from a valid struct.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &t) };
        RawMode(Some(old))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(old) = self.0 {
            // SAFETY: restoring the attributes saved by `enter`.
            unsafe { libc::tcsetattr(0, libc::TCSANOW, &old) };
        }
    }
}

/// Attaches to (or with `follow` false, prints) a VMI's serial console.
pub async fn console(c: &ApiClient, ns: &str, vm: &str, follow: bool) -> anyhow::Result<()> {
    let base = format!("{}/virtualmachineinstances/{vm}/console", kv(ns));
    let path = format!("{base}?follow={follow}");
    let (quit_tx, mut quit_rx) = tokio::sync::oneshot::channel::<()>();
    let raw = if follow {
        let raw = RawMode::enter();
        eprintln!(
            "Connected to {ns}/{vm}'s serial console. Escape sequence: Ctrl-]{}",
            if raw.0.is_some() { "\r" } else { "" }
        );
        // Keystrokes (raw mode) or piped input go to the guest's serial port.
        let (in_tx, mut in_rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
        let tty = raw.0.is_some();
        std::thread::spawn(move || {
            let mut b = [0u8; 256];
            loop {
                // SAFETY: reading from stdin into a local buffer of its length.
                let n = unsafe { libc::read(0, b.as_mut_ptr().cast(), b.len()) };
                let Ok(n) = usize::try_from(n) else { break };
                if n == 0 {
                    break;
                }
                let data = &b[..n];
                if let Some(i) = data.iter().position(|&c| c == 0x1d) {
                    let _ = in_tx.send(data[..i].to_vec());
                    let _ = quit_tx.send(());
                    return;
                }
                if in_tx.send(data.to_vec()).is_err() {
                    return;
                }
            }
            // EOF: a terminal's EOF ends the session; piped input just ends.
            if tty {
                let _ = quit_tx.send(());
            }
        });
        let c2 = c.clone();
        tokio::spawn(async move {
            while let Some(mut data) = in_rx.recv().await {
                while let Ok(more) = in_rx.try_recv() {
                    data.extend(more);
                }
                if data.is_empty() {
                    continue;
                }
                if let Err(e) = c2
                    .send_checked("POST", &base, "application/octet-stream", data.into())
                    .await
                {
                    eprint!("\r\n[sheaf: input not delivered: {e}]\r\n");
                }
            }
        });
        raw
    } else {
        RawMode(None)
    };
    let stream = c.stream(&path, |d| {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(d);
        let _ = out.flush();
        true
    });
    let res = tokio::select! {
        r = stream => r,
        _ = &mut quit_rx => Ok(()),
    };
    drop(raw);
    if follow {
        eprintln!();
    }
    res?;
    Ok(())
}

/// Uploads image `file` into Volume `ns/name` with a progress bar.
#[allow(clippy::too_many_arguments)]
pub async fn image_import(
    c: &ApiClient,
    ns: &str,
    file: &Path,
    name: Option<String>,
    size: Option<u64>,
    replicas: u32,
) -> anyhow::Result<()> {
    let abs = std::fs::canonicalize(file).with_context(|| format!("image {}", file.display()))?;
    let name = match name {
        Some(n) => n,
        None => abs
            .file_stem()
            .and_then(|s| s.to_str())
            .map(|s| s.to_lowercase().replace(['_', '.', ' '], "-"))
            .context("cannot derive a volume name; pass --name")?,
    };
    let file_len = std::fs::metadata(&abs)
        .with_context(|| format!("image {}", abs.display()))?
        .len();
    let file = tokio::fs::File::open(&abs)
        .await
        .with_context(|| format!("image {}", abs.display()))?;
    let bar = indicatif::ProgressBar::new(file_len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>12} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )?
        .progress_chars("=> "),
    );
    bar.set_message("uploading");
    // The file's bytes are the request body (the cluster never reads a
    // path named by a client); the answer is JSON progress lines.
    let mut query = format!("?replicas={replicas}");
    if let Some(s) = size {
        query.push_str(&format!("&size={s}"));
    }
    let path =
        format!("/apis/subresources.sheaf.dev/v1/namespaces/{ns}/volumes/{name}/import{query}");
    let mut last: Option<ImportProgress> = None;
    let mut pending: Vec<u8> = Vec::new();
    let mut bad: Option<String> = None;
    let up_bar = bar.clone();
    let res = c
        .upload_file(
            "POST",
            &path,
            file,
            move |n| up_bar.inc(n),
            |chunk| {
                pending.extend_from_slice(chunk);
                while let Some(nl) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=nl).collect();
                    match serde_json::from_slice::<ImportProgress>(&line) {
                        Ok(p) => {
                            if p.total > 0 {
                                bar.set_length(p.total);
                                bar.set_position(p.done);
                            }
                            bar.set_message(p.phase.clone());
                            last = Some(p);
                        }
                        Err(e) => {
                            bad = Some(format!("bad progress line: {e}"));
                            return false;
                        }
                    }
                }
                true
            },
        )
        .await;
    if let Err(e) = res {
        bar.finish_and_clear();
        return Err(e.into());
    }
    if let Some(b) = bad {
        bar.abandon_with_message("failed");
        bail!("{b}");
    }
    match last {
        Some(p) if p.phase == "done" => {
            bar.finish_with_message("imported");
            println!("Volume {ns}/{name}: {}", p.message);
            Ok(())
        }
        Some(p) => {
            bar.abandon_with_message("failed");
            bail!("import failed: {}", p.message)
        }
        None => bail!("import ended without a result"),
    }
}
