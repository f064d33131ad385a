# SPDX-License-Identifier: Apache-2.0
# /etc/sheaf/main of the sheaf guest image: run the test script and report.
. /etc/sheaf/lib.sh
echo "SHEAF-GUEST: init uptime=$(sheaf_uptime) kernel=$(uname -r)"
sh /etc/sheaf/test.sh
echo "SHEAF-GUEST: script-exit=$? uptime=$(sheaf_uptime)"
