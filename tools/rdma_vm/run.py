"""Boot the Soft-RoCE guest, run one command in the project folder inside it, print its output, exit with its code.

    python tools/rdma_vm/run.py 'python3 -m pytest -q tests/rdma'

The guest (see build.sh) mounts this checkout read-only at /work. QEMU runs under TCG: /dev/kvm on these
hosts is nested paravirtualisation that QEMU cannot use. One boot → run → power-off takes ~25 s plus the
command. A boot that shows no sign of life within BOOT_TIMEOUT_S is retried once.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VM_DIR = Path(os.environ.get("SMARTGEN_RDMA_VM_DIR", Path.home() / ".cache" / "smartgen" / "rdma-vm"))
BOOT_TIMEOUT_S = 90


def boot(command: str, timeout_s: float) -> tuple[int | None, str, str]:
    ctl = Path(tempfile.mkdtemp(prefix="smartgen-rdma-vm-"))
    try:
        (ctl / "cmd.sh").write_text("export PYTHONDONTWRITEBYTECODE=1\n" + command + "\n")
        console, out = ctl / "console.log", ctl / "out.log"
        qemu = ["qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", "2", "-m", "2048",
                "-nographic", "-no-reboot", "-kernel", str(VM_DIR / "vmlinuz"), "-initrd", str(VM_DIR / "rootfs.cpio"),
                "-append", "console=ttyS0 rdinit=/init panic=-1 quiet",
                "-fsdev", f"local,id=work,path={REPO},security_model=none,readonly=on",
                "-device", "virtio-9p-pci,fsdev=work,mount_tag=work",
                "-fsdev", f"local,id=ctl,path={ctl},security_model=none",
                "-device", "virtio-9p-pci,fsdev=ctl,mount_tag=ctl",
                "-serial", f"file:{console}", "-serial", f"file:{out}", "-monitor", "none"]
        proc = subprocess.Popen(qemu, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started = time.monotonic()
        while proc.poll() is None:
            elapsed = time.monotonic() - started
            alive = out.exists() and out.stat().st_size > 0 or console.exists() and console.stat().st_size > 2000
            if elapsed > timeout_s or (elapsed > BOOT_TIMEOUT_S and not alive):
                proc.kill()
                proc.wait()
                break
            time.sleep(0.5)
        rc_file = ctl / "rc"
        rc = int(rc_file.read_text().strip()) if rc_file.exists() else None
        read = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
        return rc, read(out), read(console) + proc.stderr.read().decode(errors="replace")
    finally:
        shutil.rmtree(ctl, ignore_errors=True)


def main() -> int:
    if not (VM_DIR / "vmlinuz").exists():
        print(f"rdma-vm: no guest in {VM_DIR}: run tools/rdma_vm/build.sh (make test-rdma does)", file=sys.stderr)
        return 2
    command = sys.argv[1] if len(sys.argv) > 1 else "python3 -m pytest -q -p no:cacheprovider tests/rdma"
    timeout_s = float(os.environ.get("SMARTGEN_RDMA_VM_TIMEOUT", "900"))
    started = time.monotonic()
    for attempt in (1, 2):
        rc, out, console = boot(command, timeout_s)
        if rc is not None or out:
            break
        print(f"rdma-vm: boot {attempt} showed no sign of life; console tail:\n{console[-2000:]}", file=sys.stderr)
    print(out, end="")
    print(f"rdma-vm: guest exit code {rc}, {time.monotonic() - started:.0f} s including boot", file=sys.stderr)
    if rc is None:
        print(f"rdma-vm: console tail:\n{console[-3000:]}", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
