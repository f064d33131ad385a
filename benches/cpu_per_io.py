#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""CPU per I/O of each sheaf process under one fio workload over NBD.

Starts sheaf-blockd with 1 local replica, or with 3 sheaf-replica processes
on 127.0.0.1, fills the export, runs fio (`--ioengine=nbd`) and reads each
process's CPU time (/proc/PID/stat utime+stime) around the middle of the
run. Prints IOPS, p50 latency, cores used and µs of CPU per I/O per
process. With --baseline-bindir, runs alternate between the two sets of
binaries (fresh stores each run), so a change can be judged by CPU per
I/O even on a machine too noisy for throughput comparisons.

  python3 benches/cpu_per_io.py --bindir target/release --replicas 3 \\
      --rw write --bs 1M --qd 8 --runs 3 --baseline-bindir /tmp/old
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SIZE = 512 << 20


def wait_socket(path, procs):
    for _ in range(100):
        if os.path.exists(path):
            return
        if any(p.poll() is not None for p in procs):
            sys.exit("a sheaf process exited during startup")
        time.sleep(0.1)
    sys.exit(f"{path} did not appear")


def start(bindir, replicas, work):
    """Starts the processes; returns (socket path, [(name, Popen)])."""
    sock = os.path.join(work, "nbd.sock")
    procs = []
    quiet = subprocess.DEVNULL
    if replicas == 1:
        one = os.path.join(work, "one")
        subprocess.run([f"{bindir}/sheaf-blockd", "create", "--dir", one, "--size", str(SIZE)],
                       check=True, stdout=quiet, stderr=quiet)
        spec = one
    else:
        secret = os.path.join(work, "secret")
        with open(secret, "wb") as f:
            f.write(os.urandom(32))
        addrs = []
        for i in range(replicas):
            port = 47300 + i
            addrs.append(f"127.0.0.1:{port}")
            p = subprocess.Popen([f"{bindir}/sheaf-replica", "--dir", os.path.join(work, f"r{i}"),
                                  "--listen", addrs[-1], "--secret-file", secret,
                                  "--create-size", str(SIZE)], stdout=quiet, stderr=quiet)
            procs.append((f"replica{i}", p))
        time.sleep(1)
        spec = ",".join(addrs)
    extra = [] if replicas == 1 else ["--secret-file", os.path.join(work, "secret")]
    p = subprocess.Popen([f"{bindir}/sheaf-blockd", "nbd", "--unix", sock,
                          "--export", f"vol={spec}", *extra], stdout=quiet, stderr=quiet)
    procs.append(("blockd", p))
    wait_socket(sock, [p for _, p in procs])
    return sock, procs


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def fio(sock, rw, bs, qd, secs, out):
    return subprocess.Popen(
        ["fio", "--name=b", "--ioengine=nbd", f"--uri=nbd+unix:///vol?socket={sock}",
         f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}", f"--size={SIZE}", "--randrepeat=0",
         "--norandommap", *( [f"--runtime={secs}", "--time_based"] if secs else []),
         "--output-format=json"], stdout=out, stderr=subprocess.DEVNULL)


def one_run(bindir, a):
    work = tempfile.mkdtemp(prefix="sheaf-cpu-", dir=a.dir)
    sock, procs = start(bindir, a.replicas, work)
    try:
        subprocess.run(["fio", "--name=fill", "--ioengine=nbd",
                        f"--uri=nbd+unix:///vol?socket={sock}", "--rw=write", "--bs=1M",
                        "--iodepth=8", f"--size={SIZE}"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out_path = os.path.join(work, "fio.json")
        with open(out_path, "w") as out:
            f = fio(sock, a.rw, a.bs, a.qd, a.secs, out)
            time.sleep(1)
            t0, c0 = time.monotonic(), {n: cpu_ticks(p.pid) for n, p in procs}
            time.sleep(max(1, a.secs - 2))
            t1, c1 = time.monotonic(), {n: cpu_ticks(p.pid) for n, p in procs}
            f.wait()
        text = open(out_path).read()
        job = json.loads(text[text.index("{"):])["jobs"][0]
        side = job["read"] if job["read"]["io_bytes"] else job["write"]
        iops = side["iops"]
        hz = os.sysconf("SC_CLK_TCK")
        cores = {n: (c1[n] - c0[n]) / hz / (t1 - t0) for n in c0}
        return {
            "iops": iops,
            "p50_us": side["clat_ns"]["percentile"]["50.000000"] / 1000,
            "cores": cores,
            "us_per_io": {n: c * 1e6 / iops for n, c in cores.items()},
        }
    finally:
        for _, p in procs:
            p.send_signal(signal.SIGTERM)
        for _, p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bindir", required=True, help="sheaf-blockd and sheaf-replica")
    ap.add_argument("--baseline-bindir", help="alternate runs with these binaries")
    ap.add_argument("--replicas", type=int, choices=[1, 3], default=3)
    ap.add_argument("--rw", default="randwrite")
    ap.add_argument("--bs", default="4k")
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--secs", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--dir", default="/var/tmp", help="where the stores go")
    a = ap.parse_args()
    sets = [("new", a.bindir)]
    if a.baseline_bindir:
        sets.insert(0, ("old", a.baseline_bindir))
    print(f"{a.replicas} replica(s), fio {a.rw} {a.bs} QD{a.qd}, {a.secs} s per run, "
          f"load {os.getloadavg()[0]:.1f}")
    for r in range(a.runs):
        for label, bindir in sets:
            res = one_run(bindir, a)
            per = " ".join(f"{n} {v:.1f}" for n, v in res["us_per_io"].items())
            total = sum(res["us_per_io"].values())
            print(f"run {r + 1} {label}: {res['iops']:>9,.0f} IOPS  p50 {res['p50_us']:>7.0f} µs  "
                  f"cores {sum(res['cores'].values()):.2f}  CPU µs/IO {total:.1f} = {per}",
                  flush=True)


if __name__ == "__main__":
    main()
