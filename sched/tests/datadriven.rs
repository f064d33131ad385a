// SPDX-License-Identifier: Apache-2.0
//! Golden tests for placement decisions, in the style of raft-rs'
//! datadriven tests: each file in `tests/testdata/` holds commands, a `----`
//! line, and the expected output up to a blank line.
//!
//! Run with `REWRITE=1` to regenerate the expected outputs (then review the
//! diff).
//!
//! Commands (sizes: `cpu` in cores or `500m`, `mem`/`size` in GiB or `512Mi`):
//!
//! ```text
//! node name=n1 cpu=4 mem=8 [zone=a] [labels=k=v,..] [taints=k=v:NoSchedule,..]
//!      [max=110] [unschedulable] [disks=d0:100,..] [disktags=d0:ssd|fast]
//! update-node ...        same arguments, replaces the spec
//! remove-node name=n1    cordon name=n1
//! schedule <vm>          place and bind;   place <vm>   place only
//! unbind name=vm
//! gang n=3 prefix=w <vm> all-or-nothing placement of n copies
//! replicas volume=v size=10 n=3 [existing=n1,..] [hard] [tags=ssd] [sel=k=v]
//! bind-replicas ...      same arguments, places and reserves the disks
//! state                  per-node usage and VMs
//! profile [pct=100] [strategy=most] [cpu-overcommit=400] [disable=A,B]
//!
//! <vm>: name=.. cpu=.. mem=.. [prio=N] [never] [labels=k=v,..] [sel=k=v,..]
//!       [node-in=key:v1|v2] [prefer=key:v:weight] [tol=k=v[:Effect] | tol=k:Exists]
//!       [anti=k=v@host|zone] [aff=k=v@host|zone] [pref-anti=k=v@host:w]
//!       [pref-aff=k=v@zone:w] [spread=zone:skew:k=v[:soft]]
//!       [replicas=n1,n2] [strict] [node=n1]
//! ```
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use sheaf_sched::plugins::{ResourceFitArgs, ScoringStrategy};
use sheaf_sched::{
    ClusterSnapshot, DataLocality, Disk, HOSTNAME_LABEL, LabelSelector, Node, NodeSelectorTerm,
    PreemptionPolicy, PreferredNodeTerm, ProfileConfig, ReplicaLocation, ReplicaRequest, Request,
    Requirement, SchedError, Scheduler, SchedulerConfig, TaintEffect, Toleration,
    TolerationOperator, TopologySpreadConstraint, VmAffinityTerm, WeightedVmAffinityTerm,
    WhenUnsatisfiable, ZONE_LABEL, ZoneAntiAffinity,
};

const GIB: u64 = 1 << 30;

struct Env {
    snap: ClusterSnapshot,
    sched: Scheduler,
}

fn args(line: &str) -> (String, Vec<(String, String)>) {
    let mut it = line.split_whitespace();
    let cmd = it.next().unwrap_or_default().to_string();
    let args = it
        .map(|t| match t.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (t.to_string(), String::new()),
        })
        .collect();
    (cmd, args)
}

fn get<'a>(a: &'a [(String, String)], k: &str) -> Option<&'a str> {
    a.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str())
}

fn has(a: &[(String, String)], k: &str) -> bool {
    a.iter().any(|(x, _)| x == k)
}

fn cpu(s: &str) -> u64 {
    match s.strip_suffix('m') {
        Some(m) => m.parse().unwrap(),
        None => (s.parse::<f64>().unwrap() * 1000.0) as u64,
    }
}

fn mem(s: &str) -> u64 {
    match s.strip_suffix("Mi") {
        Some(m) => m.parse::<u64>().unwrap() << 20,
        None => (s.parse::<f64>().unwrap() * GIB as f64) as u64,
    }
}

fn pairs(s: &str) -> BTreeMap<String, String> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn topo(s: &str) -> String {
    match s {
        "host" => HOSTNAME_LABEL.into(),
        "zone" => ZONE_LABEL.into(),
        o => o.into(),
    }
}

fn effect(s: &str) -> TaintEffect {
    match s {
        "NoSchedule" => TaintEffect::NoSchedule,
        "PreferNoSchedule" => TaintEffect::PreferNoSchedule,
        "NoExecute" => TaintEffect::NoExecute,
        o => panic!("bad effect {o}"),
    }
}

