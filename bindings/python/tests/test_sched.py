# SPDX-License-Identifier: Apache-2.0
"""Placement onto a synthetic cluster."""

from __future__ import annotations

import pytest

import sheaf

GIB = 1 << 30


def synthetic(n: int) -> sheaf.Scheduler:
    s = sheaf.Scheduler()
    for i in range(n):
        s.add_node(f"node-{i}", 4000, 16 * GIB, zone=f"zone-{i % 3}")
    return s


def test_schedule_onto_synthetic_cluster() -> None:
    s = synthetic(10)
    assert len(s) == 10
    placed = {s.place(f"vm-{i}", 1000, 2 * GIB) for i in range(40)}
    # 40 one-core VMs fill 10 four-core nodes exactly.
    assert len(placed) == 10
    usage = {n["name"]: n for n in s.nodes()}
    assert all(u["requested_cpu_millis"] == 4000 for u in usage.values()), usage
    with pytest.raises(sheaf.UnschedulableError) as e:
        s.place("one-too-many", 1000, GIB)
    assert isinstance(e.value, sheaf.SchedError)
    assert "Insufficient cpu" in str(e.value)
    s.unbind("vm-0")
    assert s.node_of("vm-0") is None
    assert s.place("fits-again", 1000, GIB) in placed


def test_place_request_and_cordon() -> None:
    s = synthetic(3)
    s.set_unschedulable("node-0", True)
    p = s.place_request(
        {"name": "r1", "resources": {"cpu_millis": 500, "memory_bytes": GIB}}, bind=False
    )
    assert p["node"] in ("node-1", "node-2") and p["feasible_nodes"] == 2, p
    with pytest.raises(sheaf.InvalidArgumentError):
        s.place_request("{not json")
    with pytest.raises(sheaf.NotFoundError):
        s.set_unschedulable("nope", True)
