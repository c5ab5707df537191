"""Overlap scheduling: launching step N+1 before collecting step N changes nothing but speed.

The same requests with `overlap_scheduling=True` and `False` give identical tokens (greedy and
seeded sampling) through every path that interacts with a step in flight: EOS and stop ids seen
one step late, max_tokens / max_model_len stops, chunked prefill, prefix-cache hits, preemption.
Every block is free afterwards. An interrupted generate leaves nothing behind for the next one.
"""
import pytest
import torch

from conftest import hf_greedy
from nanograph import LLM, SamplingParams
from nanograph.engine.block_manager import BlockManager
from nanograph.engine.scheduler import Scheduler
from nanograph.engine.sequence import Sequence, Status
from nanograph.engine.step import build_step, resolve_placeholders
from test_engine import assert_all_blocks_free, random_prompts

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def mixed_requests(path: str, n: int = 8, seed: int = 0):
    """Prompts of assorted lengths sharing a 32-token prefix, and params that end them every way:
    an EOS (a token the model really produces, made EOS below), stop ids, max_tokens, seeded
    sampling (some with top-k / top-p), greedy."""
    shared = random_prompts([32], seed=seed + 100)[0]
    prompts = [shared + p for p in random_prompts([3 + 9 * i for i in range(n)], seed=seed)]
    free_run = hf_greedy(path, prompts[:1], 10)[0]
    params = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=30))  # stops at the EOS below
        elif kind == 1:
            params.append(SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[free_run[5], 7]))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.9, seed=i, max_tokens=5 + 3 * i, top_k=50, top_p=0.9))
        else:
            params.append(SamplingParams(temperature=1.0, seed=100 + i, max_tokens=36 + i))
    return prompts, params, free_run[3]


def generate_both(path, prompts, params, eos, **kwargs):
    results = []
    for overlap in (False, True):
        with LLM(path, kvcache_block_size=16, overlap_scheduling=overlap, **kwargs) as llm:  # frees the GPU
            llm.eos_ids = frozenset({eos})
            outs = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
            assert_all_blocks_free(llm)
            results.append((outs, llm.stats()))
    return results


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_overlap_gives_the_same_tokens(tiny_model, family):
    path = tiny_model(family)
    prompts, params, eos = mixed_requests(path)
    (sync, s_sync), (overlap, s_overlap) = generate_both(path, prompts, params, eos)
    assert overlap == sync
    assert any(out[-1] == eos for out in sync)  # the EOS really ended a sequence
    assert s_sync["overlap_discarded_tokens"] == 0 and s_overlap["overlap_discarded_tokens"] > 0
    for out, p in zip(sync, params):  # stops reach the output exactly once, at the end
        assert len(out) <= p.max_tokens and eos not in out[:-1]


def test_overlap_with_chunks_prefix_hits_preemption_and_max_model_len(tiny_model):
    path = tiny_model("qwen3")
    prompts, params, eos = mixed_requests(path, n=10, seed=1)
    # 10 sequences of up to ~156 tokens in 14 blocks of 16: preemption; 48-token prefill chunks;
    # the shared 32-token prefix hits the cache; max_model_len=120 cuts the longest ones
    (sync, s_sync), (overlap, s_overlap) = generate_both(
        path, prompts, params, eos, num_kvcache_blocks=14, max_num_batched_tokens=48, max_model_len=120)
    assert overlap == sync
    for stats in (s_sync, s_overlap):
        assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert any(len(p) + len(o) == 120 for p, o in zip(prompts, sync))  # a max_model_len stop


def test_greedy_with_overlap_matches_hf(tiny_model):
    path = tiny_model("llama")
    prompts = random_prompts([5, 30, 64])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(path, kvcache_block_size=16, overlap_scheduling=True)
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == hf_greedy(path, prompts, 12)


