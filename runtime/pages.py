"""Large weight tensors in memory backed by 2 MB pages.

A decode step reads each computed neuron's rows from bundles spread over hundreds of MB. With 4 KB pages nearly every
such row sits on a page the TLB does not hold, and the sparse kernel's prefetches wait on a page walk first; streamed
matrices restart the hardware prefetcher at every 4 KB boundary. On Linux with transparent huge pages (`always` or
`madvise` in /sys/kernel/mm/transparent_hugepage/enabled), `huge_empty` maps fresh anonymous memory and marks its
2 MB-aligned part MADV_HUGEPAGE, so the kernel backs it with 2 MB pages as it is first written; the tail past the last
whole 2 MB page keeps 4 KB pages, so nothing beyond the tensor is committed. The engine's weights (runtime/weights.py
convert), resident bundles (runtime/units.py convert_bundles), a neuron store's arena and the head screen are made this
way. Elsewhere (no MADV_HUGEPAGE), for tensors under one huge page, or with SPARSEFORGE_HUGE_PAGES=0, `huge_empty` is
torch.empty: the same tensor on 4 KB pages.
"""

import ctypes
import math
import mmap
import os

import torch

HUGE_PAGE = 2 << 20
ENV = "SPARSEFORGE_HUGE_PAGES"  # "0": every tensor on ordinary pages (for comparing, or where THP misbehaves)


def enabled() -> bool:
    """Whether huge_empty asks for huge pages here: MADV_HUGEPAGE exists and SPARSEFORGE_HUGE_PAGES is not 0."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(ENV, "1").strip() != "0"


def huge_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor, 2 MB-aligned and marked for huge pages where it spans one (module
    docstring); its memory is unmapped when the last tensor viewing it is freed."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or not enabled():
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = -start % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages, the same tensor
        pass
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)  # the tensor keeps buf alive


def huge_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh contiguous copy of CPU tensor t, converted to `dtype` (default its own), in huge_empty's memory."""
    return huge_empty(t.shape, dtype or t.dtype).copy_(t)
