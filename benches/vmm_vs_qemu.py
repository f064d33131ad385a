#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""sheaf-vmm vs QEMU -M microvm, same probe guest, same run.

Measures, for both VMMs booting the probe guest (vmm/guest/probe.rs, 32 MiB,
one virtio-blk disk, PVH entry for QEMU, Linux 64-bit entry for sheaf):

  * spawn -> first serial byte: a fresh VMM process until the guest's first
    console byte reaches our pipe (process start + VM setup + first guest
    instructions),
  * spawn -> exit: the whole probe (boot checks, 6 virtio-blk requests with
    interrupts, debug-exit),
  * boot-to-exit cycles per second, sequential processes,
  * RSS overhead: resident memory of the VMM process minus the resident part
    of guest RAM, measured while the guest idles in its heartbeat loop,

plus sheaf's in-process (library) figures from vmm/examples/probe_bench.rs:
create -> first guest exit, and cycles per second in one process.

Usage: benches/vmm_vs_qemu.py [--runs N] [--markdown]
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEM_MIB = 32
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))


def build():
    subprocess.run(
        ["cargo", "build", "--release", "-p", "sheaf-vmm", "--example", "run_vm",
         "--example", "probe_bench"],
        cwd=ROOT, check=True)
    elfs = sorted(glob.glob(os.path.join(TARGET, "release/build/sheaf-vmm-*/out/sheaf-probe.elf")),
                  key=os.path.getmtime)
    return (os.path.join(TARGET, "release/examples/run_vm"),
            os.path.join(TARGET, "release/examples/probe_bench"), elfs[-1])


def sheaf_cmd(run_vm, probe, disk, extra=""):
    env = dict(os.environ, MEM_MIB=str(MEM_MIB), VIRTIO_CMDLINE="1")
    return [run_vm, probe, "-", "console=ttyS0 probe.need_disk=1" + extra, disk], env


def qemu_cmd(probe, disk, extra=""):
    return ["qemu-system-x86_64", "-M", "microvm,x-option-roms=off,rtc=off,ioapic2=off",
            "-bios", "/usr/share/qemu/qboot.rom", "-accel", "kvm", "-cpu", "qemu64,-pni",
            "-m", str(MEM_MIB), "-nodefaults", "-no-user-config", "-nographic", "-display", "none",
            "-serial", "stdio", "-no-reboot", "-global", "virtio-mmio.force-legacy=false",
            "-kernel", probe,
            "-append", "console=ttyS0 probe.need_disk=1 virtio_mmio.device=512@0xfeb00000:16" + extra,
            "-drive", f"id=d0,file={disk},format=raw,if=none",
            "-device", "virtio-blk-device,drive=d0,bus=virtio-mmio-bus.0",
            "-device", "isa-debug-exit,iobase=0xf4,iosize=4"], dict(os.environ)


def timed_run(cmd, env):
    """(spawn->first byte, spawn->exit, full output) in seconds."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = p.stdout.read(1)
    t1 = time.perf_counter()
    rest = p.stdout.read()
    p.wait()
    t2 = time.perf_counter()
    out = (first + rest).decode(errors="replace")
    if "probe: PASS" not in out:
        raise SystemExit(f"probe failed under {cmd[0]}:\n{out}")
    return t1 - t0, t2 - t0


def rss_overhead(cmd, env):
    """KiB of VMM RSS excluding guest RAM, while the guest idles."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    buf = b""
    while b"PASS" not in buf:
        chunk = p.stdout.read1(4096)
        if not chunk:
            raise SystemExit(f"{cmd[0]} exited early: {buf!r}")
        buf += chunk
    time.sleep(0.5)
    total = guest = 0
    cur_size = 0
    with open(f"/proc/{p.pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if parts[0] == "Size:":
                cur_size = int(parts[1])
            elif parts[0] == "Rss:":
                rss = int(parts[1])
                total += rss
                # Guest RAM: the anonymous mapping of MEM_MIB (QEMU may pad
                # it by up to 2 MiB for alignment).
                if MEM_MIB * 1024 <= cur_size <= MEM_MIB * 1024 + 4096:
                    guest = max(guest, rss)
    p.kill()
    p.wait()
    return total - guest, total, guest


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    run_vm, probe_bench, probe = build()
    with tempfile.TemporaryDirectory() as d:
        disk = os.path.join(d, "disk.img")
        with open(disk, "wb") as f:
            f.write(b"SHEAF-MARKER-bench".ljust(1 << 20, b"\0"))
        res = {}
        for name, mk in (("sheaf-vmm", lambda x="": sheaf_cmd(run_vm, probe, disk, x)),
                         ("qemu microvm", lambda x="": qemu_cmd(probe, disk, x))):
            cmd, env = mk()
            timed_run(cmd, env)  # warm caches
            firsts, exits = [], []
            t = time.perf_counter()
            for _ in range(a.runs):
                f1, f2 = timed_run(cmd, env)
                firsts.append(f1 * 1e3)
                exits.append(f2 * 1e3)
            rate = a.runs / (time.perf_counter() - t)
            cmd, env = mk(" probe.spin=1")
            overhead, total, guest = rss_overhead(cmd, env)
            res[name] = dict(first_ms=statistics.median(firsts), first_min=min(firsts),
                             exit_ms=statistics.median(exits), rate=rate,
                             rss_over_kib=overhead, rss_kib=total, guest_kib=guest)
        lib = json.loads(subprocess.run([probe_bench, str(max(a.runs, 20))], check=True,
                                        capture_output=True, text=True).stdout)
    rows = [
        ("spawn → first serial byte, p50 (min)", lambda r: f"{r['first_ms']:.1f} ms ({r['first_min']:.1f})"),
        ("spawn → guest exit (whole probe), p50", lambda r: f"{r['exit_ms']:.1f} ms"),
        ("boot-to-exit cycles/s, sequential processes", lambda r: f"{r['rate']:.1f}"),
        ("RSS overhead beyond guest RAM", lambda r: f"{r['rss_over_kib'] / 1024:.2f} MiB"),
        ("RSS total (guest RAM resident)", lambda r: f"{r['rss_kib'] / 1024:.1f} MiB ({r['guest_kib'] / 1024:.1f})"),
    ]
    s, q = res["sheaf-vmm"], res["qemu microvm"]
    print(f"runs per figure: {a.runs}; guest: probe, {MEM_MIB} MiB, 1 vCPU, 1 virtio-blk disk")
    print("| figure | sheaf-vmm | QEMU -M microvm | ratio |")
    print("|---|---|---|---|")
    ratios = [q["first_ms"] / s["first_ms"], q["exit_ms"] / s["exit_ms"], s["rate"] / q["rate"],
              q["rss_over_kib"] / max(s["rss_over_kib"], 1), None]
    for (label, fmt), ratio in zip(rows, ratios):
        rt = f"{ratio:.1f}× better" if ratio else ""
        print(f"| {label} | {fmt(s)} | {fmt(q)} | {rt} |")
    print(f"| in-process create → first guest exit, p50 (min) | "
          f"{lib['create_to_first_exit_ms_p50']:.2f} ms ({lib['create_to_first_exit_ms_min']:.2f}) | – | |")
    print(f"| in-process boot-to-exit cycles/s (1 thread / 2 threads) | "
          f"{lib['cycles_per_s_seq']:.0f} / {lib['cycles_per_s_2threads']:.0f} | – | |")
    if s["rss_over_kib"] > 3 * 1024:
        print("WARNING: sheaf-vmm RSS overhead above the 3 MiB goal", file=sys.stderr)


if __name__ == "__main__":
    main()
