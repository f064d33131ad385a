#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A tour of the sheaf Python API (docs/bindings-python.md).

1. a replicated volume over three in-process replica servers;
2. the probe guest on /dev/kvm with that volume as its disk: start, watch the
   console (asyncio), pause, resume, stop; read the guest's answer back;
3. placement onto a synthetic cluster;
4. a running API server (when a kubeconfig is given): create and list VMs.

    pip install ./bindings/python
    python3 examples/python/sheaf_demo.py WORKDIR [KUBECONFIG]
"""

from __future__ import annotations

import asyncio
import pathlib
import sys

import sheaf

SECRET = b"sheaf-python-demo-secret"
GIB = 1 << 30


async def run_vm(vol: sheaf.Volume) -> None:
    with sheaf.Vm(
        "py-demo",
        memory_mib=64,
        kernel=sheaf.probe_guest_path(),
        cmdline="console=ttyS0 probe.need_disk=1 probe.halt=1",
    ) as vm:
        vm.attach_volume(vol, "py-demo-disk")
        vm.start()
        out = await vm.wait_for_console(b"probe: PASS", timeout=30)
        print(f"vm: {out.decode().splitlines()[-1]!r} after {len(out)} console bytes")
        vm.pause()
        print(f"vm: {vm.state}")
        vm.resume()
        print(f"vm: {vm.state}; still running: {await vm.wait_async(timeout=0.05) is None}")
    # Leaving the block stopped the VM.
    print(f"vm: {vm.state} ({vm.exit})")


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    work = pathlib.Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)

    servers = [sheaf.ReplicaServer(work / f"replica{i}", SECRET, create_size=4 << 20) for i in range(3)]
    try:
        with sheaf.Volume([s.location for s in servers], secret=SECRET) as vol:
            vol.write(0, b"hello from Python")
            vol.flush()
            print(f"volume: {vol.size} bytes, {vol.wait_in_sync()['active']} in sync")
            asyncio.run(run_vm(vol))
            print(f"volume: sector 1 = {vol.read(512, 29)!r}")
    finally:
        for s in servers:
            s.stop()

    sched = sheaf.Scheduler()
    for i in range(4):
        sched.add_node(f"node-{i}", 4000, 16 * GIB, zone=f"zone-{i % 2}")
    for i in range(6):
        print(f"sched: vm-{i} -> {sched.place(f'vm-{i}', 2000, 4 * GIB)}")
    try:
        sched.place("too-big", 8000, GIB)
    except sheaf.UnschedulableError as e:
        print(f"sched: too-big -> {e}")

    if len(sys.argv) > 2:
        cluster = sheaf.Cluster.from_kubeconfig(sys.argv[2])
        cluster.create_vm(
            {
                "apiVersion": "kubevirt.io/v1",
                "kind": "VirtualMachine",
                "metadata": {"name": "py-demo-vm"},
                "spec": {
                    "runStrategy": "Halted",
                    "template": {
                        "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {}}}
                    },
                },
            }
        )
        names = [vm["metadata"]["name"] for vm in cluster.list_vms()]
        print(f"cluster: {cluster.server} has VMs {names}")
        cluster.delete_vm("py-demo-vm")
    print("sheaf_demo.py: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
