# SPDX-License-Identifier: Apache-2.0
"""Exception classes of sheaf.

Every error raised by sheaf is a :class:`SheafError`; the subclass says what
kind of failure it is, and where a built-in exception means the same thing
the class derives from it too (``InvalidArgumentError`` is a ``ValueError``,
``NotFoundError`` a ``LookupError``...), so ordinary ``except`` clauses work.
The native module raises these (see bindings/python/src/errors.rs).
"""

from __future__ import annotations

import builtins
from typing import Optional

__all__ = [
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


class SheafError(Exception):
    """Base class of every sheaf error.

    ``kind`` is the stable error kind (``"invalid_argument"``, ``"vmm"``,
    ...); ``status`` the HTTP status for errors answered by an API server.
    """

    def __init__(self, message: str, *, kind: str = "unknown", status: Optional[int] = None):
        super().__init__(message)
        self.kind = kind
        self.status = status


class InvalidArgumentError(SheafError, ValueError):
    """A value passed to sheaf is unusable (range, format, JSON...)."""


class StateError(SheafError):
    """The object is in the wrong state (e.g. configuring a running VM)."""


class HostIOError(SheafError, OSError):
    """A host I/O operation failed."""


class TimeoutError(SheafError, builtins.TimeoutError):
    """An operation did not finish in time."""


class NotFoundError(SheafError, LookupError):
    """The named object (file, VM, node) does not exist."""


class PermissionDeniedError(SheafError, PermissionError):
    """Credentials were refused (HTTP 401/403) or access was denied."""


class VmmError(SheafError):
    """The VMM failed (KVM, guest image, devices)."""


class VolumeError(SheafError):
    """The replicated volume failed (quorum, fencing, replicas)."""


class SchedError(SheafError):
    """A scheduler failure."""


class UnschedulableError(SchedError):
    """No node can take the request; the message says why per node."""


class ClusterError(SheafError):
    """The API server failed or answered with an error status."""
