# SPDX-License-Identifier: Apache-2.0
# /etc/sheaf/main of the nested-KVM box (the L1 guest). Inputs arrive as a tar
# on /dev/vda, outputs leave as a tar on /dev/vdb; every marker carries the
# nonce from the kernel command line so program output cannot fake one.
. /etc/sheaf/lib.sh
nonce=$(sed -n 's/.*sheaf\.nonce=\([A-Za-z0-9]*\).*/\1/p' /proc/cmdline)
P="SHEAF-BOX-$nonce:"
fail() { echo "$P FAIL $*"; exit 1; }
echo "$P INIT uptime=$(sheaf_uptime)"
sheaf_wait_block /dev/vda 100 || fail "no input disk /dev/vda"
sheaf_wait_block /dev/vdb 100 || fail "no output disk /dev/vdb"
n=50
while [ ! -c /dev/kvm ] && [ $n -gt 0 ]; do n=$((n - 1)); usleep 100000; done
if [ -c /dev/kvm ]; then
    echo "$P KVM uptime=$(sheaf_uptime)"
elif grep -q 'sheaf.kvm=required' /proc/cmdline; then
    fail "no /dev/kvm: $(dmesg | grep -i -E 'kvm|svm' | tail -n 3 | tr '\n' ' ')"
fi
mkdir -p /box && cd /box || fail "cannot create /box"
tar -xf /dev/vda || fail "cannot unpack inputs from /dev/vda"
mkdir -p /box/out /box/.sheaf-out
echo "$P RUN uptime=$(sheaf_uptime)"
{ sh /box/.sheaf/run.sh </dev/null; echo $? >/box/.sheaf-out/status; } 2>&1 | tee /box/.sheaf-out/output
rc=$(cat /box/.sheaf-out/status 2>/dev/null || echo 255)
echo "$P END status=$rc uptime=$(sheaf_uptime)"
cd /box || fail "lost /box"
set -- .sheaf-out out
for f in $(cat /box/.sheaf/collect 2>/dev/null); do
    [ -e "$f" ] && set -- "$@" "$f"
done
tar -cf /dev/vdb "$@" ||
    fail "cannot pack outputs to /dev/vdb (too big? raise NestedBox::output_capacity_mib)"
sync
echo "$P FILES-OUT uptime=$(sheaf_uptime)"
