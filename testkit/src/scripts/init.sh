#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# /init of sheaf-testkit images: mount the pseudo file systems, load the
# modules listed in /etc/sheaf/modules in that order, run /etc/sheaf/main,
# then power off. With `sheaf.exit=reboot` on the kernel command line it
# reboots instead (for a VMM with a reset device but no ACPI power-off).
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
for m in $(cat /etc/sheaf/modules); do
    insmod "/lib/modules/sheaf/$m.ko" 2>/tmp/insmod.err ||
        echo "sheaf-init: insmod $m: $(cat /tmp/insmod.err)"
done
[ -f /etc/sheaf/main ] && sh /etc/sheaf/main
sync
case " $(cat /proc/cmdline) " in
*" sheaf.exit=reboot "*) reboot -f ;;
*) poweroff -f ;;
esac
while :; do sleep 60; done