def test_placeholders_are_filled_and_late_stops_dropped():
    """The scheduler half of the pipeline, two steps ahead of the host, without a model."""
    sched = Scheduler(BlockManager(8, 16, True), max_num_seqs=4, max_num_batched_tokens=64)
    a = Sequence(0, [2, 3, 4], SamplingParams(max_tokens=5), 16, stop_ids=frozenset({9}))
    b = Sequence(1, [5, 6], SamplingParams(max_tokens=2), 16, stop_ids=frozenset({9}))
    sched.waiting.append(a)
    sched.waiting.append(b)
    prefill = sched.schedule()
    assert a.token_ids == [2, 3, 4, -1] and b.token_ids == [5, 6, -2]  # placeholders: -1 - row
    decode = sched.schedule()                                          # before the prefill is collected
    step = build_step(decode, 16)
    assert step.input_ids == [-1, -2] and step.positions == [3, 2] and step.context_lens == [4, 3]
    # b's second token is its last by length: it is never scheduled a third time
    assert list(sched.running) == [a] and len(b) == 4
    assert sched.update(prefill, [7, 8]) == [a, b] and a.token_ids == [2, 3, 4, 7, -1]
    assert a.status == b.status == Status.RUNNING
    third = sched.schedule()                                           # a only
    assert [s.seq_id for s in third.seqs] == [0]
    assert sched.update(decode, [9, 6]) == [a, b]                      # a hit EOS, b max_tokens
    assert a.token_ids == [2, 3, 4, 7, 9] and b.completion_token_ids == [8, 6]
    assert (a.finish_reason, a.stop_reason, b.finish_reason) == ("stop", None, "length")
    assert sched.update(third, [1]) == [] and sched.num_discarded_tokens == 1
    assert a.status == b.status == Status.FINISHED and not (sched.waiting or sched.running)
    assert sched.block_manager.num_free_blocks == 8


def test_placeholders_resolve_to_the_last_step_s_rows_on_the_device():
    last_sampled = torch.tensor([50, 51, 52, 0])  # a step's rows 0, 1, 2 (and one padding)
    ids = torch.tensor([7, -1, -3, 0, -2], dtype=torch.int32)
    assert resolve_placeholders(ids, last_sampled).tolist() == [7, 50, 52, 0, 51]
    assert resolve_placeholders(torch.arange(10), last_sampled).tolist() == list(range(10))


@pytest.mark.parametrize("overlap", [False, True])
def test_interrupted_generate_leaves_nothing_behind(tiny_model, monkeypatch, overlap):
    path = tiny_model("qwen3")
    prompts = random_prompts([5, 9, 14, 20])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(path, kvcache_block_size=16, overlap_scheduling=overlap)
    launch, calls = llm.runner.launch, []

    def interrupted(batch):
        calls.append(batch)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return launch(batch)
    monkeypatch.setattr(llm.runner, "launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert_all_blocks_free(llm)
    # the next call runs only its own requests, and as a fresh engine would
    fresh = LLM(path, kvcache_block_size=16, overlap_scheduling=overlap).generate(prompts[:2], params, use_tqdm=False)
    assert llm.generate(prompts[:2], params, use_tqdm=False) == fresh


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_overlap_gives_the_same_tokens_with_graphs(tiny_model, family):
    path = tiny_model(family)
    prompts, params, eos = mixed_requests(path, n=11)
    # 11 sequences shrink through the buckets [1, 2, 4, 8] and start above them (eager)
    (sync, s_sync), (overlap, s_overlap) = generate_both(path, prompts, params, eos, dtype="float32",
                                                         cuda_graph_sizes=[1, 2, 4, 8], max_num_mixed_tokens=64)
    assert overlap == sync
    assert s_overlap["overlap_discarded_tokens"] > 0 and s_overlap["graph_replays"] > 0
    assert len(s_overlap["replays_per_bucket"]) >= 3 and 0 < s_overlap["graph_hit_rate"] < 1
