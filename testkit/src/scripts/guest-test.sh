# SPDX-License-Identifier: Apache-2.0
# The default test of the sheaf guest image (/etc/sheaf/test.sh). The host
# wrote "SHEAF-MARKER:<text>\n" at offset 0 of the first virtio disk; reply
# with "SHEAF-REPLY:<text>\n" at offset 4096, sync, and report on the console.
. /etc/sheaf/lib.sh
dev=/dev/vda
sheaf_wait_block $dev 100 || { echo "SHEAF-GUEST: FAIL no $dev"; exit 1; }
line=$(dd if=$dev bs=512 count=1 2>/dev/null | head -n 1 | tr -d '\000')
case "$line" in
SHEAF-MARKER:*) marker=${line#SHEAF-MARKER:} ;;
*) echo "SHEAF-GUEST: FAIL no marker at offset 0 of $dev"; exit 1 ;;
esac
echo "SHEAF-GUEST: marker=$marker"
printf 'SHEAF-REPLY:%s\n' "$marker" | dd of=$dev bs=512 seek=8 2>/dev/null ||
    { echo "SHEAF-GUEST: FAIL write reply to $dev"; exit 1; }
sync
echo "SHEAF-GUEST: OK"
