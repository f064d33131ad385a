# SPDX-License-Identifier: Apache-2.0
# Helpers for scripts inside sheaf-testkit images: `. /etc/sheaf/lib.sh`

# sheaf_wait_block DEV [TENTHS]: wait until DEV is a block device
# (default 100 tenths of a second); fail if it never appears.
sheaf_wait_block() {
    _n=${2:-100}
    while [ ! -b "$1" ]; do
        [ "$_n" -le 0 ] && return 1
        _n=$((_n - 1))
        usleep 100000
    done
}

# sheaf_uptime: seconds since the guest kernel started.
sheaf_uptime() {
    cut -d' ' -f1 /proc/uptime
}
