"""Two Python threads each running a selective row's ops (quest at 4K, 10%): throughput against one thread."""
import threading, time, torch
torch.set_num_threads(1)
n, h, g, d, k = 4096, 3, 3, 64, 410
K = torch.randn(h, n, d); V = torch.randn(h, n, d)
pmin, pmax = torch.randn(h, n // 16, d), torch.randn(h, n // 16, d)
q = torch.randn(1, h * g, 1, d)
def row():
    qq = q.view(h, g, 1, d)
    s = torch.maximum(qq * pmin[:, None], qq * pmax[:, None]).sum(-1).amax(1)  # (h, pages)
    pages = torch.topk(s, k // 16, dim=-1, sorted=False).indices
    idx = (pages[:, :, None] * 16 + torch.arange(16)).view(h, -1)
    ks = torch.stack([K[i].index_select(0, idx[i]) for i in range(h)])
    vs = torch.stack([V[i].index_select(0, idx[i]) for i in range(h)])
    return torch.nn.functional.scaled_dot_product_attention(q, ks[None], vs[None], enable_gqa=True)
def work(count):
    for _ in range(count):
        row()
N = 2000
work(50)
t = time.perf_counter(); work(N); one = time.perf_counter() - t
ts = [threading.Thread(target=work, args=(N // 2,)) for _ in range(2)]
t = time.perf_counter(); [x.start() for x in ts]; [x.join() for x in ts]; two = time.perf_counter() - t
print(f"{N} rows: one thread {one*1e3/N:.3f} ms a row; two threads {two*1e3/N:.3f} ms a row ({one/two:.2f}x)")

@torch.jit.script
def row_script(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pmin: torch.Tensor, pmax: torch.Tensor, k: int):
    h, g, d = 3, 3, 64
    qq = q.view(h, g, 1, d)
    s = torch.maximum(qq * pmin.unsqueeze(1), qq * pmax.unsqueeze(1)).sum(-1).amax(1)
    pages = torch.topk(s, k // 16, dim=-1, sorted=False).indices
    idx = (pages.unsqueeze(2) * 16 + torch.arange(16)).view(h, -1)
    ks = torch.stack([K[i].index_select(0, idx[i]) for i in range(h)])
    vs = torch.stack([V[i].index_select(0, idx[i]) for i in range(h)])
    return torch.nn.functional.scaled_dot_product_attention(q, ks.unsqueeze(0), vs.unsqueeze(0), enable_gqa=True)
def work_s(count):
    for _ in range(count):
        row_script(q, K, V, pmin, pmax, k)
work_s(50)
t = time.perf_counter(); work_s(N); one = time.perf_counter() - t
ts = [threading.Thread(target=work_s, args=(N // 2,)) for _ in range(2)]
t = time.perf_counter(); [x.start() for x in ts]; [x.join() for x in ts]; two = time.perf_counter() - t
print(f"TorchScript: one thread {one*1e3/N:.3f} ms a row; two threads {two*1e3/N:.3f} ms a row ({one/two:.2f}x)")
