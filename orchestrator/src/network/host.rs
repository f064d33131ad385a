// SPDX-License-Identifier: Apache-2.0
//! The Linux side of a node's pod network: the bridge, the taps and the
//! nftables masquerade rule, made with iproute2 (`ip`) and nftables
//! (`nft`), in the network namespace the agent runs in.

use std::io::Write as _;
use std::process::{Command, Stdio};

use tracing::{debug, info, warn};

use super::PodNetworkConfig;

/// Prefix of the taps the agent makes (`shp` + 10 hex of the instance uid
/// + the interface index): leftovers on the bridge are recognised by it.
pub const TAP_PREFIX: &str = "shp";

/// Pod network failures.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// Bad configuration or input (a CIDR, a MAC, a link name).
    #[error("{0}")]
    Config(String),
    /// A command failed.
    #[error("`{cmd}` failed: {message}")]
    Command {
        /// The command line.
        cmd: String,
        /// stderr or the spawn error.
        message: String,
    },
    /// Socket or file I/O.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Cause.
        source: std::io::Error,
    },
}

/// Checks a Linux interface name: 1..=15 bytes of `[A-Za-z0-9_.-]`.
pub fn check_link_name(name: &str) -> Result<(), NetworkError> {
    let ok = !name.is_empty()
        && name.len() <= 15
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
        && name != "."
        && name != "..";
    if ok {
        Ok(())
    } else {
        Err(NetworkError::Config(format!(
            "interface name {name:?}: 1 to 15 characters of letters, digits, '_', '.', '-'"
        )))
    }
}

fn run(prog: &str, args: &[&str], stdin: Option<&str>) -> Result<String, NetworkError> {
    let cmd = format!("{prog} {}", args.join(" "));
    let mut c = Command::new(prog);
    c.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().map_err(|e| NetworkError::Command {
        cmd: cmd.clone(),
        message: format!("{e} (are iproute2 and nftables installed?)"),
    })?;
    if let (Some(text), Some(mut w)) = (stdin, child.stdin.take()) {
        w.write_all(text.as_bytes()).map_err(|e| NetworkError::Io {
            what: format!("writing to {prog}"),
            source: e,
        })?;
    }
    let out = child.wait_with_output().map_err(|e| NetworkError::Io {
        what: cmd.clone(),
        source: e,
    })?;
    if !out.status.success() {
        return Err(NetworkError::Command {
            cmd,
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ip(args: &[&str]) -> Result<String, NetworkError> {
    run("ip", args, None)
}

/// Whether a link of that name exists.
pub fn link_exists(name: &str) -> bool {
    ip(&["link", "show", "dev", name]).is_ok()
}

/// The node's pod bridge, its NAT rule and its taps.
#[derive(Debug, Clone)]
pub struct PodBridge {
    cfg: PodNetworkConfig,
}

impl PodBridge {
    /// The nftables table of this bridge.
    pub fn nft_table(&self) -> String {
        format!("sheaf_{}", self.cfg.bridge.replace(['.', '-'], "_"))
    }

    /// The configuration.
    pub fn config(&self) -> &PodNetworkConfig {
        &self.cfg
    }

    /// Creates (or takes over) the bridge with the gateway address, turns
    /// on IPv4 forwarding, installs the masquerade rule and removes taps
    /// left on the bridge by an earlier agent that are not in `keep`.
    pub fn setup(cfg: &PodNetworkConfig, keep: &[String]) -> Result<PodBridge, NetworkError> {
        cfg.validate()?;
        let b = PodBridge { cfg: cfg.clone() };
        let br = cfg.bridge.as_str();
        if !link_exists(br) {
            ip(&["link", "add", br, "type", "bridge"])?;
        }
        ip(&["link", "set", br, "alias", "sheaf pod network"])?;
        let gw = format!("{}/{}", cfg.gateway(), cfg.prefix);
        ip(&["addr", "replace", &gw, "dev", br])?;
        ip(&["link", "set", br, "up"])?;
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(|e| NetworkError::Io {
            what: "enabling IPv4 forwarding (/proc/sys/net/ipv4/ip_forward)".into(),
            source: e,
        })?;
        let t = b.nft_table();
        let cidr = cfg.cidr();
        // `table` + `delete table` + the table: one atomic replace.
        let script = format!(
            "table ip {t}\n\
             delete table ip {t}\n\
             table ip {t} {{\n\
               chain postrouting {{\n\
                 type nat hook postrouting priority srcnat; policy accept;\n\
                 ip saddr {cidr} ip daddr != {cidr} masquerade\n\
               }}\n\
             }}\n"
        );
        run("nft", &["-f", "-"], Some(&script))?;
        for tap in b.taps()? {
            if !keep.contains(&tap) {
                info!(%tap, "removing a leftover tap");
                b.delete_tap(&tap);
            }
        }
        info!(bridge = %br, gateway = %gw, nat = %t, "pod network ready");
        Ok(b)
    }

    /// Taps of ours on the bridge.
    pub fn taps(&self) -> Result<Vec<String>, NetworkError> {
        let out = ip(&["-o", "link", "show", "master", &self.cfg.bridge])?;
        Ok(out
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_string())
            .filter(|n| n.starts_with(TAP_PREFIX))
            .collect())
    }

    /// The tap name of interface `index` of the instance `uid`.
    pub fn tap_name(uid: &str, index: usize) -> String {
        let hex: String = uid
            .chars()
            .filter(char::is_ascii_hexdigit)
            .take(10)
            .collect();
        format!("{TAP_PREFIX}{hex}{}", index % 10)
    }

    /// Creates a persistent tap (vnet header) on the bridge, up.
    pub fn add_tap(&self, name: &str) -> Result<(), NetworkError> {
        check_link_name(name)?;
        if link_exists(name) {
            ip(&["link", "del", name])?;
        }
        ip(&["tuntap", "add", "dev", name, "mode", "tap", "vnet_hdr"])?;
        if let Err(e) = ip(&["link", "set", name, "master", &self.cfg.bridge, "up"]) {
            self.delete_tap(name);
            return Err(e);
        }
        debug!(tap = %name, bridge = %self.cfg.bridge, "tap created");
        Ok(())
    }

    /// Removes a tap (nothing if it is gone).
    pub fn delete_tap(&self, name: &str) {
        if check_link_name(name).is_err() || !link_exists(name) {
            return;
        }
        if let Err(e) = ip(&["link", "del", name]) {
            warn!(tap = %name, error = %e, "removing tap");
        }
    }

    /// Removes the taps, the NAT table and the bridge.
    pub fn teardown(&self) {
        if let Ok(taps) = self.taps() {
            for t in taps {
                self.delete_tap(&t);
            }
        }
        let _ = run("nft", &["delete", "table", "ip", &self.nft_table()], None);
        if link_exists(&self.cfg.bridge) {
            let _ = ip(&["link", "del", &self.cfg.bridge]);
        }
        info!(bridge = %self.cfg.bridge, "pod network removed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_names() {
        assert!(check_link_name("sheafpod").is_ok());
        for bad in ["", "a/b", "0123456789abcdef", "..", "a b", "x\n"] {
            assert!(check_link_name(bad).is_err(), "{bad:?}");
        }
        let t = PodBridge::tap_name("5bbbf623-20a7-42a5-89cb-ef8f128609ec", 1);
        assert_eq!(t, "shp5bbbf623201");
        assert!(check_link_name(&t).is_ok());
    }
}
