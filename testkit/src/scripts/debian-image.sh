#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Builds a bootable Debian cloud disk from Debian packages only (run by
# sheaf_testkit::debian, which sets the variables and caches the result):
#
#   mmdebstrap (apt) ─► root tree ─► GPT + ext4 root (sfdisk, mkfs.ext4 -d)
#                                 ─► disk.raw (sparse) and disk.qcow2
#
# Inputs (environment): OUT (empty directory to fill), SUITE, MIRROR,
# PACKAGES (comma-separated), SIZE_MIB, ROOT_UUID, HOSTNAME_.
# Outputs in OUT: disk.raw, disk.qcow2, manifest (key=value), packages.txt,
# build.log.
set -euo pipefail

: "${OUT:?}" "${SUITE:?}" "${MIRROR:?}" "${PACKAGES:?}" "${SIZE_MIB:?}" "${ROOT_UUID:?}"
HOSTNAME_=${HOSTNAME_:-debian}
log() { printf '[debian-image] %s\n' "$*" >&2; }

for tool in mmdebstrap sfdisk mkfs.ext4 qemu-img; do
  command -v "$tool" >/dev/null || { echo "missing tool: $tool (run scripts/setup)" >&2; exit 2; }
done

root="$OUT/rootfs"
mkdir -p "$root"
start=$(date +%s)

# Settings the kernel's postinst must see when it builds the initramfs:
# MODULES=most carries virtio_mmio, virtio_blk, virtio_net and ext4; they
# are also listed so they are loaded early whatever the hardware probe says.
essential_hook='
set -e
mkdir -p "$1/etc/initramfs-tools/conf.d"
printf "MODULES=most\nCOMPRESS=zstd\n" > "$1/etc/initramfs-tools/conf.d/sheaf.conf"
mkdir -p "$1/etc/initramfs-tools"
printf "virtio_mmio\nvirtio_blk\nvirtio_net\next4\n" >> "$1/etc/initramfs-tools/modules"
printf "do_symlinks = yes\nlink_in_boot = yes\n" > "$1/etc/kernel-img.conf"
'

customize_hook='
set -e
r="$1"
printf "UUID=%s / ext4 errors=remount-ro 0 1\n" "$ROOT_UUID" > "$r/etc/fstab"
printf "%s\n" "$HOSTNAME_" > "$r/etc/hostname"
printf "127.0.0.1 localhost\n127.0.1.1 %s\n::1 localhost ip6-localhost ip6-loopback\n" "$HOSTNAME_" > "$r/etc/hosts"
# cloud-init: only the local NoCloud seed (a cidata disk), no network probing.
mkdir -p "$r/etc/cloud/cloud.cfg.d"
printf "datasource_list: [ NoCloud, None ]\n" > "$r/etc/cloud/cloud.cfg.d/90-sheaf-datasource.cfg"
# Loopback; cloud-init renders the rest from its network config.
mkdir -p "$r/etc/network/interfaces.d"
printf "auto lo\niface lo inet loopback\nsource /etc/network/interfaces.d/*\n" > "$r/etc/network/interfaces"
# First boot makes its own identity: machine id, SSH host keys (cloud-init).
: > "$r/etc/machine-id"
rm -f "$r/var/lib/dbus/machine-id" "$r"/etc/ssh/ssh_host_*
# Root has no password; access is by the SSH key cloud-init installs.
chroot "$r" passwd -l root >/dev/null
chroot "$r" dpkg-query -W -f="\${Package} \${Version}\n" > "$OUT/packages.txt"
rm -rf "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/*.bin "$r"/var/cache/apt/archives/*.deb "$r"/var/log/*.log
'

log "mmdebstrap $SUITE from $MIRROR"
export ROOT_UUID HOSTNAME_ OUT
mmdebstrap --variant=minbase \
  --include="$PACKAGES" \
  --aptopt='Acquire::Retries "3"' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-include=/usr/share/locale/locale.alias' \
  --essential-hook="$essential_hook" \
  --customize-hook="$customize_hook" \
  "$SUITE" "$root" "$MIRROR" >&2
debootstrapped=$(date +%s)

kver=$(basename "$(readlink -f "$root/boot/vmlinuz")")
kver=${kver#vmlinuz-}
[[ -f $root/boot/initrd.img-$kver ]] || { echo "no initramfs for $kver" >&2; exit 3; }
used_kib=$(du -sk "$root" | cut -f1)

# GPT: one Linux x86-64 root partition from 1 MiB to the end.
raw="$OUT/disk.raw"
size=$((SIZE_MIB * 1024 * 1024))
truncate -s "$size" "$raw"
printf 'label: gpt\nstart=2048, type=4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709, name=root\n' |
  sfdisk -q "$raw"
part_start=$(sfdisk -J "$raw" | python3 -c 'import json,sys; print(json.load(sys.stdin)["partitiontable"]["partitions"][0]["start"])')
part_sectors=$(sfdisk -J "$raw" | python3 -c 'import json,sys; print(json.load(sys.stdin)["partitiontable"]["partitions"][0]["size"])')
log "ext4 root: $((part_sectors / 2048)) MiB at sector $part_start, $((used_kib / 1024)) MiB of files"
mkfs.ext4 -q -F -L root -U "$ROOT_UUID" -E "offset=$((part_start * 512))" \
  -d "$root" "$raw" "$((part_sectors / 2))k" >&2
rm -rf "$root"

qemu-img convert -f raw -O qcow2 "$raw" "$OUT/disk.qcow2" >&2
end=$(date +%s)

cat > "$OUT/manifest" <<EOF
suite=$SUITE
kernel=$kver
root_uuid=$ROOT_UUID
size_mib=$SIZE_MIB
files_mib=$((used_kib / 1024))
raw_allocated_mib=$(( $(du -k "$raw" | cut -f1) / 1024 ))
qcow2_mib=$(( $(du -k "$OUT/disk.qcow2" | cut -f1) / 1024 ))
packages=$(wc -l < "$OUT/packages.txt")
mmdebstrap_seconds=$((debootstrapped - start))
build_seconds=$((end - start))
EOF
log "done in $((end - start)) s"
