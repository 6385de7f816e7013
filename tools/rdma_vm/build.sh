#!/usr/bin/env bash
# Builds the Soft-RoCE test guest once, from Debian packages, and caches it:
#   $SMARTGEN_RDMA_VM_DIR (default ~/.cache/smartgen/rdma-vm)/{vmlinuz,rootfs.cpio}
# The guest is Debian bookworm's kernel plus a minimal userland with rdma-core, python3-pyverbs and pytest;
# its /init brings up rxe0 (rdma_rxe over a dummy netdev), mounts the project over virtio-9p and runs a
# command. Needs root and apt (host packages qemu-system-x86, mmdebstrap, cpio). About 3 minutes, ~240 MB.
set -euo pipefail
OUT=${SMARTGEN_RDMA_VM_DIR:-$HOME/.cache/smartgen/rdma-vm}
HERE=$(cd "$(dirname "$0")" && pwd)
if [ -f "$OUT/vmlinuz" ] && [ -f "$OUT/rootfs.cpio" ] && [ "$OUT/rootfs.cpio" -nt "$HERE/init.sh" ]; then
  echo "rdma-vm: cached in $OUT"; exit 0
fi
if [ "$(id -u)" != 0 ]; then echo "rdma-vm: building the guest needs root (apt, mmdebstrap, chroot)" >&2; exit 2; fi
missing=""
for tool in qemu-system-x86_64:qemu-system-x86 mmdebstrap:mmdebstrap cpio:cpio; do
  command -v "${tool%%:*}" >/dev/null || missing="$missing ${tool##*:}"
done
if [ -n "$missing" ]; then
  echo "rdma-vm: installing$missing"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
echo "rdma-vm: kernel package $kpkg"
(cd "$work" && apt-get download -qq "$kpkg" 2>/dev/null)
dpkg-deb -x "$work"/"$kpkg"_*.deb "$work/kernel"
kver=${kpkg#linux-image-}

echo "rdma-vm: building the userland (mmdebstrap)"
mmdebstrap --quiet --variant=minbase \
  --include=kmod,iproute2,rdma-core,ibverbs-providers,ibverbs-utils,python3-pyverbs,python3-pytest,python3-pytest-asyncio,python3-msgpack,procps \
  bookworm "$work/root"

# Only the modules the guest needs (and what they depend on), resolved with modprobe in the new root.
mkdir -p "$work/root/lib/modules"
cp -a "$work/kernel/lib/modules/$kver" "$work/root/lib/modules/"
chroot "$work/root" depmod "$kver"
needed=$(chroot "$work/root" sh -c "for m in rdma_rxe ib_uverbs rdma_ucm dummy 9pnet_virtio 9p virtio_pci crc32_generic crc32_pclmul; do modprobe -S $kver --show-depends \$m 2>/dev/null; done" | awk '/^insmod/{print $2}' | sort -u)
keep="$work/keep"; mkdir -p "$keep"
for f in $needed; do mkdir -p "$keep$(dirname "$f")"; cp "$work/root$f" "$keep$f"; done
rm -rf "$work/root/lib/modules/$kver/kernel"
cp -a "$keep/lib/modules/$kver/kernel" "$work/root/lib/modules/$kver/"
chroot "$work/root" depmod "$kver"
rm -rf "$work/root/usr/share/doc" "$work/root/usr/share/man" "$work/root/usr/share/locale" "$work/root/var/cache/apt"
echo "127.0.0.1 localhost" > "$work/root/etc/hosts"
install -m 0755 "$HERE/init.sh" "$work/root/init"

mkdir -p "$OUT"
(cd "$work/root" && find . -print0 | cpio --null -o -H newc --quiet) > "$OUT/rootfs.cpio.tmp"
mv "$OUT/rootfs.cpio.tmp" "$OUT/rootfs.cpio"
cp "$work/kernel/boot/vmlinuz-$kver" "$OUT/vmlinuz"
echo "rdma-vm: built $(du -sh "$OUT" | cut -f1) in $OUT (modules: $(echo "$needed" | wc -w))"
