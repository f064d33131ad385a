# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures of the sheaf Python tests (run by
scripts/test.d/bindings-python)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import time
from typing import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.access("/dev/kvm", os.R_OK | os.W_OK):
        return
    skip = pytest.mark.skip(reason="needs /dev/kvm")
    for item in items:
        if "kvm" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kvm: boots a guest on /dev/kvm")


@pytest.fixture(scope="session")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pathlib.Path]:
    """A running sheaf API server (the orchestrator's `apiserver` example,
    in-memory store); yields its admin kubeconfig."""
    binary = os.environ.get(
        "SHEAF_APISERVER_BIN", str(ROOT / "target" / "debug" / "examples" / "apiserver")
    )
    if not os.path.exists(binary):
        pytest.fail(
            f"{binary} is missing: cargo build -p sheaf-orchestrator --example apiserver"
        )
    data = tmp_path_factory.mktemp("api")
    log = open(data / "api.log", "w+b")
    proc = subprocess.Popen([binary, str(data), "127.0.0.1:0", "--memory"], stdout=log, stderr=log)
    kubeconfig = data / "admin.kubeconfig"
    try:
        deadline = time.monotonic() + 30
        while b"kubeconfig:" not in (data / "api.log").read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("API server did not start:\n" + (data / "api.log").read_text())
            time.sleep(0.05)
        yield kubeconfig
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
