/* SPDX-License-Identifier: Apache-2.0 */
/*
 * sheaf_demo: a tour of the sheaf C API (docs/bindings-c.md).
 *
 *   1. a replicated volume over three in-process replica servers:
 *      create, open, write, flush, read back, wait for all replicas;
 *   2. a VM (the probe guest on /dev/kvm) with a raw disk file: configure,
 *      start, wait for its exit, read its serial console;
 *   3. a VM with the volume as its disk: start, pause, resume, stop;
 *      the guest's write is then read back through the volume;
 *   4. scheduler placement onto a synthetic three-node cluster;
 *   5. a cluster API (when a kubeconfig is given): create, list, get and
 *      delete a VirtualMachine.
 *
 * Build and run (scripts/test.d/bindings-c does this under valgrind):
 *   cargo build -p sheaf-capi
 *   gcc -Wall -Wextra -Werror -std=c11 -Ibindings/c/include \
 *       examples/c/sheaf_demo.c -Ltarget/debug -lsheaf \
 *       -Wl,-rpath,$PWD/target/debug -o /tmp/sheaf_demo
 *   /tmp/sheaf_demo WORKDIR [KUBECONFIG]
 *
 * Every call returns SHEAF_OK or a negative status; CHECK prints the
 * library's message and exits. Every handle and returned string is freed.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sheaf.h"

#define CHECK(call)                                                        \
    do {                                                                   \
        int rc_ = (call);                                                  \
        if (rc_ != SHEAF_OK) {                                             \
            fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__,        \
                    __LINE__, #call, sheaf_status_name(rc_),               \
                    sheaf_last_error() ? sheaf_last_error() : "?");        \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

#define EXPECT(cond)                                                       \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__,    \
                    #cond);                                                \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

static const char SECRET[] = "sheaf-demo-replication-secret";

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Tails the VM's console until `needle` appears (or ~30 s pass). */
static int console_wait_for(sheaf_vm *vm, const char *needle) {
    char seen[8192] = {0};
    size_t used = 0;
    uint64_t pos = 0;
    for (int i = 0; i < 3000; i++) {
        uint8_t buf[512];
        size_t n = 0;
        CHECK(sheaf_vm_console_read(vm, pos, buf, sizeof buf, &n, &pos));
        if (n > 0) {
            if (used + n >= sizeof seen) {
                /* keep the tail */
                memmove(seen, seen + used / 2, used - used / 2);
                used -= used / 2;
            }
            memcpy(seen + used, buf, n);
            used += n;
            seen[used] = '\0';
            if (strstr(seen, needle)) return 1;
        } else {
            sleep_ms(10);
        }
    }
    fprintf(stderr, "console never showed %s; got:\n%s\n", needle, seen);
    return 0;
}

static sheaf_volume *demo_volume(const char *work, sheaf_replica_server *servers[3]) {
    char *locs[3];
    for (int i = 0; i < 3; i++) {
        char dir[512];
        snprintf(dir, sizeof dir, "%s/replica%d", work, i);
        CHECK(sheaf_replica_server_start(dir, "127.0.0.1:0", (const uint8_t *)SECRET,
                                         strlen(SECRET), 4u << 20, &servers[i]));
        CHECK(sheaf_replica_server_location(servers[i], &locs[i]));
    }
    printf("volume: replicas %s %s %s\n", locs[0], locs[1], locs[2]);

    sheaf_volume_options opts = {0};
    opts.secret = (const uint8_t *)SECRET;
    opts.secret_len = strlen(SECRET);
    sheaf_volume *vol = NULL;
    CHECK(sheaf_volume_open((const char *const *)locs, 3, &opts, &vol));
    for (int i = 0; i < 3; i++) CHECK(sheaf_string_free(locs[i]));

    uint64_t size = 0;
    CHECK(sheaf_volume_size(vol, &size));
    EXPECT(size == 4u << 20);

    /* Sector 0 is what the probe guest reads; it answers in sector 1. */
    const char msg[] = "hello from C";
    CHECK(sheaf_volume_write(vol, 0, (const uint8_t *)msg, sizeof msg));
    CHECK(sheaf_volume_flush(vol));
    char back[sizeof msg] = {0};
    CHECK(sheaf_volume_read(vol, 0, (uint8_t *)back, sizeof back));
    EXPECT(memcmp(back, msg, sizeof msg) == 0);

    CHECK(sheaf_volume_wait_in_sync(vol, 20000));
    char *status = NULL;
    CHECK(sheaf_volume_status_json(vol, &status));
    printf("volume: %llu bytes, status %s\n", (unsigned long long)size, status);
    EXPECT(strstr(status, "\"active\":[0,1,2]") != NULL);
    CHECK(sheaf_string_free(status));
    return vol;
}

