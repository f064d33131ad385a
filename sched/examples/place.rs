// SPDX-License-Identifier: Apache-2.0
//! The sheaf-sched API in 30 lines: a snapshot, VMs, a volume's replicas.
//!
//! `cargo run -p sheaf-sched --example place`

use sheaf_sched::{
    ClusterSnapshot, HOSTNAME_LABEL, Node, ReplicaRequest, Request, SchedError, Scheduler,
};

const GIB: u64 = 1 << 30;

fn main() -> Result<(), SchedError> {
    let mut snap =
        ClusterSnapshot::from_nodes(["a", "b", "c"].iter().enumerate().map(|(i, z)| {
            Node::new(format!("node-{i}"), 8_000, 32 * GIB)
                .zone(*z)
                .disk("nvme0", 500 * GIB)
        }))?;
    let mut sched = Scheduler::new();

    // Three replicas of the VM's disk, one per zone.
    let vol = ReplicaRequest {
        volume: "db-disk".into(),
        size_bytes: 50 * GIB,
        replicas: 3,
        ..Default::default()
    };
    let replicas = sched.place_replicas(&snap, &vol)?;
    snap.bind_replicas(&replicas)?;
    println!(
        "replicas: {:?}",
        replicas.targets.iter().map(|t| &t.node).collect::<Vec<_>>()
    );

    // Two database VMs on different nodes, preferring nodes that hold a replica.
    for i in 0..2 {
        let mut vm = Request::new(format!("db-{i}"), 4_000, 16 * GIB)
            .label("app", "db")
            .anti_affinity("app", "db", HOSTNAME_LABEL);
        vm = vm.replica_on(&replicas.targets[i].node);
        let p = sched.schedule(&mut snap, &vm)?;
        println!("{} -> {} (score {})", vm.name, p.node, p.score);
    }

    // A third one that cannot fit: the error explains why, per class of node.
    let big = Request::new("db-big", 16_000, 16 * GIB);
    if let Err(e) = sched.place(&snap, &big) {
        println!("db-big: {e}");
    }
    Ok(())
}
