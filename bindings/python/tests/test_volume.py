# SPDX-License-Identifier: Apache-2.0
"""Replicated volumes: three replica servers, block I/O, a VM disk."""

from __future__ import annotations

import os
import pathlib
from typing import Iterator

import pytest

import sheaf

SECRET = b"python-test-replication-secret"


@pytest.fixture
def servers(tmp_path: pathlib.Path) -> Iterator[list[sheaf.ReplicaServer]]:
    srv = [
        sheaf.ReplicaServer(tmp_path / f"r{i}", SECRET, create_size=8 << 20) for i in range(3)
    ]
    yield srv
    for s in srv:
        s.stop()


def test_write_and_read_replicated_volume(servers: list[sheaf.ReplicaServer]) -> None:
    locations = [s.location for s in servers]
    assert all(loc.startswith("tcp://127.0.0.1:") for loc in locations)
    data = os.urandom(100_000)
    with sheaf.Volume(locations, secret=SECRET) as vol:
        assert vol.size == 8 << 20
        vol.write(12_345, data)
        vol.flush()
        assert vol.read(12_345, len(data)) == data
        st = vol.wait_in_sync(timeout=30)
        assert st["active"] == [0, 1, 2] and st["phase"] == "running", st
        with pytest.raises(sheaf.InvalidArgumentError):
            vol.read((8 << 20) - 10, 20)
    assert vol.closed
    with pytest.raises(sheaf.StateError):
        vol.read(0, 1)
    # Reattach: the data is on the replicas.
    with sheaf.Volume(locations, secret=SECRET) as vol:
        assert vol.read(12_345, len(data)) == data
    with pytest.raises(sheaf.VolumeError):
        sheaf.Volume(locations, secret=b"a-wrong-secret-of-16+", attach_timeout=1.0)


def test_local_volume_and_async_io(tmp_path: pathlib.Path) -> None:
    import asyncio

    async def run() -> bytes:
        with sheaf.Volume.local(tmp_path / "v", 1 << 20) as vol:
            await vol.write_async(4096, bytearray(b"async bytes"))
            return await vol.read_async(4096, 11)

    assert asyncio.run(run()) == b"async bytes"
    with pytest.raises(sheaf.InvalidArgumentError):
        sheaf.create_replica(tmp_path / "bad", 4097)


@pytest.mark.kvm
def test_volume_as_vm_disk(servers: list[sheaf.ReplicaServer]) -> None:
    vol = sheaf.Volume([s.location for s in servers], secret=SECRET)
    vol.write(0, b"volume says hi")
    vm = sheaf.Vm(
        "py-vol",
        memory_mib=64,
        kernel=sheaf.probe_guest_path(),
        cmdline="console=ttyS0 probe.need_disk=1",
    )
    vm.attach_volume(vol, "py-volume")
    vm.start()
    exit = vm.wait(timeout=60)
    assert exit is not None and exit.clean, (exit, vm.console())
    assert b"virtio: id py-volume" in vm.console()
    assert vol.read(512, 26) == b"PROBE-REPLY:volume says hi"
    vol.close()
