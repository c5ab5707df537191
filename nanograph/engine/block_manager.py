"""The PagedAttention block manager: fixed-size KV blocks, reference counts, prefix caching.

The KV cache is one pool of `num_blocks` blocks of `block_size` token slots. A sequence owns a
list of block ids (its block table), so it needs no contiguous memory and wastes at most one
partly-filled block. Token t of a sequence lives in slot `block_table[t // B] * B + t % B`.

Prefix caching: once a block is full *and its K/V computed*, it is registered under a hash of
its tokens chained with the previous block's hash (xxhash64). Chaining makes the hash name the
whole prefix, so equal hashes mean equal prefixes (the tokens are compared too, to be safe
against collisions). A sequence with a LoRA adapter starts its chain from a hash of the adapter
instead of 0: its K/V differ from the base model's for the same tokens, so they share nothing.
A new sequence walks its full prompt blocks and shares every registered block it finds
(ref_count += 1) instead of recomputing it; one that asks for its prompt's logprobs takes no hits
(a cached block has K/V but no logits), so its prompt is computed whole. Blocks are registered
after the step that computes them, never at allocation: a chunked prefill must not lend out a
block whose K/V is still garbage.

Freed blocks (ref_count 0) keep their hash and contents: they sit in the free queue as a cache
and are reused by hits until they are handed out again. The queue is LRU: blocks are taken from
its head and freed to its tail, a sequence's last blocks first, so shared prefixes live longest.
"""
from collections import deque
from dataclasses import dataclass, field

import xxhash

from nanograph.engine.sequence import Sequence


def chain_hash(token_ids: list[int], prefix_hash: int):
    return xxhash.xxh64_intdigest(prefix_hash.to_bytes(8, "little")
                                  + b"".join(t.to_bytes(4, "little") for t in token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = -1  # -1: not registered in the prefix cache (xxh64 digests are >= 0)
    token_ids: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks, block_size, enable_prefix_caching):
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.cache_hit_tokens = 0

    @property
    def num_free_blocks(self):
        return len(self.free_block_ids)

    def _take_free_block(self):
        block = self.blocks[self.free_block_ids.popleft()]
        if self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]  # evict its cached contents
        block.hash, block.token_ids, block.ref_count = -1, [], 1
        return block.block_id

    def _cached_block(self, seq: Sequence, i: int, prefix_hash: int) -> Block | None:
        tokens = seq.block_tokens(i)
        if not self.enable_prefix_caching or len(tokens) < self.block_size:
            return None
        block_id = self.hash_to_block_id.get(chain_hash(tokens, prefix_hash))
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return self.blocks[block_id]

    def allocate(self, seq: Sequence):
        """Give `seq` blocks for all its tokens, sharing the longest cached prefix."""
        assert not seq.block_table
        prefix_hash = seq.cache_salt
        use_cache = seq.prompt_logprobs is None
        while use_cache and (block := self._cached_block(seq, len(seq.block_table),
                                                         prefix_hash)) is not None:
            if block.ref_count == 0:
                self.free_block_ids.remove(block.block_id)
            block.ref_count += 1
            seq.block_table.append(block.block_id)
            prefix_hash = block.hash
        # the cached prefix stops at the first miss; the rest gets fresh blocks
        hits = len(seq.block_table)
        seq.block_table += [self._take_free_block() for _ in range(hits, seq.num_blocks)]
        # Even a fully cached prompt recomputes its last token: its logits give the next token.
        seq.num_computed_tokens = min(hits * self.block_size, len(seq) - 1)
        seq.num_hashed_blocks = hits
        self.cache_hit_tokens += seq.num_computed_tokens

    def register_computed_blocks(self, seq: Sequence, num_computed):
        """Enter the blocks of `seq` that its first `num_computed` tokens fill into the prefix
        cache. (The caller passes the count of a step that has run: `seq.num_computed_tokens`
        already counts steps still in flight, whose placeholder tokens cannot be hashed.)"""
        if not self.enable_prefix_caching:
            return
        for i in range(seq.num_hashed_blocks, num_computed // self.block_size):
            prefix_hash = self.blocks[seq.block_table[i - 1]].hash if i > 0 else seq.cache_salt
            block = self.blocks[seq.block_table[i]]
            if block.hash == -1:
                block.token_ids = seq.block_tokens(i)
                block.hash = chain_hash(block.token_ids, prefix_hash)
                self.hash_to_block_id.setdefault(block.hash, block.block_id)
            seq.num_hashed_blocks = i + 1

    def free(self, seq: Sequence, keep: int = 0):
        """Give back the blocks of `seq` after its first `keep` (all of them by default)."""
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)
        del seq.block_table[keep:]
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, keep)

    def append_slot(self, seq: Sequence):
        """Make room for the token decode writes next (token len-1): a new block when that token
        starts one. False when it does and no block is free."""
        if len(seq.block_table) * self.block_size < len(seq):
            if not self.free_block_ids:
                return False
            seq.block_table.append(self._take_free_block())
        return True
