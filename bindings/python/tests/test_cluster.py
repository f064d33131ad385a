# SPDX-License-Identifier: Apache-2.0
"""The cluster client against a running sheaf API server."""

from __future__ import annotations

import pathlib

import pytest

import sheaf

MANIFEST = {
    "apiVersion": "kubevirt.io/v1",
    "kind": "VirtualMachine",
    "metadata": {"name": "py-vm", "labels": {"app": "py"}},
    "spec": {
        "runStrategy": "Halted",
        "template": {
            "spec": {
                "domain": {
                    "cpu": {"cores": 1},
                    "resources": {"requests": {"memory": "64Mi"}},
                    "devices": {},
                }
            }
        },
    },
}


def test_list_vms_from_running_cluster(apiserver: pathlib.Path) -> None:
    c = sheaf.Cluster.from_kubeconfig(apiserver)
    assert c.server.startswith("https://127.0.0.1:")
    assert c.namespace == "default"
    assert "gitVersion" in c.version()
    created = c.create_vm(MANIFEST)
    assert created["metadata"]["name"] == "py-vm"
    yaml = (
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata: {name: py-vm-yaml}\n"
        "spec: {runStrategy: Halted, template: {spec: {domain: {devices: {}MEM}}}}\n"
    )
    # The server validates: no memory request is a 422 with its message.
    with pytest.raises(sheaf.ClusterError) as e:
        c.create_vm(yaml.replace("MEM", ""))
    assert e.value.status == 422 and "resources.requests.memory" in str(e.value)
    c.create_vm(yaml.replace("MEM", ", resources: {requests: {memory: 64Mi}}"))
    names = {vm["metadata"]["name"] for vm in c.list_vms()}
    assert {"py-vm", "py-vm-yaml"} <= names, names
    assert c.get_vm("py-vm")["metadata"]["labels"] == {"app": "py"}
    status, body = c.request("GET", "/apis/kubevirt.io/v1/namespaces/default/virtualmachines")
    assert status == 200 and b"py-vm" in body
    c.delete_vm("py-vm")
    c.delete_vm("py-vm-yaml")
    with pytest.raises(sheaf.NotFoundError) as e:
        c.get_vm("py-vm")
    assert e.value.status == 404 and isinstance(e.value, LookupError)


def test_bad_token_is_refused(apiserver: pathlib.Path) -> None:
    good = sheaf.Cluster.from_kubeconfig(apiserver)
    ca = (apiserver.parent / "pki" / "ca.crt").read_text()
    bad = sheaf.Cluster(good.server, token="not-a-token", ca_pem=ca)
    with pytest.raises(sheaf.PermissionDeniedError) as e:
        bad.list_vms()
    assert e.value.status == 401
