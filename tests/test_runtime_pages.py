"""runtime/pages.py: weights and bundles of a huge page or more in 2 MB-aligned memory marked for huge pages, the
same values as on ordinary pages; SPARSEFORGE_HUGE_PAGES=0 turns it off."""

import mmap

import pytest
import torch

from sparseforge.runtime import pages
from sparseforge.runtime.units import convert_bundles, make_bundles
from sparseforge.runtime.weights import convert

HUGE = hasattr(mmap, "MADV_HUGEPAGE")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_large_weights_are_copied_onto_aligned_huge_page_memory(dtype, monkeypatch):
    monkeypatch.delenv(pages.ENV, raising=False)
    w = torch.randn(1024, 1536)  # 6 MB in float32
    got, scales = convert(w, dtype)
    monkeypatch.setenv(pages.ENV, "0")
    want, want_scales = convert(w, dtype)
    assert torch.equal(got, want) and got.is_contiguous() and got.dtype == want.dtype
    assert (scales is None) == (want_scales is None) and (scales is None or torch.equal(scales, want_scales))
    if HUGE and got.numel() * got.element_size() >= pages.HUGE_PAGE:
        assert got.data_ptr() % pages.HUGE_PAGE == 0 and got.data_ptr() != w.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_bundles_on_huge_pages_hold_the_same_values(dtype, monkeypatch):
    monkeypatch.delenv(pages.ENV, raising=False)
    gate, up, down = torch.randn(2048, 576), torch.randn(2048, 576), torch.randn(576, 2048)
    got = convert_bundles(make_bundles(gate, up, down), dtype)
    monkeypatch.setenv(pages.ENV, "0")
    want = convert_bundles(make_bundles(gate, up, down), dtype)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)
    if HUGE:
        assert got[0].data_ptr() % pages.HUGE_PAGE == 0


def test_small_tensors_and_the_switch_keep_ordinary_memory(monkeypatch):
    monkeypatch.delenv(pages.ENV, raising=False)
    assert pages.enabled() == HUGE
    small = pages.huge_empty((16, 16), torch.float32)
    assert small.shape == (16, 16) and small.is_contiguous()
    monkeypatch.setenv(pages.ENV, "0")
    assert not pages.enabled()
    t = torch.randn(1024, 1024)
    copy = pages.huge_copy(t.T, torch.float16)  # a fresh contiguous tensor, converted
    assert copy.is_contiguous() and copy.dtype == torch.float16 and torch.equal(copy, t.T.half())


def test_huge_page_memory_is_writable_and_outlives_its_mapping_object(monkeypatch):
    monkeypatch.delenv(pages.ENV, raising=False)
    t = pages.huge_empty((3, 1024, 1024), torch.float32)
    t.fill_(2.0)
    view = t[1]
    del t  # the view keeps the mapping alive
    assert float(view.sum()) == 2.0 * 1024 * 1024
