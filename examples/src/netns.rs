// SPDX-License-Identifier: Apache-2.0
//! `sheaf cluster up --netns`: every node is its own process tree (`sheaf
//! agent`, its replica servers, its launchers) inside a network namespace
//! that `up` creates and removes.
//!
//! ```text
//!   host namespace                                     sheaf<N>-node-0 (netns)
//!   ┌──────────────────────────────┐   veth sh<N>n0 ──  eth0 10.213.N.10/24
//!   │ bridge sheaf<N> 10.213.N.1/24├── veth sh<N>n1 ──  sheaf<N>-node-1: eth0 10.213.N.11
//!   │ API server (+ proxy on .1)   │   veth sh<N>n2 ──  sheaf<N>-node-2: eth0 10.213.N.12
//!   └──────────────────────────────┘
//!   each node namespace: lo up, default route via 10.213.N.1
//! ```
//!
//! The agent reaches the control plane through the bridge address (a TCP
//! proxy in front of the API server, whose certificate names that address)
//! with a `KubeStore`; its replica servers listen on the namespace's
//! address, so engines on other nodes and the control plane (fencing,
//! imports) reach them over the bridge. The subnet is chosen once (the first
//! free `10.213.N.0/24`) and kept in `<data>/netns.json`, so node addresses
//! stay the same across `up`s. The bridge carries the data directory as
//! its interface alias: leftovers of a crashed `up` are recognised as ours
//! and removed, another cluster's never are.
//!
//! A node is everything in its namespace: `node kill` is SIGKILL to every
//! process whose `/proc/PID/ns/net` is the namespace (agent, replica
//! servers, launchers), like pulling the plug.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sheaf_orchestrator::agent::NodeAgentConfig;
use tracing::{info, warn};

/// The pod network of every node (see `sheaf_orchestrator::network`).
pub const POD_CIDR: &str = "10.244.0.0/16";

/// First two octets of the node subnets.
const BASE: [u8; 2] = [10, 213];

