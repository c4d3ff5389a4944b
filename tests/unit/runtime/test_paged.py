"""vlmc/runtime/paged.py: the block allocator, writing rows into the pools, and the paged KV state."""

from __future__ import annotations

import numpy as np
import pytest

from vlmc.errors import VlmcError
from vlmc.runtime import paged
from vlmc.runtime.paged import NULL_BLOCK, BlockAllocator, OutOfBlocks, PagedKV, write_rows


def test_allocator_free_list_tables_and_release():
    a = BlockAllocator(6, 4)
    assert a.num_free == 5  # block 0 is reserved
    s1 = a.allocate("a", 5)
    assert a.table("a") == [1, 2] and s1.tolist() == [4, 5, 6, 7, 8]
    s2 = a.allocate("b", 3)
    assert a.table("b") == [3] and s2.tolist() == [12, 13, 14]
    assert a.allocate("a", 3).tolist() == [9, 10, 11] and a.table("a") == [1, 2]
    assert a.allocate("a", 1).tolist() == [16] and a.table("a") == [1, 2, 4]
    assert a.length("a") == 9 and a.num_free == 1
    bt = a.block_tables(["a", "b"])
    assert bt.dtype == np.int32 and bt.tolist() == [[1, 2, 4], [3, NULL_BLOCK, NULL_BLOCK]]
    a.release("a")
    assert a.num_free == 4 and a.table("a") == [] and a.length("a") == 0
    assert a.allocate("c", 4).tolist() == [4 * a.table("c")[0] + i for i in range(4)]


def test_allocator_out_of_blocks_is_atomic():
    a = BlockAllocator(3, 16)
    a.allocate("a", 20)
    with pytest.raises(OutOfBlocks, match="out of blocks: sequence 'b' needs 1 more block"):
        a.allocate("b", 1)
    assert a.table("b") == [] and a.length("b") == 0 and a.num_free == 0
    with pytest.raises(OutOfBlocks):
        a.allocate("a", 13)
    assert a.length("a") == 20 and a.table("a") == [1, 2]
    with pytest.raises(VlmcError, match="at least 2 blocks"):
        BlockAllocator(1, 16)


def test_write_rows_stores_in_place_and_skips_padding():
    pool = np.zeros((4, 2, 3, 5), np.float32)
    rows = np.arange(2 * 3 * 3 * 5, dtype=np.float32).reshape(2, 3, 3, 5) + 1
    slots = np.array([[-1, 6, 1], [-1, -1, 3]], np.int32)
    view = pool  # the caller's array object must be the one that changes
    write_rows(pool, rows, slots)
    flat = view.reshape(-1, 3, 5)
    np.testing.assert_array_equal(flat[6], rows[0, 1])
    np.testing.assert_array_equal(flat[1], rows[0, 2])
    np.testing.assert_array_equal(flat[3], rows[1, 2])
    assert not np.any(np.delete(flat, [1, 3, 6], axis=0))
    with pytest.raises(VlmcError, match="slot 8 is outside the pool of 8 slots"):
        write_rows(pool, rows[:1, :1], np.array([[8]], np.int32))
    with pytest.raises(VlmcError, match="do not match slot_mapping"):
        write_rows(pool, rows, slots[:, :2])
    with pytest.raises(VlmcError, match="C-contiguous"):
        write_rows(np.zeros((2, 4, 3, 5), np.float32).transpose(1, 0, 2, 3), rows[:1, :1], np.array([[0]]))


def test_update_names_the_old_whole_pool_interface():
    kv = {"layers": 1, "kv_heads": 2, "head_dim": 4, "block_size": 16, "num_blocks": 4}
    state = PagedKV(kv, 1)
    state.feeds({"attention_mask": np.ones((1, 3), np.int64), "new_tokens": 3})
    with pytest.raises(VlmcError, match="earlier key_cache_out interface: re-run the paged_kv pass"):
        state.update({"logits": np.zeros(1), "key_cache_out.0": state.pools["key_cache.0"]})
    rows = np.ones((1, 3, 2, 4), np.float32)
    pools = dict(state.pools)
    state.update({"new_key.0": rows, "new_value.0": 2 * rows})
    assert state.pools["key_cache.0"] is pools["key_cache.0"]  # written in place, not replaced
    np.testing.assert_array_equal(state.pools["value_cache.0"][1, :3], 2 * rows[0])


def test_allocator_shuffles_with_a_seed_and_grows_when_allowed():
    a = BlockAllocator(40, 16, seed=3)
    a.allocate("x", 16 * 10)
    assert np.any(np.diff(a.table("x")) != 1)
    g = BlockAllocator(2, 16, growable=True)
    g.allocate("x", 16 * 5)
    assert g.num_blocks >= 6 and len(g.table("x")) == 5 and len(set(g.table("x"))) == 5


def test_layers_of_finds_one_stack_in_layer_order_only():
    # PagedPool.write and BuildExecutor._stack pass a step's 2 x layers views through this check.
    class Stack:
        pass

    class View:
        def __init__(self, parent, layer):
            self.parent, self.layer = parent, layer

    stack, other = Stack(), Stack()
    views = [View(stack, i) for i in range(4)]
    assert paged.layers_of(views) is stack
    assert paged.layers_of(views[::-1]) is None  # out of order
    assert paged.layers_of(views[:2] + [View(other, 2), views[3]]) is None  # two stacks
    assert paged.layers_of(views[:3] + [np.zeros(2)]) is None  # an array among them
    assert paged.layers_of([]) is None
    stack.views = views  # a stack that lists its views: checked by identity, else as above
    assert paged.layers_of(list(views)) is stack
    assert paged.layers_of([View(stack, i) for i in range(4)]) is stack  # not its own, still in order
    assert paged.layers_of([views[0], views[2], views[1], views[3]]) is None
