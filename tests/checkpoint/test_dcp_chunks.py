"""flat_boxes: an element range of a row-major tensor as DCP boxes, every range of small 0-d to 3-d shapes (odd sizes):
the boxes tile exactly the range, in order, each contiguous (a plain view of the rank's 1-D values), at most
2 * ndim - 1 of them; and FlatPieces answers DCP's hooks with views of its values."""

import itertools
import math

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from zero_ext.checkpoint.dcp_chunks import FlatPieces, flat_boxes


def _elements(offsets, sizes, shape):
    """The flat indices a box covers, in row-major order."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return [
        sum((o + i) * s for o, i, s in zip(offsets, idx, strides))
        for idx in itertools.product(*[range(n) for n in sizes])
    ]


def test_boxes_tile_every_range_contiguously():
    for shape in [(), (1,), (7,), (3, 5), (1, 4), (2, 3, 5), (3, 1, 4)]:
        numel = math.prod(shape)
        for start in range(numel + 1):
            for end in range(start, numel + 1):
                boxes = flat_boxes(start, end, shape)
                covered = []
                for offsets, sizes, first in boxes:
                    elements = _elements(offsets, sizes, shape)
                    assert elements == list(range(first, first + len(elements))), (shape, start, end, offsets, sizes)
                    covered += elements
                assert covered == list(range(start, end)), (shape, start, end, boxes)
                assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, start, end, boxes)


def test_flat_pieces_hooks_are_views_of_its_values():
    full = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    runs = [(2, 9), (17, 30)]
    values = torch.cat([full.reshape(-1)[a:b] for a, b in runs])
    pieces = FlatPieces(full.shape, torch.float32, runs, values, "w")
    chunks = pieces.__create_chunk_list__()
    items = pieces.__create_write_items__("w", pieces)
    assert [c.offsets for c in chunks] == [i.index.offset for i in items]
    for chunk in chunks:
        view = pieces.__get_tensor_shard__(MetadataIndex("w", chunk.offsets))
        box = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))]
        assert torch.equal(view, box) and view.untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
    assert sum(math.prod(c.sizes) for c in chunks) == values.numel()