/// `k=v@topo[:weight]` -> (term, weight)
fn term(s: &str) -> (VmAffinityTerm, i32) {
    let (sel, rest) = s.split_once('@').unwrap();
    let (t, w) = match rest.split_once(':') {
        Some((t, w)) => (t, w.parse().unwrap()),
        None => (rest, 0),
    };
    (
        VmAffinityTerm {
            selector: LabelSelector {
                match_labels: pairs(sel),
                match_expressions: vec![],
            },
            topology_key: topo(t),
        },
        w,
    )
}

fn node(a: &[(String, String)]) -> Node {
    let mut n = Node::new(
        get(a, "name").unwrap(),
        cpu(get(a, "cpu").unwrap_or("4")),
        mem(get(a, "mem").unwrap_or("8")),
    );
    n.zone = get(a, "zone").map(Into::into);
    n.labels = pairs(get(a, "labels").unwrap_or(""));
    if let Some(m) = get(a, "max") {
        n.max_vms = m.parse().unwrap();
    }
    n.unschedulable = has(a, "unschedulable");
    for t in get(a, "taints")
        .unwrap_or("")
        .split(',')
        .filter(|s| !s.is_empty())
    {
        let (kv, e) = t.split_once(':').unwrap();
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        n = n.taint(k, v, effect(e));
    }
    for d in get(a, "disks")
        .unwrap_or("")
        .split(',')
        .filter(|s| !s.is_empty())
    {
        let (name, size) = d.split_once(':').unwrap();
        n.disks.push(Disk {
            name: name.into(),
            capacity_bytes: mem(size),
            reserved_bytes: 0,
            scheduled_bytes: 0,
            tags: vec![],
            schedulable: true,
        });
    }
    for d in get(a, "disktags")
        .unwrap_or("")
        .split(',')
        .filter(|s| !s.is_empty())
    {
        let (name, tags) = d.split_once(':').unwrap();
        let disk = n.disks.iter_mut().find(|x| x.name == name).unwrap();
        disk.tags = tags.split('|').map(Into::into).collect();
    }
    n
}

fn vm(a: &[(String, String)]) -> Request {
    let mut r = Request::new(
        get(a, "name").unwrap_or("vm"),
        cpu(get(a, "cpu").unwrap_or("1")),
        mem(get(a, "mem").unwrap_or("1")),
    );
    r.priority = get(a, "prio").map_or(0, |p| p.parse().unwrap());
    if has(a, "never") {
        r.preemption_policy = PreemptionPolicy::Never;
    }
    r.labels = pairs(get(a, "labels").unwrap_or(""));
    r.node_selector = pairs(get(a, "sel").unwrap_or(""));
    r.node_name = get(a, "node").map(Into::into);
    for (k, v) in a {
        match k.as_str() {
            "node-in" => {
                let (key, vals) = v.split_once(':').unwrap();
                r.node_affinity.required.push(NodeSelectorTerm {
                    match_expressions: vec![Requirement::is_in(key, vals.split('|'))],
                });
            }
            "prefer" => {
                let mut p = v.split(':');
                let (key, val, w) = (p.next().unwrap(), p.next().unwrap(), p.next().unwrap());
                r.node_affinity.preferred.push(PreferredNodeTerm {
                    weight: w.parse().unwrap(),
                    term: NodeSelectorTerm {
                        match_expressions: vec![Requirement::is_in(key, [val])],
                    },
                });
            }
            "tol" => {
                let (kv, e) = match v.split_once(':') {
                    Some((kv, e)) => (kv, Some(e)),
                    None => (v.as_str(), None),
                };
                let t = if e == Some("Exists") {
                    Toleration {
                        key: kv.into(),
                        operator: TolerationOperator::Exists,
                        ..Default::default()
                    }
                } else {
                    let (k, val) = kv.split_once('=').unwrap_or((kv, ""));
                    Toleration {
                        key: k.into(),
                        operator: TolerationOperator::Equal,
                        value: val.into(),
                        effect: e.map(effect),
                    }
                };
                r.tolerations.push(t);
            }
            "anti" => r.anti_affinity.required.push(term(v).0),
            "aff" => r.affinity.required.push(term(v).0),
            "pref-anti" => {
                let (term, weight) = term(v);
                r.anti_affinity
                    .preferred
                    .push(WeightedVmAffinityTerm { weight, term });
            }
            "pref-aff" => {
                let (term, weight) = term(v);
                r.affinity
                    .preferred
                    .push(WeightedVmAffinityTerm { weight, term });
            }
            "spread" => {
                let p: Vec<&str> = v.split(':').collect();
                r.topology_spread.push(TopologySpreadConstraint {
                    topology_key: topo(p[0]),
                    max_skew: p[1].parse().unwrap(),
                    selector: LabelSelector {
                        match_labels: pairs(p[2]),
                        match_expressions: vec![],
                    },
                    when_unsatisfiable: if p.get(3) == Some(&"soft") {
                        WhenUnsatisfiable::ScheduleAnyway
                    } else {
                        WhenUnsatisfiable::DoNotSchedule
                    },
                });
            }
            "replicas" => {
                r.volume_replicas = v.split(',').map(ReplicaLocation::healthy).collect();
            }
            "strict" => r.data_locality = DataLocality::StrictLocal,
            _ => {}
        }
    }
    r
}

