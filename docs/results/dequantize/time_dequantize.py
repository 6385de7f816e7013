"""Experiment (not part of the stack): how long `QuantLayout.dequantize` takes for a 2K prompt's KV, against two
variants, with bit-identical results. Random K/V of SmolLM2's shape (30 layers, 3 KV heads, head dim 64).

    OMP_NUM_THREADS=1 .venv/bin/python docs/results/dequantize/time_dequantize.py
"""
import time

import torch

from shared.compute import quantization as qz

L, H, N, D = 30, 3, 2017, 64
SCRATCH: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A reused buffer (no fresh multi-MB allocation per call)."""
    n = 1
    for x in shape:
        n *= x
    buf = SCRATCH.get((name, dtype))
    if buf is None or buf.numel() < n:
        buf = SCRATCH[(name, dtype)] = torch.empty(n, dtype=dtype)
    return buf[:n].view(shape)


def with_scratch(codes, scale_min, bits, tag=""):
    """dequantize_partitions, the same ops into reused buffers."""
    per_byte, tag = 8 // bits, f"{tag}{codes.shape}"
    m = codes.shape[-1] * per_byte
    q = scratch(tag + "q", (*codes.shape, per_byte), torch.uint8)
    torch.bitwise_right_shift(codes[..., None], torch.arange(per_byte, dtype=torch.uint8) * bits, out=q)
    q.bitwise_and_(2 ** bits - 1)
    f = scratch(tag + "f", (*codes.shape[:-1], m), torch.float32)
    f.copy_(q.view(*codes.shape[:-1], m))
    sm = scratch(tag + "sm", tuple(scale_min.shape), torch.float32)
    sm.copy_(scale_min)
    return f.mul_(sm[..., 0:1]).add_(sm[..., 1:2])


def with_table(codes, scale_min, bits):
    """dequantize_partitions by a 256-entry table of each byte's codes."""
    per_byte = 8 // bits
    byte = torch.arange(256, dtype=torch.int32)
    table = ((byte[:, None] >> (torch.arange(per_byte, dtype=torch.int32) * bits)) & (2 ** bits - 1)).float()
    q = table.index_select(0, codes.reshape(-1).int()).view(*codes.shape[:-1], -1)
    sm = scale_min.float()
    return q.mul_(sm[..., 0:1]).add_(sm[..., 1:2])


original = qz.dequantize_partitions
torch.manual_seed(0)
for bits in (4, 2):
    quant = qz.QuantLayout(L, H, D, N, bits)
    aux = torch.zeros(quant.nbytes, dtype=torch.uint8)
    for layer in range(L):
        quant.quantize(aux, layer, torch.randn(H, N, D), torch.randn(H, N, D))
    results = {}
    for name, fn in (("as is", original), ("scratch", with_scratch), ("table", with_table)):
        qz.dequantize_partitions = fn
        rows = torch.zeros(L, 2, H, N + 64, D, dtype=torch.bfloat16)

        def run():
            for layer in range(L):
                quant.dequantize(aux, layer, rows[layer, 0, :, :N], rows[layer, 1, :, :N])

        run()
        started = time.perf_counter()
        for _ in range(5):
            run()
        results[name] = rows
        print(f"{bits}-bit {name:8s} {(time.perf_counter() - started) / 5 * 1e3:5.1f} ms for every layer, "
              f"identical to as is: {torch.equal(rows, results['as is'])}")
    qz.dequantize_partitions = original
