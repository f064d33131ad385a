# SPDX-License-Identifier: Apache-2.0
"""VMs: the probe guest on /dev/kvm through the Python API."""

from __future__ import annotations

import asyncio
import pathlib
import threading

import pytest

import sheaf

pytestmark = pytest.mark.kvm


def probe_vm(name: str, cmdline: str) -> sheaf.Vm:
    return sheaf.Vm(name, memory_mib=64, kernel=sheaf.probe_guest_path(), cmdline=cmdline)


def test_boot_probe_and_read_console(tmp_path: pathlib.Path) -> None:
    disk = tmp_path / "disk.img"
    disk.write_bytes(b"from python".ljust(1024, b"\0"))
    with probe_vm("py-probe", "console=ttyS0 probe.token=py-token probe.need_disk=1") as vm:
        vm.add_disk(disk)
        assert vm.state == "created"
        vm.start()
        exit = vm.wait(timeout=60)
        assert exit is not None, "probe did not exit"
        assert (exit.kind, exit.code, exit.clean) == ("debug_exit", 0, True), exit
        assert vm.state == "stopped" and vm.exit is not None
        out = vm.console().decode()
        assert "token: py-token" in out and "probe: PASS" in out, out
        assert vm.metrics()["block_requests"] >= 5
    # The guest answered in sector 1.
    assert disk.read_bytes()[512:535] == b"PROBE-REPLY:from python"


def test_pause_resume_stop_and_async_wait() -> None:
    async def run() -> sheaf.Exit:
        vm = probe_vm("py-spin", "console=ttyS0 probe.halt=1")
        vm.start()
        await vm.wait_for_console(b"probe: PASS", timeout=30)
        vm.pause()
        assert vm.state == "paused"
        vm.resume()
        assert vm.state == "running"
        waiter = asyncio.ensure_future(vm.wait_async())
        # The event loop keeps running while the VM is waited on.
        for _ in range(5):
            await asyncio.sleep(0.01)
        assert not waiter.done()
        threading.Timer(0.05, vm.stop).start()
        exit = await asyncio.wait_for(waiter, timeout=30)
        assert exit is not None
        return exit

    exit = asyncio.run(run())
    assert exit.kind == "stopped"


def test_wait_releases_the_gil() -> None:
    vm = probe_vm("py-gil", "console=ttyS0 probe.halt=1")
    vm.start()
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        # Blocks ~0.3 s in Rust; Python code in the other thread keeps running.
        assert vm.wait(timeout=0.3) is None
    finally:
        stop.set()
        t.join()
    assert ticks > 1000, ticks
    assert vm.stop().kind == "stopped"


def test_errors_are_typed() -> None:
    vm = sheaf.Vm("py-errors")
    with pytest.raises(sheaf.StateError):
        vm.pause()
    with pytest.raises(sheaf.InvalidArgumentError) as e:
        vm.set_vcpus(0)
    assert isinstance(e.value, ValueError) and e.value.kind == "invalid_argument"
    with pytest.raises(sheaf.NotFoundError):
        vm.add_disk("/nonexistent/sheaf.img")
    with pytest.raises(ValueError):
        sheaf.Vm(boot_protocol="bios")
    with pytest.raises(sheaf.InvalidArgumentError):
        sheaf.Vm.from_config({"bogus": 1})
    vm.set_kernel("/nonexistent/vmlinux")
    with pytest.raises(sheaf.SheafError):
        vm.start()
    assert vm.state == "created"
    with pytest.raises(sheaf.InvalidArgumentError):
        vm.wait(timeout=-1)


def test_config_round_trip() -> None:
    vm = sheaf.Vm("cfg", vcpus=2, memory_mib=96, kernel="/k", cmdline="console=ttyS0")
    again = sheaf.Vm.from_config(vm.config_json())
    assert isinstance(again, sheaf.Vm)
    assert again.config_json() == vm.config_json()