static void demo_vm_with_file(const char *work) {
    char disk[512];
    snprintf(disk, sizeof disk, "%s/disk.img", work);
    FILE *f = fopen(disk, "wb");
    EXPECT(f != NULL);
    char sector[1024] = "raw file disk";
    EXPECT(fwrite(sector, 1, sizeof sector, f) == sizeof sector);
    EXPECT(fclose(f) == 0);

    sheaf_vm *vm = NULL;
    CHECK(sheaf_vm_new("c-file-vm", &vm));
    CHECK(sheaf_vm_set_vcpus(vm, 1));
    CHECK(sheaf_vm_set_memory_mib(vm, 64));
    CHECK(sheaf_vm_set_kernel(vm, sheaf_probe_guest_path()));
    CHECK(sheaf_vm_set_cmdline(vm, "console=ttyS0 probe.token=c-demo probe.need_disk=1"));
    CHECK(sheaf_vm_set_cmdline_virtio_devices(vm, true));
    CHECK(sheaf_vm_add_disk(vm, disk, false));
    CHECK(sheaf_vm_start(vm));

    sheaf_exit ex;
    CHECK(sheaf_vm_wait(vm, 60000, &ex));
    printf("vm1: exit kind %u code %u clean %d\n", ex.kind, ex.code, (int)ex.clean);
    EXPECT(ex.kind == SHEAF_EXIT_DEBUG_EXIT && ex.code == 0 && ex.clean);

    uint32_t state = 0;
    CHECK(sheaf_vm_state(vm, &state));
    EXPECT(state == SHEAF_VM_STOPPED);
    /* Configuring a VM that already ran is a state error, not a crash. */
    EXPECT(sheaf_vm_set_vcpus(vm, 2) == SHEAF_ESTATE);

    char *console = NULL;
    CHECK(sheaf_vm_console(vm, &console));
    EXPECT(strstr(console, "token: c-demo") != NULL);
    EXPECT(strstr(console, "probe: PASS") != NULL);
    printf("vm1: console has %zu bytes, ends with \"probe: PASS\"\n", strlen(console));
    CHECK(sheaf_string_free(console));
    CHECK(sheaf_vm_free(vm));

    /* The guest wrote "PROBE-REPLY:" + sector 0's first bytes to sector 1. */
    f = fopen(disk, "rb");
    EXPECT(f != NULL);
    EXPECT(fread(sector, 1, sizeof sector, f) == sizeof sector);
    EXPECT(fclose(f) == 0);
    EXPECT(memcmp(sector + 512, "PROBE-REPLY:raw file disk", 25) == 0);
}

static void demo_vm_with_volume(sheaf_volume *vol) {
    sheaf_vm *vm = NULL;
    CHECK(sheaf_vm_new("c-volume-vm", &vm));
    CHECK(sheaf_vm_set_memory_mib(vm, 64));
    CHECK(sheaf_vm_set_kernel(vm, sheaf_probe_guest_path()));
    /* probe.halt=1: after its checks the guest idles until stopped. */
    CHECK(sheaf_vm_set_cmdline(vm, "console=ttyS0 probe.need_disk=1 probe.halt=1"));
    CHECK(sheaf_vm_set_cmdline_virtio_devices(vm, true));
    CHECK(sheaf_vm_attach_volume(vm, vol, "sheaf-c-volume"));
    CHECK(sheaf_vm_start(vm));
    EXPECT(console_wait_for(vm, "probe: PASS"));

    uint32_t state = 0;
    CHECK(sheaf_vm_pause(vm));
    CHECK(sheaf_vm_state(vm, &state));
    EXPECT(state == SHEAF_VM_PAUSED);
    CHECK(sheaf_vm_resume(vm));
    CHECK(sheaf_vm_state(vm, &state));
    EXPECT(state == SHEAF_VM_RUNNING);
    /* Still running: a short wait times out. */
    EXPECT(sheaf_vm_wait(vm, 50, NULL) == SHEAF_ETIMEDOUT);

    char *metrics = NULL;
    CHECK(sheaf_vm_metrics_json(vm, &metrics));
    printf("vm2: metrics %s\n", metrics);
    CHECK(sheaf_string_free(metrics));

    sheaf_exit ex;
    CHECK(sheaf_vm_stop(vm, &ex));
    EXPECT(ex.kind == SHEAF_EXIT_STOPPED);
    printf("vm2: paused, resumed, stopped\n");
    CHECK(sheaf_vm_free(vm));

    char reply[64] = {0};
    CHECK(sheaf_volume_read(vol, 512, (uint8_t *)reply, 24));
    printf("volume: sector 1 = \"%s\"\n", reply);
    EXPECT(strcmp(reply, "PROBE-REPLY:hello from C") == 0);
}