fn replica_req(a: &[(String, String)]) -> ReplicaRequest {
    ReplicaRequest {
        volume: get(a, "volume").unwrap_or("vol").into(),
        size_bytes: mem(get(a, "size").unwrap_or("10")),
        replicas: get(a, "n").unwrap_or("3").parse().unwrap(),
        existing: get(a, "existing")
            .unwrap_or("")
            .split(',')
            .filter(|s| !s.is_empty())
            .map(ReplicaLocation::healthy)
            .collect(),
        node_selector: pairs(get(a, "sel").unwrap_or("")),
        disk_tags: get(a, "tags")
            .map(|t| t.split('|').map(Into::into).collect())
            .unwrap_or_default(),
        zone_anti_affinity: if has(a, "hard") {
            ZoneAntiAffinity::Hard
        } else {
            ZoneAntiAffinity::Soft
        },
    }
}

fn err(e: SchedError) -> String {
    format!("error: {e}")
}

fn placed(r: &Request, p: &sheaf_sched::Placement) -> String {
    if p.victims.is_empty() {
        format!("{} -> {}", r.name, p.node)
    } else {
        format!("{} -> {} (evicts {})", r.name, p.node, p.victims.join(", "))
    }
}

fn run(env: &mut Env, line: &str) -> String {
    let (cmd, a) = args(line);
    let ok = |r: Result<(), SchedError>| r.map_or_else(err, |()| "ok".into());
    match cmd.as_str() {
        "node" => ok(env.snap.add_node(node(&a))),
        "update-node" => ok(env.snap.update_node(node(&a))),
        "remove-node" => match env.snap.remove_node(get(&a, "name").unwrap()) {
            Ok(v) if v.is_empty() => "ok".into(),
            Ok(mut v) => {
                v.sort();
                format!("evicted {}", v.join(", "))
            }
            Err(e) => err(e),
        },
        "cordon" => ok(env.snap.set_unschedulable(get(&a, "name").unwrap(), true)),
        "unbind" => ok(env.snap.unbind(get(&a, "name").unwrap())),
        "schedule" => {
            let r = vm(&a);
            env.sched
                .schedule(&mut env.snap, &r)
                .map_or_else(err, |p| placed(&r, &p))
        }
        "place" => {
            let r = vm(&a);
            env.sched
                .place(&env.snap, &r)
                .map_or_else(err, |p| placed(&r, &p))
        }
        "gang" => {
            let n: usize = get(&a, "n").unwrap().parse().unwrap();
            let prefix = get(&a, "prefix").unwrap_or("g");
            let reqs: Vec<Request> = (0..n)
                .map(|i| {
                    let mut r = vm(&a);
                    r.name = format!("{prefix}-{i}");
                    r
                })
                .collect();
            match env.sched.place_gang(&mut env.snap, &reqs) {
                Ok(ps) => reqs
                    .iter()
                    .zip(&ps)
                    .map(|(r, p)| placed(r, p))
                    .collect::<Vec<_>>()
                    .join("\n"),
                Err(e) => {
                    let mut s = err_top(&e);
                    if let Some(u) = e.unschedulable() {
                        write!(s, "\ncause: {u}").unwrap();
                    }
                    s
                }
            }
        }
        "replicas" | "bind-replicas" => {
            let r = replica_req(&a);
            match env.sched.place_replicas(&env.snap, &r) {
                Ok(p) => {
                    if cmd == "bind-replicas" {
                        env.snap.bind_replicas(&p).unwrap();
                    }
                    if p.targets.is_empty() {
                        return "no new replicas needed".into();
                    }
                    p.targets
                        .iter()
                        .map(|t| {
                            format!(
                                "{}/{} (zone {})",
                                t.node,
                                t.disk,
                                t.zone.as_deref().unwrap_or("-")
                            )
                        })
                        .collect::<Vec<_>>()
                        .join("\n")
                }
                Err(e) => err(e),
            }
        }
        "state" => {
            let mut out = Vec::new();
            let mut nodes: Vec<_> = env.snap.nodes().collect();
            nodes.sort_by(|a, b| a.name().cmp(b.name()));
            for n in nodes {
                let mut vms: Vec<&str> = n
                    .vm_ids()
                    .iter()
                    .filter_map(|&id| env.snap.vm(id))
                    .map(|v| v.name())
                    .collect();
                vms.sort();
                let mut s = format!(
                    "{}: cpu {}/{} mem {}/{}",
                    n.name(),
                    n.requested().cpu_millis,
                    n.allocatable().cpu_millis,
                    n.requested().memory_bytes / GIB,
                    n.allocatable().memory_bytes / GIB,
                );
                if !vms.is_empty() {
                    write!(s, " vms {}", vms.join(" ")).unwrap();
                }
                for d in &n.spec().disks {
                    write!(
                        s,
                        " {}:{}/{}",
                        d.name,
                        d.scheduled_bytes / GIB,
                        d.capacity_bytes / GIB
                    )
                    .unwrap();
                }
                out.push(s);
            }
            out.join("\n")
        }
        "profile" => {
            let cfg = SchedulerConfig {
                profiles: vec![ProfileConfig {
                    percentage_of_nodes_to_score: get(&a, "pct").map(|p| p.parse().unwrap()),
                    resource_fit: ResourceFitArgs {
                        strategy: if get(&a, "strategy") == Some("most") {
                            ScoringStrategy::MostAllocated
                        } else {
                            ScoringStrategy::LeastAllocated
                        },
                        cpu_overcommit_percent: get(&a, "cpu-overcommit")
                            .map_or(100, |p| p.parse().unwrap()),
                        memory_overcommit_percent: 100,
                    },
                    disabled: get(&a, "disable")
                        .map(|d| d.split(',').map(Into::into).collect())
                        .unwrap_or_default(),
                    ..Default::default()
                }],
                ..Default::default()
            };
            match Scheduler::try_from(cfg) {
                Ok(s) => {
                    env.sched = s;
                    "ok".into()
                }
                Err(e) => err(e),
            }
        }
        o => panic!("unknown command {o}"),
    }
}

