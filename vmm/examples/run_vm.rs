// SPDX-License-Identifier: Apache-2.0
//! Boots a kernel with sheaf-vmm, console on stdout:
//! `run_vm KERNEL [INITRAMFS|-] [CMDLINE] [DISK...]`, or
//! `run_vm --from-disk [-] [CMDLINE] DISK...` to boot the kernel inside the
//! first disk (env: MEM_MIB, VCPUS, VIRTIO_CMDLINE=1 to also list virtio-mmio devices on the command line,
//! WAIT_S=n to stop the guest after n seconds, PROGRESS_S=n to print
//! metrics every n seconds, NET_TAP=name [NET_MAC=aa:bb:..] to add a
//! virtio-net card on that tap).
#![allow(clippy::unwrap_used)]

use sheaf_vmm::{SerialConfig, Vm, VmConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let kernel = args
        .first()
        .ok_or("usage: run_vm KERNEL|--from-disk [INITRAMFS|-] [CMDLINE] [DISK...]")?;
    let mut cfg = VmConfig::builder();
    cfg = if kernel == "--from-disk" {
        cfg.boot_from_disk(0, None)
    } else {
        cfg.kernel(kernel)
    };
    let mut cfg = cfg
        .cmdline(args.get(2).map_or("console=ttyS0", |s| s.as_str()))
        .memory_mib(env("MEM_MIB", 256))
        .vcpus(env("VCPUS", 1) as u8)
        .cmdline_virtio_devices(std::env::var("VIRTIO_CMDLINE").is_ok_and(|v| v == "1"))
        .serial(SerialConfig::Stdout);
    if let Some(i) = args.get(1).filter(|s| *s != "-") {
        cfg = cfg.initramfs(i);
    }
    for d in args.iter().skip(3) {
        cfg = cfg.disk(d);
    }
    if let Ok(tap) = std::env::var("NET_TAP") {
        cfg = cfg.net_config(sheaf_vmm::NetConfig {
            tap,
            mac: std::env::var("NET_MAC").ok(),
        });
    }
    let vm = Vm::new(cfg.build()?)?;
    vm.start()?;
    let progress = std::time::Duration::from_secs(env("PROGRESS_S", 3600));
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_secs(env("WAIT_S", u64::MAX / 4));
    let reason = loop {
        if let Some(r) = vm.wait_timeout(progress) {
            break r;
        }
        eprintln!("sheaf-vmm: running: {:?}", vm.metrics());
        if std::time::Instant::now() >= deadline {
            eprintln!("sheaf-vmm: WAIT_S expired, stopping the guest");
            break vm.stop();
        }
    };
    eprintln!("sheaf-vmm: guest exited: {reason:?} ({:?})", vm.metrics());
    std::process::exit(if reason.is_clean() { 0 } else { 1 });
}
