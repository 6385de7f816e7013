"""Several tensors packed into one run of bytes, so they can travel as one segment of the data plane.

`PackedTensors(specs)` lays the tensors out in order, each starting on an 8-byte boundary; `views(buf)`
gives tensors that share memory with `buf` (a uint8 tensor of at least `nbytes`), for writing in place on
the sending side and reading in place on the receiving side.
"""
from __future__ import annotations

import math

import torch

ALIGN = 8
Spec = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) of one tensor


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class PackedTensors:
    def __init__(self, specs: list[Spec]):
        self.specs = list(specs)
        self.sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in self.specs]
        self.nbytes = sum(_aligned(n) for n in self.sizes)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """buf: uint8, ≥ nbytes, starting 8-byte aligned. One view per spec."""
        if buf.dtype != torch.uint8 or buf.numel() < self.nbytes:
            raise ValueError(f"need a uint8 buffer of {self.nbytes} bytes, got {buf.numel()} {buf.dtype}")
        views, at = [], 0
        for (shape, dtype), size in zip(self.specs, self.sizes):
            views.append(buf[at: at + size].view(dtype).view(shape))
            at += _aligned(size)
        return views

    def write(self, buf: torch.Tensor, tensors: list[torch.Tensor], first: int = 0) -> None:
        """Copy `tensors` (matching the specs exactly, from spec `first` on) into `buf`."""
        for view, tensor in zip(self.views(buf)[first:first + len(tensors)], tensors, strict=True):
            if tensor.shape != view.shape or tensor.dtype != view.dtype:
                raise ValueError(f"tensor {tuple(tensor.shape)} {tensor.dtype} does not match the declared "
                                 f"{tuple(view.shape)} {view.dtype}")
            view.copy_(tensor)
