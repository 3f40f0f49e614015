"""The free-block queue: a doubly linked list through the blocks themselves, O(1) everywhere.

The head is evicted first. Freed blocks that hold a cached prefix go to the
tail (least recently used at the head); freed blocks with nothing cached go to
the head, so they are reused before any cached prefix is evicted. A block
leaves the middle of the queue in O(1) when a prefix-cache hit revives it.
"""

from __future__ import annotations

from collections.abc import Iterator

from services.scheduler.prefix_hash import BlockHash


class KVCacheBlock:
    """One KV block: id, holders, prefix hash, and its links while free."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev: KVCacheBlock | None = None
        self.next: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else " cached"
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    def __init__(self, blocks: list[KVCacheBlock]):
        # Sentinels: head.next is the first free block, tail.prev the last; neither is ever handed out.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next
        first.prev = block
        block.next = first
        block.prev = self._head
        self._head.next = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next
        while block is not self._tail:
            yield block
            block = block.next

    def block_ids(self) -> list[int]:
        return [block.block_id for block in self]
