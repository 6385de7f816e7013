"""Receiver CPU per frame of TCP data-plane gather reads (decode side), the server (prefill side) in another process."""
import asyncio, os, sys, time, subprocess
import numpy as np
sys.path.insert(0, os.getcwd())
from shared.dataplane import make_dataplane, Grant, Gather, Lane

REGION = 8 << 20
async def server(gbps):
    p = make_dataplane("tcp", link_gbps=gbps)
    p.register_region(memoryview(bytearray(REGION)))
    await p.start()
    p.grant(Grant(7, [(0, REGION)]))
    print(p.address, flush=True)
    await asyncio.sleep(3600)

async def client(addr, reads, unit, count, lane):
    p = make_dataplane("tcp")
    p.register_region(memoryview(bytearray(REGION)))
    await p.start()
    idx = np.arange(count) * 3
    g = Gather(0, 0, unit, idx, idx)
    await p.read_gather(addr, 7, g, lane)
    t0, c0 = time.perf_counter(), time.thread_time()
    p0 = time.process_time()
    for _ in range(reads):
        await p.read_gather(addr, 7, g, lane)
    wall, cpu, pcpu = time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0
    stats = p.lane_stats
    print(f"reads {reads} x {unit*count} B: wall {wall:.2f}s thread cpu {cpu:.3f}s ({cpu/wall:.0%})  process cpu {pcpu:.3f}")
    return cpu

if __name__ == "__main__":
    if sys.argv[1] == "server":
        asyncio.run(server(float(sys.argv[2])))
    else:
        gbps = float(sys.argv[2]); lane = Lane.BACKGROUND
        srv = subprocess.Popen([sys.executable, __file__, "server", str(gbps)], stdout=subprocess.PIPE, text=True)
        addr = srv.stdout.readline().strip()
        try:
            asyncio.run(client(addr, int(sys.argv[3]), 136, 480, lane))
        finally:
            srv.kill()
