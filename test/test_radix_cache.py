import torch

from sglang.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sglang.srt.mem_cache.radix_cache import RadixCache


def _cache(size=64):
    alloc = TokenToKVPoolAllocator(size)
    return alloc, RadixCache(alloc)


def _insert(cache, alloc, key):
    slots = alloc.alloc(len(key))
    done = cache.insert(key, slots)
    alloc.free(slots[:done])
    return slots


def test_match_and_split():
    alloc, cache = _cache()
    slots = _insert(cache, alloc, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2, 9])
    assert got.tolist() == slots[:2].tolist()
    assert node.key == [1, 2]
    got, _ = cache.match_prefix([1, 2, 3, 4, 5])
    assert got.tolist() == slots.tolist()
    assert cache.evictable_size == 4


def test_insert_reports_duplicates_and_sizes_stay_consistent():
    alloc, cache = _cache()
    _insert(cache, alloc, [1, 2, 3])
    before = alloc.available_size()
    slots = alloc.alloc(5)
    done = cache.insert([1, 2, 3, 7, 8], slots)
    assert done == 3
    alloc.free(slots[:done])
    assert alloc.available_size() == before - 2
    assert cache.evictable_size == 5


def test_locked_nodes_are_not_evicted_and_lru_goes_first():
    alloc, cache = _cache(16)
    _insert(cache, alloc, [1, 2, 3])
    _insert(cache, alloc, [4, 5, 6])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)
    assert cache.protected_size == 3 and cache.evictable_size == 3
    assert cache.evict(100) == 3
    assert cache.match_prefix([4, 5, 6])[0].numel() == 0
    assert cache.match_prefix([1, 2, 3])[0].numel() == 3
    cache.dec_lock_ref(node)
    assert cache.evict(1) == 3
    assert alloc.available_size() == 16


def test_evict_cascades_to_parents():
    alloc, cache = _cache(16)
    _insert(cache, alloc, [1, 2, 3])
    _insert(cache, alloc, [1, 2, 4])
    assert cache.evict(16) == 4
    assert alloc.available_size() == 16
    assert cache.evictable_size == 0 and not cache.root.children


def test_allocator_reuses_freed_slots_once_the_free_list_runs_out():
    alloc = TokenToKVPoolAllocator(8)
    first = alloc.alloc(6)
    alloc.free(first[:4])
    assert alloc.available_size() == 6
    rest = alloc.alloc(2)  # served from the untouched range
    assert rest.tolist() == [7, 8]
    again = alloc.alloc(4)  # the range is empty: the freed slots come back
    assert sorted(again.tolist()) == sorted(first[:4].tolist())
    assert alloc.alloc(1) is None and alloc.available_size() == 0
    alloc.free(again)
    alloc.clear()
    assert alloc.available_size() == 8 and alloc.alloc(8).tolist() == list(range(1, 9))


def test_freed_slots_are_copies():
    """A freed view of the request->token table keeps its slots when the row is rewritten."""
    alloc = TokenToKVPoolAllocator(4)
    row = torch.zeros(8, dtype=torch.int64)
    row[:4] = alloc.alloc(4)
    alloc.free(row[:2])
    row[:2] = 0  # the next request writes the row
    assert sorted(alloc.alloc(2).tolist()) == [1, 2]


def test_write_spans_fills_each_span_through_one_copy():
    pool = ReqToTokenPool(4, 6, "cpu")
    out = pool.write_spans([2, 0, 3], [1, 5, 0], [2, 0, 3], torch.tensor([7, 8, 9, 10, 11]))
    assert out.tolist() == [7, 8, 9, 10, 11]
    assert pool.req_to_token.tolist() == [[0] * 6, [0] * 6, [0, 7, 8, 0, 0, 0], [9, 10, 11, 0, 0, 0], [0] * 6]


def test_table_never_hands_out_the_dummy_row():
    pool = ReqToTokenPool(3, 4, "cpu")
    rows = [pool.alloc() for _ in range(4)]
    assert sorted(rows[:3]) == [1, 2, 3] and rows[3] is None and pool.req_to_token.shape[0] == 4


def _decoding_reqs(pool: ReqToTokenPool, prompts: list[list[int]]) -> list:
    from sglang.srt.batch.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs = []
    for i, prompt in enumerate(prompts):
        req = Req(f"r{i}", prompt, SamplingParams(max_new_tokens=8))
        req.req_pool_idx, req.kv_len, req.output_ids = pool.alloc(), len(prompt), [40 + i]
        reqs.append(req)
    return reqs


def test_decode_slots_reach_the_table_with_the_batch_upload():
    """The new slots' table entries are written by the batch's own upload, not before."""
    from sglang.srt.batch.req_kv import ReqKVManager
    from sglang.srt.batch.schedule_batch import ScheduleBatch
    from sglang.test.sync_counter import SyncCounter

    pool, alloc = ReqToTokenPool(4, 8, "cpu"), TokenToKVPoolAllocator(16)
    kv = ReqKVManager(pool, alloc, None)
    reqs = _decoding_reqs(pool, [[1, 2, 3], [4]])
    batch = ScheduleBatch.for_decode(reqs)
    batch.kv_write = kv.assign_next_on_upload(batch.reqs)
    assert not pool.req_to_token.any()
    with SyncCounter() as c:
        fb = batch.to_forward_batch("cpu")
    assert (c.reads, c.uploads, c.transfers) == (0, 0, 1)
    slots = fb.out_cache_loc.tolist()
    assert len(set(slots)) == 2 and 0 not in slots
    rows = [r.req_pool_idx for r in reqs]
    assert pool.req_to_token[rows[0]].tolist() == [0, 0, 0, slots[0], 0, 0, 0, 0]
    assert pool.req_to_token[rows[1]].tolist() == [0, slots[1], 0, 0, 0, 0, 0, 0]
    assert fb.input_ids.tolist() == [40, 41] and fb.positions.tolist() == [3, 1] and fb.seq_lens.tolist() == [4, 2]
    assert batch.kv_write is None and batch.out_cache_loc is fb.out_cache_loc
