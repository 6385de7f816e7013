"""How much compute this machine's vCPUs give: a busy loop's iterations in 3 s alone on vCPU 0, then two busy loops
at once on vCPU 0 and vCPU 1; and a 1-thread matmul's time on vCPU 0 alone and beside a busy loop on vCPU 1.

    python3 docs/results/decode-cpu-2026-12-06/cores.py
"""
import multiprocessing as mp
import os
import statistics
import time


def burn(cpu: int, seconds: float, out) -> None:
    os.sched_setaffinity(0, {cpu})
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        n += 1
    out.put((cpu, n))


def matmul_ms() -> float:
    import torch
    torch.set_num_threads(1)
    a, x = torch.randn(576, 1536), torch.randn(1, 576)  # SmolLM2's MLP shape, one token

    def once() -> float:
        started = time.perf_counter()
        for _ in range(200):
            x @ a
        return time.perf_counter() - started
    return 1e3 * statistics.median(once() for _ in range(60))


if __name__ == "__main__":
    for cpus in ([0], [0, 1]):
        out = mp.Queue()
        procs = [mp.Process(target=burn, args=(c, 3.0, out)) for c in cpus]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        counts = dict(out.get() for _ in cpus)
        print(f"busy loops on vCPU {cpus}: iterations in 3 s {counts}")
    os.sched_setaffinity(0, {0})
    print(f"200 matmuls (1x576 @ 576x1536) on vCPU 0, alone: {matmul_ms():.1f} ms")
    p = mp.Process(target=burn, args=(1, 30.0, mp.Queue()))
    p.start()
    time.sleep(0.5)
    print(f"... beside a busy loop on vCPU 1: {matmul_ms():.1f} ms")
    p.kill()
