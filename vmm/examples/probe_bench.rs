// SPDX-License-Identifier: Apache-2.0
//! In-process start-up figures of sheaf-vmm with the probe guest, as JSON:
//! create → first guest exit latency, full boot-to-exit cycles per second
//! (sequential and with 2 threads). Used by benches/vmm_vs_qemu.py.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use sheaf_vmm::{ExitReason, MemBackend, Vm, VmConfig, probe};

fn one() -> (Duration, Duration) {
    let cfg = VmConfig::builder()
        .kernel(probe::elf_path())
        .memory_mib(32)
        .cmdline("console=ttyS0 probe.need_disk=1")
        .cmdline_virtio_devices(true)
        .build()
        .unwrap();
    let t = Instant::now();
    let vm = Vm::builder(cfg)
        .disk_backend(Arc::new(MemBackend::new(1 << 20, "bench")))
        .create()
        .unwrap();
    vm.start().unwrap();
    assert_eq!(vm.wait(), ExitReason::DebugExit { code: 0 });
    (vm.metrics().create_to_first_exit.unwrap(), t.elapsed())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    one(); // warm-up
    let mut first = Vec::new();
    let mut cycle = Vec::new();
    let t = Instant::now();
    for _ in 0..n {
        let (f, c) = one();
        first.push(f.as_secs_f64() * 1e3);
        cycle.push(c.as_secs_f64() * 1e3);
    }
    let seq_rate = n as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    let threads: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || {
                (0..n / 2).for_each(|_| {
                    one();
                })
            })
        })
        .collect();
    threads.into_iter().for_each(|h| h.join().unwrap());
    let par_rate = (n / 2 * 2) as f64 / t.elapsed().as_secs_f64();
    println!(
        "{{\"runs\":{n},\"create_to_first_exit_ms_p50\":{:.3},\"create_to_first_exit_ms_min\":{:.3},\"boot_to_exit_ms_p50\":{:.3},\"cycles_per_s_seq\":{:.1},\"cycles_per_s_2threads\":{:.1}}}",
        median(first.clone()),
        first.iter().cloned().fold(f64::INFINITY, f64::min),
        median(cycle),
        seq_rate,
        par_rate
    );
}
