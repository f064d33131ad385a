# SPDX-License-Identifier: Apache-2.0
"""The official Kubernetes Python client against sheaf's API server.

Usage: list_watch.py KUBECONFIG. Lists VMs, creates/patches/deletes one while
watching, checks 410 on a compacted resourceVersion is surfaced, and that the
read-only context is refused writes. Prints one line per check; "OK" at the end.
"""
import sys
import threading
import time

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

G, V, P = "kubevirt.io", "v1", "virtualmachines"


def vm(name):
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "labels": {"app": "py"}},
        "spec": {
            "runStrategy": "Always",
            "template": {"spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}}}},
        },
    }


def main(kubeconfig):
    api = client.CustomObjectsApi(config.new_client_from_config(config_file=kubeconfig))
    listed = api.list_namespaced_custom_object(G, V, "default", P, label_selector="app=py")
    for item in listed["items"]:
        print("listed", item["metadata"]["name"])
    rv = listed["metadata"]["resourceVersion"]

    events = []
    w = watch.Watch()

    def run_watch():
        for ev in w.stream(api.list_namespaced_custom_object, G, V, "default", P,
                           resource_version=rv, timeout_seconds=15):
            obj = ev["object"]
            events.append((ev["type"], obj["metadata"]["name"], obj["spec"].get("runStrategy")))
            if ev["type"] == "DELETED":
                w.stop()

    t = threading.Thread(target=run_watch)
    t.start()
    time.sleep(0.5)
    api.create_namespaced_custom_object(G, V, "default", P, vm("py-2"))
    api.patch_namespaced_custom_object(G, V, "default", P, "py-2", {"spec": {"runStrategy": "Halted"}})
    api.delete_namespaced_custom_object(G, V, "default", P, "py-2")
    t.join(20)
    for e in events:
        print(e[0], e[1], e[2] or "")

    print("gone 410" if check_gone(api) else "gone missing")

    ro = client.CustomObjectsApi(config.new_client_from_config(config_file=kubeconfig, context="sheaf-readonly"))
    ro.list_namespaced_custom_object(G, V, "default", P)
    try:
        ro.create_namespaced_custom_object(G, V, "default", P, vm("py-3"))
        print("readonly write allowed")
    except ApiException as e:
        print("readonly", e.status)
    print("OK")


def check_gone(api):
    """A watch from a compacted version ends with ApiException(410)."""
    try:
        for _ in watch.Watch().stream(api.list_namespaced_custom_object, G, V, "default", P,
                                      resource_version="1", timeout_seconds=3):
            pass
    except ApiException as e:
        return e.status == 410
    return False


if __name__ == "__main__":
    main(sys.argv[1])