/// The error's own message (no source chain).
fn err_top(e: &SchedError) -> String {
    format!("error: {e}")
}

fn run_file(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap();
    let rewrite = std::env::var_os("REWRITE").is_some();
    let mut env = Env {
        snap: ClusterSnapshot::new(),
        sched: Scheduler::new(),
    };
    let mut out = String::new();
    let mut failures = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if line.trim().is_empty() || line.starts_with('#') {
            out.push_str(line);
            out.push('\n');
            i += 1;
            continue;
        }
        // A command, possibly continued with trailing '\'.
        let mut cmd = String::new();
        let mut cmd_lines = Vec::new();
        while i < lines.len() {
            cmd_lines.push(lines[i]);
            let l = lines[i].trim_end();
            i += 1;
            match l.strip_suffix('\\') {
                Some(p) => {
                    cmd.push_str(p);
                    cmd.push(' ');
                }
                None => {
                    cmd.push_str(l);
                    break;
                }
            }
        }
        assert_eq!(
            lines.get(i).copied(),
            Some("----"),
            "{}: missing ---- after {cmd}",
            path.display()
        );
        i += 1;
        let mut expected = Vec::new();
        while i < lines.len() && !lines[i].is_empty() {
            expected.push(lines[i]);
            i += 1;
        }
        let expected = expected.join("\n");
        let actual = run(&mut env, &cmd);
        if actual != expected {
            failures.push(format!(
                "{}: {cmd}\n--- expected\n{expected}\n--- actual\n{actual}\n",
                path.display()
            ));
        }
        for l in cmd_lines {
            out.push_str(l);
            out.push('\n');
        }
        out.push_str("----\n");
        out.push_str(&actual);
        out.push('\n');
    }
    if rewrite {
        std::fs::write(path, out).unwrap();
    } else if !failures.is_empty() {
        panic!("{}", failures.join("\n"));
    }
}

#[test]
fn testdata() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/testdata");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    for f in files {
        run_file(&f);
    }
}