/// Failures of the network setup or of node processes.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// Not root.
    #[error(
        "--netns needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN to create network namespaces, \
         veth pairs and a bridge); run as root or without --netns"
    )]
    NotRoot,
    /// An `ip` command failed.
    #[error("`ip {args}` failed: {message}")]
    Ip {
        /// Arguments.
        args: String,
        /// stderr or the spawn error.
        message: String,
    },
    /// No free /24 left.
    #[error("no free subnet 10.213.N.0/24 on this host (every N from 1 to 254 is in use)")]
    NoSubnet,
    /// The saved subnet is used by another cluster.
    #[error("{0}")]
    Conflict(String),
    /// File system.
    #[error("{path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Starting a node process.
    #[error("starting node {node}: {source}")]
    Spawn {
        /// Node.
        node: String,
        /// Cause.
        source: std::io::Error,
    },
    /// No such node.
    #[error("node {0:?} not found")]
    NoNode(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> NetnsError + '_ {
    move |source| NetnsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Runs `ip ARGS`, failing with its stderr.
fn ip(args: &[&str]) -> Result<String, NetnsError> {
    let shown = args.join(" ");
    let out = std::process::Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| NetnsError::Ip {
            args: shown.clone(),
            message: format!("{e} (is iproute2 installed?)"),
        })?;
    if !out.status.success() {
        return Err(NetnsError::Ip {
            args: shown,
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One node's place in the network.
#[derive(Debug, Clone)]
pub struct NodeNet {
    /// Node name (`node-0`).
    pub name: String,
    /// Namespace name (`sheaf<N>-node-0`).
    pub netns: String,
    /// Its address.
    pub addr: Ipv4Addr,
    /// Host end of its veth pair.
    pub host_veth: String,
}

/// The bridge and the node namespaces of one cluster.
#[derive(Debug, Clone)]
pub struct Network {
    /// Third octet of the subnet.
    pub index: u8,
    /// Bridge name.
    pub bridge: String,
    /// Bridge address (the nodes' gateway; the API server proxy listens here).
    pub gateway: Ipv4Addr,
    /// Nodes.
    pub nodes: Vec<NodeNet>,
    /// Canonical data directory (the bridge's alias).
    owner: String,
}

#[derive(Serialize, Deserialize)]
struct Saved {
    subnet: String,
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

/// The `/sys/class/net/<name>/ifalias` of a link, if it exists.
fn link_alias(name: &str) -> Option<String> {
    let p = Path::new("/sys/class/net").join(name);
    if !p.exists() {
        return None;
    }
    Some(
        std::fs::read_to_string(p.join("ifalias"))
            .unwrap_or_default()
            .trim()
            .to_string(),
    )
}

/// Whether `10.213.N.` appears in the host's addresses or routes.
fn subnet_in_use(n: u8, seen: &str) -> bool {
    let prefix = format!("{}.{}.{n}.", BASE[0], BASE[1]);
    seen.split_whitespace().any(|w| w.starts_with(&prefix))
}

impl Network {
    /// The network of a cluster on `data_dir` with `nodes` nodes: the saved
    /// subnet, or the first free one (then saved).
    pub fn plan(data_dir: &Path, nodes: usize) -> Result<Network, NetnsError> {
        if !is_root() {
            return Err(NetnsError::NotRoot);
        }
        let owner = std::fs::canonicalize(data_dir)
            .map_err(io_err(data_dir))?
            .to_string_lossy()
            .into_owned();
        let saved_path = data_dir.join("netns.json");
        let seen = format!(
            "{}\n{}",
            ip(&["-o", "-4", "addr", "show"])?,
            ip(&["-4", "route", "show", "table", "all"])?
        );
        let mine = |n: u8| link_alias(&format!("sheaf{n}")).as_deref() == Some(owner.as_str());
        if nodes > 200 {
            return Err(NetnsError::Conflict(format!(
                "{nodes} nodes do not fit in one /24 (at most 200 with --netns)"
            )));
        }
        let saved: Option<u8> = match std::fs::read(&saved_path) {
            Ok(b) => {
                let parsed = serde_json::from_slice::<Saved>(&b).ok().and_then(|s| {
                    let o: Vec<&str> = s.subnet.split(['.', '/']).collect();
                    let want = [BASE[0].to_string(), BASE[1].to_string()];
                    match o.as_slice() {
                        [a, b, n, "0", "24"]
                            if [*a, *b] == [want[0].as_str(), want[1].as_str()] =>
                        {
                            n.parse::<u8>().ok().filter(|n| (1..=254).contains(n))
                        }
                        _ => None,
                    }
                });
                Some(parsed.ok_or_else(|| {
                    NetnsError::Conflict(format!(
                        "{}: expected {{\"subnet\": \"10.213.N.0/24\"}} with N in 1..=254; \
                         fix it or remove it to pick a free subnet",
                        saved_path.display()
                    ))
                })?)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_err(&saved_path)(e)),
        };
        let index = match saved {
            // Ours (maybe left by a crashed `up`), or free.
            Some(n)
                if mine(n)
                    || (!subnet_in_use(n, &seen) && link_alias(&format!("sheaf{n}")).is_none()) =>
            {
                n
            }
            Some(n) => {
                return Err(NetnsError::Conflict(format!(
                    "this data directory's subnet {}.{}.{n}.0/24 (in {}) is now used by \
                     another interface or cluster; stop that cluster, or remove {} to pick a new subnet",
                    BASE[0],
                    BASE[1],
                    saved_path.display(),
                    saved_path.display()
                )));
            }
            None => {
                let n = (1..=254u8)
                    .find(|n| {
                        !subnet_in_use(*n, &seen) && link_alias(&format!("sheaf{n}")).is_none()
                    })
                    .ok_or(NetnsError::NoSubnet)?;
                let s = Saved {
                    subnet: format!("{}.{}.{n}.0/24", BASE[0], BASE[1]),
                };
                std::fs::write(&saved_path, serde_json::to_vec(&s).unwrap_or_default())
                    .map_err(io_err(&saved_path))?;
                n
            }
        };
        let nodes = (0..nodes)
            .map(|i| NodeNet {
                name: format!("node-{i}"),
                netns: format!("sheaf{index}-node-{i}"),
                addr: Ipv4Addr::new(BASE[0], BASE[1], index, 10 + i as u8),
                host_veth: format!("sh{index}n{i}"),
            })
            .collect();
        Ok(Network {
            index,
            bridge: format!("sheaf{index}"),
            gateway: Ipv4Addr::new(BASE[0], BASE[1], index, 1),
            nodes,
            owner,
        })
    }

    /// The node `name`.
    pub fn node(&self, name: &str) -> Option<&NodeNet> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// Namespaces named like ours (`sheaf<N>-...`) that exist now.
    fn existing_namespaces(&self) -> Vec<String> {
        let prefix = format!("sheaf{}-", self.index);
        std::fs::read_dir("/run/netns")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| n.starts_with(&prefix))
            .collect()
    }

    /// Creates the bridge and every node namespace (removing leftovers of
    /// an earlier `up` on the same data directory first). On failure,
    /// whatever was created is removed again.
    pub fn create(&self) -> Result<(), NetnsError> {
        let _ = self.destroy();
        let res = self.create_inner();
        if res.is_err() {
            let _ = self.destroy();
        }
        res
    }

    fn create_inner(&self) -> Result<(), NetnsError> {
        let br = self.bridge.as_str();
        let gw = format!("{}/24", self.gateway);
        ip(&["link", "add", br, "type", "bridge"])?;
        ip(&["link", "set", "dev", br, "alias", &self.owner])?;
        ip(&["addr", "add", &gw, "dev", br])?;
        ip(&["link", "set", br, "up"])?;
        for n in &self.nodes {
            let ns = n.netns.as_str();
            let peer = format!("{}p", n.host_veth);
            let addr = format!("{}/24", n.addr);
            let gw = self.gateway.to_string();
            ip(&["netns", "add", ns])?;
            ip(&[
                "link",
                "add",
                &n.host_veth,
                "type",
                "veth",
                "peer",
                "name",
                &peer,
                "netns",
                ns,
            ])?;
            ip(&["link", "set", &n.host_veth, "master", br, "up"])?;
            ip(&["-n", ns, "link", "set", &peer, "name", "eth0"])?;
            ip(&["-n", ns, "addr", "add", &addr, "dev", "eth0"])?;
            ip(&["-n", ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&["-n", ns, "route", "add", "default", "via", &gw])?;
        }
        info!(bridge = %br, gateway = %self.gateway, nodes = self.nodes.len(), "node network created");
        Ok(())
    }

    /// Kills every process in our namespaces, deletes them and the bridge.
    /// Returns what could not be removed (empty: nothing is left).
    pub fn destroy(&self) -> Vec<String> {
        let mut left = Vec::new();
        let mut names = self.existing_namespaces();
        for n in &self.nodes {
            if !names.contains(&n.netns) && Path::new("/run/netns").join(&n.netns).exists() {
                names.push(n.netns.clone());
            }
        }
        for ns in &names {
            let pids = kill_namespace(ns, Duration::from_secs(5));
            if !pids.is_empty() {
                left.push(format!("processes {pids:?} in {ns}"));
            }
        }
        // Veth pairs first (deleting one end deletes both at once; a
        // namespace's links otherwise go away asynchronously after it).
        for n in &self.nodes {
            if Path::new("/sys/class/net").join(&n.host_veth).exists()
                && let Err(e) = ip(&["link", "del", &n.host_veth])
            {
                left.push(e.to_string());
            }
        }
        for ns in &names {
            if let Err(e) = ip(&["netns", "del", ns]) {
                left.push(e.to_string());
            }
        }
        // A bridge is deleted only if it is ours (alias = our data directory).
        match link_alias(&self.bridge) {
            Some(a) if a == self.owner => {
                if let Err(e) = ip(&["link", "del", &self.bridge]) {
                    left.push(e.to_string());
                }
            }
            Some(_) | None => {}
        }
        left
    }

    /// What of this network still exists (namespaces, links): empty after
    /// a complete [`Network::destroy`].
    pub fn leftovers(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .existing_namespaces()
            .into_iter()
            .map(|n| format!("netns {n}"))
            .collect();
        if link_alias(&self.bridge).is_some_and(|a| a == self.owner) {
            v.push(format!("link {}", self.bridge));
        }
        for n in &self.nodes {
            if Path::new("/sys/class/net").join(&n.host_veth).exists() {
                v.push(format!("link {}", n.host_veth));
            }
        }
        v
    }
}

/// Device and inode of a network namespace file.
fn ns_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Live processes whose network namespace is `/run/netns/<name>`.
pub fn namespace_pids(name: &str) -> Vec<i32> {
    let Some(id) = ns_id(&Path::new("/run/netns").join(name)) else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if ns_id(&e.path().join("ns/net")) == Some(id) {
            pids.push(pid);
        }
    }
    pids
}

/// SIGKILLs every process in namespace `name` until none is left or
/// `limit` passes; returns the survivors.
pub fn kill_namespace(name: &str, limit: Duration) -> Vec<i32> {
    let t0 = Instant::now();
    loop {
        let pids = namespace_pids(name);
        if pids.is_empty() || t0.elapsed() > limit {
            return pids;
        }
        for pid in &pids {
            // SAFETY: kill(2) on a pid in a namespace this cluster created; no memory is touched.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
            // Our own children (or orphans re-parented to us, the subreaper): reap them.
            // SAFETY: waitpid with WNOHANG on a specific pid; a non-child just gives ECHILD.
            unsafe { libc::waitpid(*pid, std::ptr::null_mut(), libc::WNOHANG) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Makes this process the reaper of orphaned descendants (launchers and
/// replica servers whose agent was killed), so none is left unreaped.
pub fn become_subreaper() {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) only sets a flag on this process.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}

/// Forwards TCP connections from `listen` to `target` (the API server on
/// loopback, reached from the node namespaces through the bridge).
pub async fn spawn_proxy(
    listen: SocketAddr,
    target: SocketAddr,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let l = tokio::net::TcpListener::bind(listen).await?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = l.accept().await else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            tokio::spawn(async move {
                let Ok(mut out) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let _ = inbound.set_nodelay(true);
                let _ = out.set_nodelay(true);
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
            });
        }
    }))
}

/// Whether `pem` (a certificate) names IP address `ip` (a DER
/// subjectAltName iPAddress entry: context tag 7, length 4, the octets).
pub fn cert_names_ip(pem: &str, ip: Ipv4Addr) -> bool {
    use base64::Engine as _;
    let b64: String = pem
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .map(str::trim)
        .collect();
    let Ok(der) = base64::engine::general_purpose::STANDARD.decode(b64) else {
        return false;
    };
    let o = ip.octets();
    let needle = [0x87, 0x04, o[0], o[1], o[2], o[3]];
    der.windows(needle.len()).any(|w| w == needle)
}

/// Writes the kubeconfig the node agents use: the API server through the
/// bridge address.
pub fn write_agent_kubeconfig(
    path: &Path,
    server: &str,
    ca_pem: &str,
    token: &str,
) -> Result<(), NetnsError> {
    use base64::Engine as _;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem.as_bytes());
    let cfg = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "sheaf", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": "sheaf-agent", "user": {"token": token}}],
        "contexts": [{"name": "sheaf", "context": {"cluster": "sheaf", "user": "sheaf-agent"}}],
        "current-context": "sheaf",
    });
    let text = serde_yaml::to_string(&cfg).map_err(|e| NetnsError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })?;
    sheaf_orchestrator::api::tls::write_private(path, text.as_bytes()).map_err(|e| NetnsError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })
}

