"""End-to-end: nanograph's greedy tokens equal HF transformers' on the same tiny weights (CPU, float32),
for every model family, and under prefix caching, chunked prefill and preemption."""
import random

import pytest

from conftest import FAMILIES, hf_greedy
from nanograph import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def random_prompts(lengths, seed=0, vocab=320):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def assert_all_blocks_free(llm: LLM):
    bm = llm.block_manager
    assert bm.num_free_blocks == len(bm.blocks)
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.scheduler.waiting and not llm.scheduler.running


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_hf(tiny_model, family):
    path = tiny_model(family)
    prompts = random_prompts([3, 17, 40, 33, 64])
    llm = LLM(path, kvcache_block_size=16, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == hf_greedy(path, prompts, GREEDY.max_tokens)
    assert all(o["text"] is None for o in outs)  # no tokenizer in the checkpoint
    assert_all_blocks_free(llm)


def test_prefix_caching_reuses_blocks_and_stays_exact(tiny_model):
    path = tiny_model("qwen3")
    shared = random_prompts([48], seed=1)[0]
    prompts = [shared + tail for tail in random_prompts([5, 20, 33], seed=2)]
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(path, kvcache_block_size=16)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # registers the shared blocks
    hits_before = llm.stats()["prefix_cache_hit_tokens"]
    rest = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [first[0]["token_ids"]] + [o["token_ids"] for o in rest[1:]] == expected
    assert rest[0]["token_ids"] == expected[0]
    # the second call found at least the 3 shared full blocks for each of the 3 prompts
    assert llm.stats()["prefix_cache_hit_tokens"] - hits_before >= 3 * 48
    assert_all_blocks_free(llm)


def test_chunked_prefill_matches_hf(tiny_model):
    path = tiny_model("llama")
    prompts = random_prompts([150, 7, 70], seed=3)
    llm = LLM(path, kvcache_block_size=16, max_num_batched_tokens=32)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == hf_greedy(path, prompts, GREEDY.max_tokens)
    assert_all_blocks_free(llm)


def test_preemption_matches_hf(tiny_model):
    path = tiny_model("qwen2")
    prompts = random_prompts([40, 35, 45, 30, 38], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # 5 sequences of ~80 tokens need ~25 blocks of 16; give them 12
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=12)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["preemptions"] > 0
    assert [o["token_ids"] for o in outs] == hf_greedy(path, prompts, params.max_tokens)
    assert_all_blocks_free(llm)


def test_stops_eos_stop_tokens_and_max_model_len(tiny_model):
    path = tiny_model("qwen3")
    prompt = random_prompts([10], seed=5)[0]
    free_run = hf_greedy(path, [prompt], 12)[0]
    llm = LLM(path, kvcache_block_size=16, max_model_len=18)
    stop_at = free_run[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0]["token_ids"]
    assert out == free_run[:free_run.index(stop_at) + 1]
    # max_model_len=18 leaves room for 8 tokens after a 10-token prompt
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert out[0]["token_ids"] == free_run[:8]
    # EOS (id 1 in the tiny config) ends a sequence unless ignore_eos
    llm.eos_ids = frozenset({free_run[2]})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]["token_ids"]
    assert out == free_run[:free_run.index(free_run[2]) + 1]
