#!/usr/bin/env bash
# Builds the Soft-RoCE test guest once, from Debian packages, and caches it:
#   $SMARTGEN_RDMA_VM_DIR (default ~/.cache/smartgen/rdma-vm)/{vmlinuz,rootfs.cpio,stamp}
# The guest is Debian bookworm's kernel plus a minimal userland with rdma-core, python3-pyverbs, pytest and what
# shared/dataplane imports (numpy, structlog, msgpack, crc32c); its /init brings up rxe0 (rdma_rxe over a dummy
# netdev), mounts the project over virtio-9p and runs a command. Needs root and apt (host packages
# qemu-system-x86, mmdebstrap, cpio). About 2 minutes (more the first time, when it installs those), ~270 MB.
# The cached guest is reused only while its stamp (a hash of this script and init.sh, so of the package and
# module lists) matches: edit either and the next run rebuilds it.
# Exit codes: 0 built or cached; 77 cannot be built here (not root, no apt, the Debian mirror unreachable): the
# caller may skip (.ci/run does, saying so); anything else is a failure.
set -euo pipefail
OUT=${SMARTGEN_RDMA_VM_DIR:-$HOME/.cache/smartgen/rdma-vm}
HERE=$(cd "$(dirname "$0")" && pwd)
# What tests/rdma imports in the guest: shared/dataplane/base.py needs numpy and structlog, frames.py crc32c,
# agent.py msgpack. Debian's python3-crc32c is the same ICRAR `crc32c` module as the PyPI wheel the host uses.
PACKAGES=kmod,iproute2,rdma-core,ibverbs-providers,ibverbs-utils,python3-pyverbs,python3-pytest,python3-pytest-asyncio,procps
PACKAGES=$PACKAGES,python3-numpy,python3-structlog,python3-msgpack,python3-crc32c
STAMP=$(cat "$HERE/build.sh" "$HERE/init.sh" | sha256sum | cut -c1-16)
cached() { [ -f "$OUT/vmlinuz" ] && [ -f "$OUT/rootfs.cpio" ] && [ "$(cat "$OUT/stamp" 2>/dev/null)" = "$STAMP" ]; }
if cached && command -v qemu-system-x86_64 >/dev/null; then
  echo "rdma-vm: cached in $OUT"; exit 0
fi
cannot() { echo "rdma-vm: cannot build the guest here: $*" >&2; exit 77; }
[ "$(id -u)" = 0 ] || cannot "it needs root (apt, mmdebstrap, chroot)"
command -v apt-get >/dev/null || cannot "no apt-get (it is built from Debian packages)"
missing=""
for tool in qemu-system-x86_64:qemu-system-x86 mmdebstrap:mmdebstrap cpio:cpio; do
  command -v "${tool%%:*}" >/dev/null || missing="$missing ${tool##*:}"
done
if [ -n "$missing" ]; then
  echo "rdma-vm: installing$missing"
  apt-get update -qq || cannot "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null || cannot "apt-get install$missing failed"
fi
if cached; then echo "rdma-vm: cached in $OUT"; exit 0; fi  # (only QEMU was missing)
[ -f "$OUT/rootfs.cpio" ] && echo "rdma-vm: the cached guest in $OUT is stale (build.sh or init.sh changed): rebuilding"

rm -f "$OUT/stamp"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
kernel_package() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}' || true; }
kpkg=$(kernel_package)
if [ -z "$kpkg" ]; then  # a fresh machine has no package lists yet
  apt-get update -qq || cannot "apt-get update failed"
  kpkg=$(kernel_package)
  [ -n "$kpkg" ] || cannot "apt knows no linux-image-amd64 (the mirror unreachable?)"
fi
echo "rdma-vm: kernel package $kpkg"
if ! (cd "$work" && apt-get download -qq "$kpkg" 2>/dev/null); then  # stale package lists name a version gone from the mirror
  apt-get update -qq || cannot "apt-get update failed"
  kpkg=$(kernel_package)
  (cd "$work" && apt-get download -qq "$kpkg" 2>/dev/null) || cannot "apt-get download $kpkg failed (the mirror unreachable?)"
fi
dpkg-deb -x "$work"/"$kpkg"_*.deb "$work/kernel"
kver=${kpkg#linux-image-}

echo "rdma-vm: building the userland (mmdebstrap)"
mmdebstrap --quiet --variant=minbase \
  --include="$PACKAGES" \
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
echo "$STAMP" > "$OUT/stamp"
echo "rdma-vm: built $(du -sh "$OUT" | cut -f1) in $OUT (modules: $(echo "$needed" | wc -w))"
