"""Host->device uploads (utils/transfer.py): many host values, one copy."""

from __future__ import annotations

import torch

from sglang.srt.utils.transfer import upload
from sglang.test.sync_counter import SyncCounter


def _one_buffer(tensors: list[torch.Tensor]) -> bool:
    return len({t.untyped_storage().data_ptr() for t in tensors}) == 1


def test_lists_and_host_tensors_travel_in_one_copy():
    with SyncCounter() as c:
        ids, empty, pair, slots, more = upload(
            [[3, 1, 4], [], (1, 5)], "cpu", tensors=[torch.tensor([9, 2]), torch.tensor([6], dtype=torch.int64)]
        )
    assert (c.reads, c.uploads, c.transfers) == (0, 0, 1)
    assert [t.tolist() for t in (ids, empty, pair, slots, more)] == [[3, 1, 4], [], [1, 5], [9, 2], [6]]
    assert all(t.dtype == torch.int64 for t in (ids, empty, pair, slots, more))
    assert _one_buffer([ids, pair, slots, more])


def test_float_and_empty_uploads():
    temps, top_ps = upload([[0.5, 1], [0.25]], "cpu", torch.float32)
    assert temps.dtype == torch.float32 and temps.tolist() == [0.5, 1.0] and top_ps.tolist() == [0.25]
    (nothing,) = upload([[]], "cpu")
    assert nothing.shape == (0,) and nothing.dtype == torch.int64
    negative, big = upload([[-1], [2**62]], "cpu")
    assert negative.tolist() == [-1] and big.tolist() == [2**62]


def test_every_view_starts_on_a_16_byte_boundary():
    """Triton compiles a kernel variant per pointer alignment: views must not inherit the
    batch's sizes as offsets."""
    for dtype in (torch.int64, torch.float32):
        for sizes in ([1, 3, 2], [5, 1, 1, 7], [0, 1, 0, 2]):
            values = [list(range(n)) for n in sizes[:-1]]
            views = upload(values, "cpu", dtype, tensors=[torch.arange(sizes[-1], dtype=dtype)])
            assert [v.tolist() for v in views] == [torch.arange(n, dtype=dtype).tolist() for n in sizes]
            assert all(v.data_ptr() % 16 == 0 for v in views), (dtype, sizes)
            assert _one_buffer(views)
