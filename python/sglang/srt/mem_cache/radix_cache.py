"""Prefix cache: a radix tree from token ids to KV slots, with LRU eviction of unlocked leaves.

Invariants:
- every slot stored in the tree is owned by the tree (freed only by eviction or reset);
- a node with lock_ref > 0 (used by a running request) and its ancestors are never evicted;
- evictable_size + protected_size == number of slots held by the tree.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Optional

import torch

from sglang.srt.mem_cache.memory_pool import TokenToKVPoolAllocator

_counter = itertools.count()


class TreeNode:
    def __init__(self, parent: Optional[TreeNode] = None):
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.key: list[int] = []
        self.value: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.id = next(_counter)

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time


def _match_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    def __init__(self, allocator: TokenToKVPoolAllocator):
        self.allocator = allocator
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of key: (its slots, the deepest matched node)."""
        node, values = self.root, []
        now = time.monotonic()
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access_time = now
            n = _match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node, key = child, key[n:]
        slots = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return slots, node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split child after n tokens; returns the new upper node."""
        upper = TreeNode(child.parent)
        upper.key, upper.value = child.key[:n], child.value[:n]
        upper.lock_ref, upper.last_access_time = child.lock_ref, child.last_access_time
        upper.children = {child.key[n]: child}
        child.parent.children[upper.key[0]] = upper
        child.parent = upper
        child.key, child.value = child.key[n:], child.value[n:]
        return upper

    # ------------------------------------------------------------------ insert
    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert key->slots; returns how many leading tokens were already cached.

        The caller still owns value[:returned] (duplicates) and must free them.
        """
        node, done = self.root, 0
        value = value.to("cpu", torch.int64)
        now = time.monotonic()
        while done < len(key):
            first = key[done]
            if first not in node.children:
                leaf = TreeNode(node)
                leaf.key, leaf.value = key[done:], value[done:].clone()
                node.children[first] = leaf
                self.evictable_size += len(leaf.key)
                return done
            child = node.children[first]
            child.last_access_time = now
            n = _match_len(child.key, key[done:])
            if n < len(child.key):
                child = self._split(child, n)
            node, done = child, done + n
        return done

    # ------------------------------------------------------------------ locking
    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked leaves (LRU first); returns freed."""
        leaves = [n for n in self._all_nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.value)
            freed += len(leaf.value)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def _all_nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