/// A node process the cluster supervises.
#[derive(Debug)]
struct NodeProc {
    /// It should run (false after `kill`).
    wanted: Arc<AtomicBool>,
    /// Its agent's pid (0 between restarts).
    pid: Arc<AtomicU32>,
    task: tokio::task::JoinHandle<()>,
}

/// The node processes of a `--netns` cluster.
#[derive(Debug)]
pub struct NetnsNodes {
    net: Network,
    exe: PathBuf,
    kubeconfig: PathBuf,
    configs: BTreeMap<String, NodeAgentConfig>,
    procs: BTreeMap<String, NodeProc>,
}

impl NetnsNodes {
    /// Node processes for `net` (not started yet); `configs` are the agent
    /// settings per node (as the in-process cluster would use them).
    pub fn new(
        net: Network,
        exe: PathBuf,
        kubeconfig: PathBuf,
        configs: BTreeMap<String, NodeAgentConfig>,
    ) -> NetnsNodes {
        NetnsNodes {
            net,
            exe,
            kubeconfig,
            configs,
            procs: BTreeMap::new(),
        }
    }

    /// The network.
    pub fn network(&self) -> &Network {
        &self.net
    }

    /// Node names.
    pub fn node_names(&self) -> Vec<String> {
        self.configs.keys().cloned().collect()
    }