static void demo_sched(void) {
    sheaf_sched *s = NULL;
    CHECK(sheaf_sched_new(NULL, &s));
    const uint64_t gib = 1ull << 30;
    CHECK(sheaf_sched_add_node(s, "node-a", 4000, 8 * gib, "zone-1"));
    CHECK(sheaf_sched_add_node(s, "node-b", 8000, 16 * gib, "zone-2"));
    CHECK(sheaf_sched_add_node(s, "node-c", 2000, 4 * gib, "zone-1"));

    char *node = NULL;
    CHECK(sheaf_sched_place(s, "vm-1", 6000, 4 * gib, true, &node));
    printf("sched: vm-1 (6 CPUs) -> %s\n", node);
    EXPECT(strcmp(node, "node-b") == 0); /* the only node that fits */
    CHECK(sheaf_string_free(node));

    char *placement = NULL;
    CHECK(sheaf_sched_place_json(
        s, "{\"name\":\"vm-2\",\"resources\":{\"cpu_millis\":1000,\"memory_bytes\":1073741824}}",
        true, &placement));
    printf("sched: vm-2 -> %s\n", placement);
    CHECK(sheaf_string_free(placement));

    int rc = sheaf_sched_place(s, "too-big", 64000, gib, false, &node);
    EXPECT(rc == SHEAF_EUNSCHEDULABLE && node == NULL);
    printf("sched: too-big -> %s: %s\n", sheaf_status_name(rc), sheaf_last_error());

    char *nodes = NULL;
    CHECK(sheaf_sched_nodes_json(s, &nodes));
    EXPECT(strstr(nodes, "node-a") != NULL);
    CHECK(sheaf_string_free(nodes));
    CHECK(sheaf_sched_free(s));
}

static void demo_cluster(const char *kubeconfig) {
    sheaf_cluster *c = NULL;
    CHECK(sheaf_cluster_connect_kubeconfig(kubeconfig, NULL, &c));
    const char *manifest =
        "apiVersion: kubevirt.io/v1\n"
        "kind: VirtualMachine\n"
        "metadata:\n"
        "  name: c-demo-vm\n"
        "spec:\n"
        "  runStrategy: Halted\n"
        "  template:\n"
        "    spec:\n"
        "      domain:\n"
        "        cpu: {cores: 1}\n"
        "        resources: {requests: {memory: 64Mi}}\n"
        "        devices: {}\n";
    char *created = NULL;
    CHECK(sheaf_cluster_create_vm(c, "default", manifest, &created));
    CHECK(sheaf_string_free(created));

    size_t n = 0;
    CHECK(sheaf_cluster_count_vms(c, NULL, &n));
    char *list = NULL;
    CHECK(sheaf_cluster_list_vms(c, "default", &list));
    printf("cluster: %zu VM(s); list has c-demo-vm: %s\n", n,
           strstr(list, "\"c-demo-vm\"") ? "yes" : "no");
    EXPECT(n >= 1 && strstr(list, "\"c-demo-vm\"") != NULL);
    CHECK(sheaf_string_free(list));

    char *vm = NULL;
    CHECK(sheaf_cluster_get_vm(c, "default", "c-demo-vm", &vm));
    CHECK(sheaf_string_free(vm));
    CHECK(sheaf_cluster_delete_vm(c, "default", "c-demo-vm"));
    EXPECT(sheaf_cluster_get_vm(c, "default", "no-such-vm", &vm) == SHEAF_ENOENT);
    CHECK(sheaf_cluster_free(c));
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s WORKDIR [KUBECONFIG]\n", argv[0]);
        return 2;
    }
    if (sheaf_abi_version() != SHEAF_ABI_VERSION) {
        fprintf(stderr, "libsheaf ABI %u, header %d\n", sheaf_abi_version(), SHEAF_ABI_VERSION);
        return 1;
    }
    printf("sheaf %s (ABI %u)\n", sheaf_version(), sheaf_abi_version());

    sheaf_replica_server *servers[3] = {0};
    sheaf_volume *vol = demo_volume(argv[1], servers);
    demo_vm_with_file(argv[1]);
    demo_vm_with_volume(vol);
    CHECK(sheaf_volume_close(vol));
    for (int i = 0; i < 3; i++) CHECK(sheaf_replica_server_stop(servers[i]));
    demo_sched();
    if (argc > 2) {
        demo_cluster(argv[2]);
    } else {
        printf("cluster: skipped (no kubeconfig given)\n");
    }
    /* Every handle and string was released (valgrind checks the library's
     * own memory; this checks ours). */
    EXPECT(sheaf_live_objects() == 0);
    printf("sheaf_demo: OK\n");
    return 0;
}
