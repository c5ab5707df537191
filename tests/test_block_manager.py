"""Block manager and scheduler: ref counts, hash chains, eviction, chunking, preemption."""
from nanograph.engine.block_manager import BlockManager, chain_hash
from nanograph.engine.scheduler import Scheduler
from nanograph.engine.sequence import Sequence, Status
from nanograph.sampling_params import SamplingParams

BS = 16


def seq(tokens, seq_id=0, **params):
    return Sequence(seq_id, tokens, SamplingParams(**params), BS)


def compute_all(bm: BlockManager, s: Sequence):
    """Pretend a step computed every token of s, as Scheduler.update does."""
    s.num_computed_tokens = len(s)
    bm.register_computed_blocks(s, len(s))


def test_hash_chains_name_the_whole_prefix():
    a, b = list(range(BS)), list(range(1, BS + 1))
    assert chain_hash(a, 0) == chain_hash(a, 0)
    assert chain_hash(a, 0) != chain_hash(b, 0)
    # the same block after different prefixes hashes differently
    assert chain_hash(a, chain_hash(a, 0)) != chain_hash(a, chain_hash(b, 0))


def test_shared_prefix_ref_counts_and_free():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    prompt = list(range(40))                      # 2 full blocks + 8 tokens
    s1 = seq(prompt)
    bm.allocate(s1)
    assert s1.num_computed_tokens == 0 and len(s1.block_table) == 3
    s2 = seq(prompt + [99], seq_id=1)
    bm.allocate(s2)                               # s1 not computed yet: nothing to share
    assert s2.num_computed_tokens == 0 and set(s1.block_table).isdisjoint(s2.block_table)
    bm.free(s2)
    compute_all(bm, s1)
    s3 = seq(prompt + [7, 8], seq_id=2)
    bm.allocate(s3)
    assert s3.num_computed_tokens == 2 * BS
    assert s3.block_table[:2] == s1.block_table[:2] and s3.block_table[2] != s1.block_table[2]
    assert [bm.blocks[i].ref_count for i in s1.block_table] == [2, 2, 1]
    bm.free(s1)
    assert [bm.blocks[i].ref_count for i in s3.block_table] == [1, 1, 1]
    bm.free(s3)
    assert bm.num_free_blocks == 10 and all(b.ref_count == 0 for b in bm.blocks)
    assert bm.cache_hit_tokens == 2 * BS


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    s1 = seq(list(range(2 * BS)))
    bm.allocate(s1)
    compute_all(bm, s1)
    bm.free(s1)
    s2 = seq(list(range(2 * BS)), seq_id=1)
    bm.allocate(s2)
    assert s2.num_computed_tokens == 2 * BS - 1


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    s1 = seq(list(range(2 * BS)))
    bm.allocate(s1)
    compute_all(bm, s1)
    bm.free(s1)                                   # cached, ref 0, still hashed
    assert len(bm.hash_to_block_id) == 2
    s2 = seq(list(range(100, 100 + 2 * BS)), seq_id=1)
    bm.allocate(s2)                               # takes the 2 never-used blocks first (LRU)
    assert set(s2.block_table).isdisjoint(s1.block_table) and len(bm.hash_to_block_id) == 2
    s3 = seq(list(range(200, 200 + BS)), seq_id=2)
    bm.allocate(s3)                               # must evict one of s1's blocks: its tail first
    assert len(bm.hash_to_block_id) == 1
    s4 = seq(list(range(2 * BS)) + [5], seq_id=3)
    bm.free(s2)
    bm.allocate(s4)                               # s1's first block survived and is reused
    assert s4.num_computed_tokens == BS


def test_prefix_caching_off_never_shares():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    s1 = seq(list(range(2 * BS)))
    bm.allocate(s1)
    compute_all(bm, s1)
    s2 = seq(list(range(2 * BS)), seq_id=1)
    bm.allocate(s2)
    assert s2.num_computed_tokens == 0 and not bm.hash_to_block_id


def test_scheduler_chunks_long_prompts_and_respects_limits():
    bm = BlockManager(64, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=50)
    long, a, b = seq(list(range(120))), seq(list(range(10)), 1), seq(list(range(10)), 2)
    for s in (long, a, b):
        sched.waiting.append(s)
    chunks = []
    while True:
        batch = sched.schedule()
        assert batch.kind == "prefill"
        chunks.append([(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_tokens)])
        sched.update(batch, [0] * len(batch.seqs))
        if long.status == Status.RUNNING:
            break
    assert chunks == [[(0, 50)], [(0, 50)], [(0, 20), (1, 10)]]
    batch = sched.schedule()                      # max_num_seqs=2: b must wait for a decode slot
    assert batch.kind == "decode" and [s.seq_id for s in batch.seqs] == [0, 1]


def test_scheduler_preempts_newest_and_requeues_it_first():
    bm = BlockManager(3, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000)
    old, new = seq(list(range(BS)), 0, max_tokens=50), seq(list(range(BS)), 1, max_tokens=50)
    sched.waiting.append(old)
    sched.waiting.append(new)
    sched.update(sched.schedule(), [5, 5])        # both now need a second block; only one is free
    batch = sched.schedule()
    assert batch.kind == "decode" and [s.seq_id for s in batch.seqs] == [0]
    assert sched.num_preemptions == 1 and new.status == Status.WAITING and not new.block_table
    assert list(sched.waiting) == [new] and new.num_computed_tokens == 0