    /// Whether node `name` should be running (not killed).
    pub fn is_up(&self, name: &str) -> bool {
        self.procs
            .get(name)
            .is_some_and(|p| p.wanted.load(Ordering::SeqCst))
    }

    /// The agent pid of node `name`, if it runs.
    pub fn agent_pid(&self, name: &str) -> Option<u32> {
        self.procs
            .get(name)
            .map(|p| p.pid.load(Ordering::SeqCst))
            .filter(|p| *p != 0)
    }

    fn command(&self, name: &str) -> Result<tokio::process::Command, NetnsError> {
        let cfg = self
            .configs
            .get(name)
            .ok_or_else(|| NetnsError::NoNode(name.into()))?;
        let net = self
            .net
            .node(name)
            .ok_or_else(|| NetnsError::NoNode(name.into()))?;
        std::fs::create_dir_all(&cfg.data_dir).map_err(io_err(&cfg.data_dir))?;
        let log_path = cfg.data_dir.join("agent.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io_err(&log_path))?;
        let log2 = log.try_clone().map_err(io_err(&log_path))?;
        let ns_path = Path::new("/run/netns").join(&net.netns);
        let ns = std::fs::File::open(&ns_path).map_err(io_err(&ns_path))?;
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.arg("--data-dir")
            .arg(&cfg.data_dir)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("agent")
            .arg("--node")
            .arg(name)
            .arg("--secret-file")
            .arg(&cfg.secret_file)
            .arg("--replica-host")
            .arg(net.addr.to_string())
            .arg("--cpu-millis")
            .arg(cfg.cpu_millis.to_string())
            .arg("--memory-bytes")
            .arg(cfg.memory_bytes.to_string())
            .arg("--storage-bytes")
            .arg(cfg.storage_bytes.to_string())
            .arg("--heartbeat-ms")
            .arg(cfg.heartbeat_interval.as_millis().to_string())
            // Each node namespace has its own pod bridge (same gateway on
            // every node, so a VM keeps its address when it moves).
            .arg("--pod-cidr")
            .arg(POD_CIDR);
        if let Some(z) = &cfg.zone {
            cmd.arg("--zone").arg(z);
        }
        for d in cfg.images.roots() {
            cmd.arg("--image-dir").arg(d);
        }
        for d in cfg.images.denied() {
            cmd.arg("--protect-dir").arg(d);
        }
        cmd.stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0)
            .kill_on_drop(false);
        let fd = ns.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and only
        // calls setns(2), which is async-signal-safe; `ns` stays open (the
        // closure owns it) until the command is dropped.
        unsafe {
            cmd.pre_exec(move || {
                let _keep = &ns;
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(cmd)
    }

    /// Starts (or restarts after a kill) node `name`'s process; a running
    /// node gets SIGTERM first (an agent restart: its launchers and
    /// replica servers keep running and are adopted).
    pub async fn start(&mut self, name: &str) -> Result<u32, NetnsError> {
        if !self.configs.contains_key(name) {
            return Err(NetnsError::NoNode(name.into()));
        }
        if let Some(old) = self.procs.remove(name) {
            old.wanted.store(false, Ordering::SeqCst);
            let pid = old.pid.load(Ordering::SeqCst);
            if pid != 0 {
                // SAFETY: SIGTERM to the agent this cluster started.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            }
            let _ = tokio::time::timeout(Duration::from_secs(10), old.task).await;
        }
        let mut cmd = self.command(name)?;
        let mut child = cmd.spawn().map_err(|source| NetnsError::Spawn {
            node: name.into(),
            source,
        })?;
        let first = child.id().unwrap_or(0);
        let wanted = Arc::new(AtomicBool::new(true));
        let pid = Arc::new(AtomicU32::new(first));
        info!(node = %name, pid = first, "node process started");
        let (w, p) = (wanted.clone(), pid.clone());
        let node = name.to_string();
        let mut respawn = self.command(name)?;
        let task = tokio::spawn(async move {
            let mut backoff = Duration::from_millis(500);
            loop {
                let st = child.wait().await;
                p.store(0, Ordering::SeqCst);
                if !w.load(Ordering::SeqCst) {
                    return;
                }
                warn!(%node, status = ?st, "node process exited; restarting it in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(30));
                if !w.load(Ordering::SeqCst) {
                    return;
                }
                match respawn.spawn() {
                    Ok(c) => {
                        p.store(c.id().unwrap_or(0), Ordering::SeqCst);
                        child = c;
                    }
                    Err(e) => {
                        warn!(%node, error = %e, "restarting node process");
                        return;
                    }
                }
            }
        });
        self.procs
            .insert(name.to_string(), NodeProc { wanted, pid, task });
        Ok(first)
    }

    /// Kills node `name` like a power cut: SIGKILL to every process in its
    /// namespace (agent, replica servers, launchers), not restarted.
    /// Returns how many processes were killed.
    pub fn kill(&mut self, name: &str) -> Result<usize, NetnsError> {
        let net = self
            .net
            .node(name)
            .ok_or_else(|| NetnsError::NoNode(name.into()))?
            .clone();
        if let Some(p) = self.procs.get(name) {
            p.wanted.store(false, Ordering::SeqCst);
        }
        let n = namespace_pids(&net.netns).len();
        let left = kill_namespace(&net.netns, Duration::from_secs(5));
        if !left.is_empty() {
            warn!(node = %name, ?left, "processes survived SIGKILL");
        }
        warn!(node = %name, processes = n, "node killed (SIGKILL to its namespace)");
        Ok(n)
    }

    /// Kills every node and removes the network; returns what is left
    /// (empty: no process, namespace or link remains).
    pub fn shutdown(&mut self) -> Vec<String> {
        for p in self.procs.values() {
            p.wanted.store(false, Ordering::SeqCst);
        }
        for n in self.node_names() {
            let _ = self.kill(&n);
        }
        for (_, p) in std::mem::take(&mut self.procs) {
            p.task.abort();
        }
        let mut left = self.net.destroy();
        left.extend(self.net.leftovers());
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificate_ip_names_are_found() {
        let tmp = tempfile::tempdir().unwrap();
        let tls = sheaf_orchestrator::api::TlsMaterial::load_or_create(
            tmp.path(),
            &["10.213.7.1".to_string()],
        )
        .unwrap();
        assert!(cert_names_ip(&tls.cert_pem, Ipv4Addr::new(10, 213, 7, 1)));
        assert!(cert_names_ip(&tls.cert_pem, Ipv4Addr::new(127, 0, 0, 1)));
        assert!(!cert_names_ip(&tls.cert_pem, Ipv4Addr::new(10, 213, 7, 2)));
        assert!(!cert_names_ip("not a pem", Ipv4Addr::new(10, 213, 7, 1)));
    }

    #[test]
    fn subnets_in_use_are_recognised() {
        let seen =
            "2: eth0    inet 10.213.1.1/24 brd 10.213.1.255 scope global\n10.213.12.0/24 dev x";
        assert!(subnet_in_use(1, seen));
        assert!(subnet_in_use(12, seen));
        assert!(!subnet_in_use(2, seen));
        assert!(!subnet_in_use(121, seen));
    }
}
