"""The nvme window's host buffers: aligned for O_DIRECT, huge-page aligned from 2 MiB up, usable without THP."""

from __future__ import annotations

import mmap

import pytest
import torch

from zero_ext.placement import files
from zero_ext.placement.files import ALIGN, HUGE_PAGE, aligned_buffer


@pytest.mark.parametrize("nbytes", [1, ALIGN - 1, ALIGN, 3 * ALIGN + 5, HUGE_PAGE - ALIGN, HUGE_PAGE, 12_779_520])
def test_aligned_buffer_size_alignment_and_contents(nbytes):
    buf = aligned_buffer(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes and buf.is_contiguous()
    assert buf.data_ptr() % ALIGN == 0
    if nbytes >= HUGE_PAGE:  # starts on a huge page, so the kernel can back it with them
        assert buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(7)  # writable, and all of it is ours
    assert int(buf.sum()) == 7 * nbytes


def test_aligned_buffer_without_transparent_huge_pages(monkeypatch):
    """A kernel without THP refuses MADV_HUGEPAGE (EINVAL): the buffer is made anyway, in 4 KiB pages."""

    class NoHugePages(mmap.mmap):
        def madvise(self, option, *args):
            if option == mmap.MADV_HUGEPAGE:
                raise OSError(22, "Invalid argument")
            return super().madvise(option, *args)

    monkeypatch.setattr(files.mmap, "mmap", NoHugePages)
    buf = aligned_buffer(HUGE_PAGE + ALIGN)
    assert buf.numel() == HUGE_PAGE + ALIGN and buf.data_ptr() % ALIGN == 0
    buf.fill_(1)
    assert int(buf.sum()) == HUGE_PAGE + ALIGN
