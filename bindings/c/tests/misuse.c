/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Handle and argument misuse through the real C ABI: every call must return
 * an error code with a message, never crash. Run by
 * scripts/test.d/bindings-c under valgrind (which also catches any invalid
 * read or write the library might make while rejecting the call).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sheaf.h"

static int failures = 0;

#define EXPECT_RC(call, want)                                                  \
    do {                                                                       \
        int rc_ = (call);                                                      \
        const char *msg_ = sheaf_last_error();                                 \
        if (rc_ != (want) || (rc_ != SHEAF_OK && (msg_ == NULL || !*msg_))) {  \
            fprintf(stderr, "FAIL %s: got %s (%s), want %s\n", #call,          \
                    sheaf_status_name(rc_), msg_ ? msg_ : "no message",        \
                    sheaf_status_name(want));                                  \
            failures++;                                                        \
        } else {                                                               \
            printf("ok   %-60s -> %s\n", #call, sheaf_status_name(rc_));       \
        }                                                                      \
    } while (0)

int main(void) {
    /* NULL handles of every type. */
    EXPECT_RC(sheaf_vm_start(NULL), SHEAF_EBADF);
    EXPECT_RC(sheaf_vm_free(NULL), SHEAF_EBADF);
    EXPECT_RC(sheaf_volume_flush(NULL), SHEAF_EBADF);
    EXPECT_RC(sheaf_volume_close(NULL), SHEAF_EBADF);
    EXPECT_RC(sheaf_sched_free(NULL), SHEAF_EBADF);
    EXPECT_RC(sheaf_cluster_free(NULL), SHEAF_EBADF);
    EXPECT_RC(sheaf_replica_server_stop(NULL), SHEAF_EBADF);

    /* Double free and use after free. */
    sheaf_vm *vm = NULL;
    EXPECT_RC(sheaf_vm_new("misuse", &vm), SHEAF_OK);
    EXPECT_RC(sheaf_vm_free(vm), SHEAF_OK);
    EXPECT_RC(sheaf_vm_free(vm), SHEAF_EBADF);
    EXPECT_RC(sheaf_vm_set_vcpus(vm, 1), SHEAF_EBADF);

    /* A handle of another type, and a made-up pointer. */
    sheaf_sched *s = NULL;
    EXPECT_RC(sheaf_sched_new(NULL, &s), SHEAF_OK);
    EXPECT_RC(sheaf_vm_start((sheaf_vm *)s), SHEAF_EBADF);
    EXPECT_RC(sheaf_volume_flush((sheaf_volume *)s), SHEAF_EBADF);
    int on_stack = 0;
    EXPECT_RC(sheaf_sched_free((sheaf_sched *)&on_stack), SHEAF_EBADF);

    /* NULL and bad arguments. */
    EXPECT_RC(sheaf_vm_new(NULL, NULL), SHEAF_EINVAL);
    EXPECT_RC(sheaf_sched_add_node(s, NULL, 1000, 1 << 30, NULL), SHEAF_EINVAL);
    EXPECT_RC(sheaf_sched_add_node_json(s, "{not json"), SHEAF_EINVAL);
    EXPECT_RC(sheaf_sched_add_node(s, "\xff\xfe", 1000, 1 << 30, NULL), SHEAF_EINVAL);
    char *out = NULL;
    EXPECT_RC(sheaf_sched_place(s, "vm", 1000, 1 << 20, false, &out), SHEAF_EUNSCHEDULABLE);
    EXPECT_RC(sheaf_sched_free(s), SHEAF_OK);
    EXPECT_RC(sheaf_sched_free(s), SHEAF_EBADF);
    sheaf_volume *vol = NULL;
    EXPECT_RC(sheaf_volume_open(NULL, 0, NULL, &vol), SHEAF_EINVAL);
    EXPECT_RC(sheaf_volume_open_local("/nonexistent/sheaf-volume", &vol), SHEAF_EVOLUME);
    EXPECT_RC(sheaf_volume_create("/tmp/sheaf-misuse-vol", 4097), SHEAF_EINVAL);

    /* Strings: freeing one twice, or one sheaf did not return. */
    sheaf_vm *vm2 = NULL;
    EXPECT_RC(sheaf_vm_new("json", &vm2), SHEAF_OK);
    EXPECT_RC(sheaf_vm_config_json(vm2, &out), SHEAF_OK);
    EXPECT_RC(sheaf_string_free(out), SHEAF_OK);
    EXPECT_RC(sheaf_string_free(out), SHEAF_EINVAL);
    char mine[] = "not sheaf's";
    EXPECT_RC(sheaf_string_free(mine), SHEAF_EINVAL);
    EXPECT_RC(sheaf_string_free(NULL), SHEAF_OK);

    /* Wrong states. */
    EXPECT_RC(sheaf_vm_pause(vm2), SHEAF_ESTATE);
    EXPECT_RC(sheaf_vm_set_vcpus(vm2, 0), SHEAF_EINVAL);
    EXPECT_RC(sheaf_vm_start(vm2), SHEAF_EINVAL); /* no kernel configured */
    EXPECT_RC(sheaf_vm_free(vm2), SHEAF_OK);

    /* A panic inside the library comes back as an error code. */
    EXPECT_RC(sheaf_selftest_panic(), SHEAF_EPANIC);
    if (!strstr(sheaf_last_error(), "panic")) {
        fprintf(stderr, "FAIL: panic message: %s\n", sheaf_last_error());
        failures++;
    }
    sheaf_clear_error();
    if (sheaf_last_error() != NULL || sheaf_last_error_code() != SHEAF_OK) {
        fprintf(stderr, "FAIL: sheaf_clear_error\n");
        failures++;
    }
    if (strcmp(sheaf_status_name(12345), "SHEAF_UNKNOWN") != 0) failures++;

    if (sheaf_live_objects() != 0) {
        fprintf(stderr, "FAIL: %zu live objects left\n", sheaf_live_objects());
        failures++;
    }
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "misuse: OK", failures);
    return failures ? 1 : 0;
}
