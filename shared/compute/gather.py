"""One gather of the selected K/V rows of a slab layer into preallocated buffers: `gather_rows` and
`gather_pair` (keys and values at the same indices, positions computed once); `SelectedRows`, the same for several
rows of a decode step at once. Shapes: a slab layer's K or V is (H_kv, n, d) with contiguous rows; indices are
(H_kv, k) per KV head."""
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
    return (idx + _head_rows(x, idx)).view(-1)


def _head_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(H_kv, 1): the row of `_flat_rows(x)` where each head's first token lies (cached per layout)."""
    key = (idx.shape[0], x.stride(0) // x.shape[2], idx.device)
    first = _HEAD_ROWS.get(key)
    if first is None:
        first = _HEAD_ROWS[key] = torch.arange(0, key[0] * key[1], key[1], device=idx.device)[:, None]
    return first


def _index_rows(flat: torch.Tensor, at: torch.Tensor, shape: torch.Size, out: torch.Tensor | None) -> torch.Tensor:
    h, k = shape
    if out is None or out.shape[0] < h * k:
        return flat.index_select(0, at).view(h, k, flat.shape[1])
    buf = out[: h * k]
    torch.index_select(flat, 0, at, out=buf)
    return buf.view(h, k, flat.shape[1])


class SelectedRows:
    """The selected K and V of a step's selective rows at one layer, gathered together: one index_select over
    the KV store's arena for every row's K and V (the rows' slabs are views of one arena; elsewhere, e.g. caches
    copied to an accelerator one request each, one index_select per row into the same buffer), then one cast
    to the compute dtype. Large enough to run on every thread, where a row's own gather is a few small ops that
    run on one (selective.py, SERIAL_SELECTIVE). Buffers are kept and grown, never allocated per step (the
    engine's one torch thread is the only user; what `gather` returns is read before the next call).

    Layout: rows in the order given, row r as (K, V), each (H_kv, k_r, d) contiguous, so rows of equal width
    that are adjacent form a (rows, 2, H_kv, k, d) view (one attention call for them: `block`)."""

    def __init__(self) -> None:
        self._positions = torch.empty(0, dtype=torch.long)
        self._raw = torch.empty(0)  # the KV dtype
        self._cast = torch.empty(0)  # the compute dtype (unused when they are equal)

    def gather(self, keys: list[torch.Tensor], values: list[torch.Tensor], idx: list[torch.Tensor],
               dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """keys[r], values[r] (H_kv, n_r, d) slab views, idx[r] (H_kv, k_r) → per row (K, V), each (H_kv, k_r, d)
        in `dtype`: K[h, j] = keys[r][h, idx[r][h, j]]."""
        h, d = keys[0].shape[0], keys[0].shape[2]
        sizes = [i.numel() for i in idx]
        total = 2 * sum(sizes)
        self._raw = raw = _room(self._raw, total * d, keys[0].dtype, keys[0].device)
        raw = raw[: total * d].view(total, d)
        alike = all(k.shape == v.shape and k.stride() == v.stride() for k, v in zip(keys, values))
        arena = _arena_rows(keys + values) if len(keys) > 1 and alike else None
        if arena is None:  # one row, or not one arena: a gather per row, into the same buffer
            at = 0
            for k, v, i, size in zip(keys, values, idx, sizes):
                k_out, v_out = raw[at: at + size], raw[at + size: at + 2 * size]
                for got, into in zip(gather_pair(k, v, i, k_out, v_out), (k_out, v_out)):
                    if got.data_ptr() != into.data_ptr():  # a view not laid out as rows: gathered elsewhere
                        into.copy_(got.reshape(into.shape))
                at += 2 * size
        else:
            self._positions = positions = _room(self._positions, total, torch.long, idx[0].device)
            positions = positions[:total]
            at = 0
            for k, v, i, size in zip(keys, values, idx, sizes):
                # row j of head hh of a view x lies at row x.storage_offset() / d + hh · (x.stride(0) / d) + j
                torch.add(i, _head_rows(k, i), out=positions[at: at + size].view(i.shape))
                positions[at: at + size].add_(k.storage_offset() // d)
                torch.add(positions[at: at + size], (v.storage_offset() - k.storage_offset()) // d,
                          out=positions[at + size: at + 2 * size])
                at += 2 * size
            torch.index_select(arena, 0, positions, out=raw)
        out = raw
        if dtype != raw.dtype:
            self._cast = out = _room(self._cast, total * d, dtype, raw.device)
            out = out[: total * d].view(total, d)
            out.copy_(raw)
        rows, at = [], 0
        for size, i in zip(sizes, idx):
            rows.append((out[at: at + size].view(h, i.shape[1], d), out[at + size: at + 2 * size].view(h, i.shape[1], d)))
            at += 2 * size
        return rows


def _room(buf: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`buf` if it holds `numel` elements of `dtype` on `device`, else a new one with headroom (contexts grow)."""
    if buf.numel() >= numel and buf.dtype == dtype and buf.device == device:
        return buf
    return torch.empty(numel + numel // 4, dtype=dtype, device=device)


def block(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows adjacent in a `SelectedRows` buffer, all of one width → their K and V as (rows, H_kv, k, d) views
    (None if they are not so laid out)."""
    k0 = rows[0][0]
    step = 2 * k0.numel()
    for r, (k, v) in enumerate(rows):
        if k.shape != k0.shape or k.data_ptr() != k0.data_ptr() + r * step * k0.element_size():
            return None
    both = k0.as_strided((len(rows), 2, *k0.shape), (step, k0.numel(), *k0.stride()))
    return both[:, 0], both[:, 1]


def _arena_rows(views: list[torch.Tensor]) -> torch.Tensor | None:
    """The (rows, d) view over the whole storage the `views` (each (H_kv, n, d), rows contiguous) share, or None
    when they do not share one, or are not so laid out."""
    first = views[0]
    d = first.shape[2]
    storage = first.untyped_storage()
    for x in views:
        if (_flat_rows(x) is None or x.storage_offset() % d or x.dtype != first.dtype
                or x.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
    return first.as_strided((storage.nbytes() // (d * first.element_size()), d), (d, 1), 0)

