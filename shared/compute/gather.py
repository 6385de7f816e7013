"""One gather of the selected K/V rows of a slab layer into preallocated buffers: `gather_rows` and
`gather_pair` (keys and values at the same indices, positions computed once). Shapes: a slab layer's K or V is
(H_kv, n, d) with contiguous rows; indices are (H_kv, k) per KV head."""
from __future__ import annotations

import torch


def gather_rows(x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (H_kv, n, d), a view whose rows are contiguous (a slab layer), idx (H_kv, k) → x[h, idx[h]] (H_kv, k, d):
    one index_select over the heads' rows, into `out` ((≥ H_kv·k, d) buffer of x's dtype) when given."""
    flat = _flat_rows(x)
    if flat is None:
        return torch.gather(x, 1, idx[..., None].expand(-1, -1, x.shape[2]))
    return _index_rows(flat, _row_positions(x, idx), idx.shape, out)


def gather_pair(keys: torch.Tensor, values: torch.Tensor, idx: torch.Tensor, k_out: torch.Tensor | None = None,
                v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_rows` of keys and of values at the same `idx`: the rows' positions are computed once when both are
    laid out alike (a slab layer's K and V)."""
    flat_k = _flat_rows(keys)
    if flat_k is None or keys.stride() != values.stride() or keys.shape != values.shape:
        return gather_rows(keys, idx, k_out), gather_rows(values, idx, v_out)
    flat_v = values.as_strided(flat_k.shape, flat_k.stride())
    at = _row_positions(keys, idx)
    return _index_rows(flat_k, at, idx.shape, k_out), _index_rows(flat_v, at, idx.shape, v_out)


def _flat_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x (H_kv, n, d) with contiguous rows and heads a whole number of rows apart → the (rows, d) view over all its
    heads' rows (None: not so laid out)."""
    h, n, d = x.shape
    stride = x.stride()
    if stride[2] != 1 or stride[1] != d or stride[0] % d:
        return None
    return x.as_strided(((h - 1) * (stride[0] // d) + n, d), (d, 1))


_HEAD_ROWS: dict[tuple, torch.Tensor] = {}  # (heads, rows apart, device) → (heads, 1) first row of each head


def _row_positions(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """idx (H_kv, k) → the (H_kv·k,) rows of `_flat_rows(x)` they name."""
    key = (idx.shape[0], x.stride(0) // x.shape[2], idx.device)
    first = _HEAD_ROWS.get(key)
    if first is None:
        first = _HEAD_ROWS[key] = torch.arange(0, key[0] * key[1], key[1], device=idx.device)[:, None]
    return (idx + first).view(-1)


def _index_rows(flat: torch.Tensor, at: torch.Tensor, shape: torch.Size, out: torch.Tensor | None) -> torch.Tensor:
    h, k = shape
    if out is None or out.shape[0] < h * k:
        return flat.index_select(0, at).view(h, k, flat.shape[1])
    buf = out[: h * k]
    torch.index_select(flat, 0, at, out=buf)
    return buf.view(h, k, flat.shape[1])
