# SPDX-License-Identifier: Apache-2.0
"""sheaf: VMs on KVM, replicated volumes, placement and a cluster client.

A thin, typed Python layer over the native module ``sheaf._sheaf`` (PyO3),
which wraps the same Rust crates as sheaf's C API. Blocking calls release
the GIL; :meth:`Vm.wait_async` waits from asyncio. See docs/bindings-python.md.

>>> import sheaf
>>> with sheaf.Vm("demo", memory_mib=64, kernel=sheaf.probe_guest_path(),
...               cmdline="console=ttyS0 probe.token=hi") as vm:  # doctest: +SKIP
...     vm.start()
...     print(vm.wait(timeout=30), vm.console().decode())
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Optional, Union

from . import _sheaf
from ._errors import (
    ClusterError,
    HostIOError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    SchedError,
    SheafError,
    StateError,
    TimeoutError,
    UnschedulableError,
    VmmError,
    VolumeError,
)
from ._sheaf import Cluster, Exit, ReplicaServer, Scheduler, create_replica, probe_guest_path

__version__: str = _sheaf.__version__

__all__ = [
    "Vm",
    "Exit",
    "Volume",
    "ReplicaServer",
    "Scheduler",
    "Cluster",
    "create_replica",
    "probe_guest_path",
    "SheafError",
    "InvalidArgumentError",
    "StateError",
    "HostIOError",
    "TimeoutError",
    "NotFoundError",
    "PermissionDeniedError",
    "VmmError",
    "VolumeError",
    "SchedError",
    "UnschedulableError",
    "ClusterError",
]


class Vm(_sheaf.Vm):
    """A virtual machine (sheaf-vmm on KVM).

    Configure it through the constructor or the ``set_*`` methods, attach
    disks, then :meth:`start`. As a context manager it stops the VM on exit.
    """

    @classmethod
    def from_config(cls, config: Union[str, dict[str, Any]]) -> "Vm":
        """A VM from a complete ``VmConfig`` (dict or JSON; docs/vmm.md)."""
        return cls(config=config)

    async def wait_async(self, timeout: Optional[float] = None) -> Optional[Exit]:
        """Awaitable :meth:`wait`: blocks a worker thread (the GIL is
        released), never the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.wait, timeout)

    async def wait_for_console(self, needle: bytes, timeout: float = 30.0) -> bytes:
        """Polls the console until ``needle`` appears; returns the output
        read so far. Raises :class:`TimeoutError` after ``timeout`` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        seen = b""
        pos = 0
        while True:
            data, pos = self.console_read(pos)
            seen += data
            if needle in seen:
                return seen
            if loop.time() >= deadline:
                raise TimeoutError(
                    f"console did not show {needle!r} within {timeout} s", kind="timeout"
                )
            await asyncio.sleep(0.01)


class Volume(_sheaf.Volume):
    """A replicated volume with byte-granular, blocking I/O.

    ``Volume([dir_or_tcp_url, ...], secret=b"...")`` attaches over local
    replica stores or replica servers; ``Volume.local(path, size)`` makes a
    single-replica volume. As a context manager it flushes and closes.
    """

    @classmethod
    def local(cls, path: Union[str, "os.PathLike[str]"], size_bytes: Optional[int] = None) -> "Volume":
        """A single-replica volume in directory ``path``, created with
        ``size_bytes`` first if it holds no replica store."""
        p = os.fspath(path)
        if size_bytes is not None and not os.path.exists(os.path.join(p, "superblock")):
            create_replica(p, size_bytes)
        return cls([p])

    async def read_async(self, offset: int, length: int) -> bytes:
        """Awaitable :meth:`read` (runs in a worker thread)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.read, offset, length)

    async def write_async(self, offset: int, data: bytes) -> None:
        """Awaitable :meth:`write` (runs in a worker thread)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.write, offset, data)
