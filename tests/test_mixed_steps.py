"""Mixed steps and the engine step API: decoding sequences get a token every step while other
prompts prefill in chunks; requests added at any time get HF's tokens; abort frees at once; one
driving thread; bad requests are ValueErrors that harm no one else (CPU, float32)."""
import threading

import pytest
import torch

from conftest import hf_greedy
from nanograph import LLM, SamplingParams
from nanograph.engine.block_manager import BlockManager
from nanograph.engine.scheduler import DRAIN_STEPS, Scheduler
from nanograph.engine.sequence import Sequence
from test_engine import assert_all_blocks_free, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run_until_done(llm: LLM, outputs: dict | None = None) -> dict:
    """Step until every request finished; the last output of each request by id."""
    outputs = {} if outputs is None else outputs
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out["request_id"]] = out
    return outputs


@pytest.mark.parametrize("overlap", [False, True])
def test_a_decoding_request_gets_one_token_every_step_while_prompts_prefill(tiny_model, overlap):
    llm = LLM(tiny_model("llama"), kvcache_block_size=16, max_num_batched_tokens=64,
              max_num_mixed_tokens=24,
              overlap_scheduling=overlap)
    short, long_a, long_b = random_prompts([5, 150, 90], seed=1)
    first = llm.add_request(short, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while not (outs := [o for o in llm.step() if o["request_id"] == first]):
        pass
    counts = [len(outs[0]["token_ids"])]
    ids = [llm.add_request(long_a, GREEDY), llm.add_request(long_b, GREEDY)]
    outputs = {}
    for _ in range(30):
        got = {o["request_id"]: o for o in llm.step()}
        counts.append(len(got[first]["token_ids"]))  # it is in every step's outputs
        outputs.update(got)
    # one token a step, while 240 prompt tokens went through in chunks of at most 24 - 1 tokens
    assert counts == list(range(counts[0], counts[0] + len(counts)))
    assert llm.stats()["steps"]["mixed"] >= 240 // 23
    run_until_done(llm, outputs)
    expected = hf_greedy(tiny_model("llama"), [long_a, long_b], 12)
    assert [outputs[i]["token_ids"] for i in ids] == expected
    assert_all_blocks_free(llm)


def test_requests_added_while_others_run_match_hf(tiny_model):
    path = tiny_model("qwen3")
    prompts = random_prompts([7, 60, 33, 3, 45, 20], seed=2)
    llm = LLM(path, kvcache_block_size=16, max_num_mixed_tokens=32)
    ids, outputs, step = [], {}, 0
    for prompt in prompts:  # one new request every third step
        ids.append(llm.add_request(prompt, GREEDY))
        for _ in range(3):
            outputs.update({o["request_id"]: o for o in llm.step()})
    run_until_done(llm, outputs)
    assert [outputs[i]["token_ids"] for i in ids] == hf_greedy(path, prompts, GREEDY.max_tokens)
    assert all(outputs[i]["finished"] and outputs[i]["finish_reason"] == "length" for i in ids)
    assert llm.stats()["steps"]["mixed"] > 0
    assert_all_blocks_free(llm)


def test_seeded_sampling_does_not_depend_on_when_the_request_arrived(tiny_model):
    path = tiny_model("qwen2")
    target = random_prompts([25], seed=3)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    alone_llm = LLM(path, kvcache_block_size=16)
    alone = alone_llm.generate([target], params, use_tqdm=False)[0]["token_ids"]
    llm = LLM(path, kvcache_block_size=16, max_num_mixed_tokens=16)
    for prompt in random_prompts([30, 50], seed=4):
        llm.add_request(prompt, SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True))
    for _ in range(5):
        llm.step()
    late = llm.add_request(target, params)  # arrives mid-run, prefilled in chunks beside decodes
    assert run_until_done(llm)[late]["token_ids"] == alone


def test_abort_frees_the_blocks_at_once(tiny_model):
    # 6 blocks of 16: a 50-token prompt with 40 new tokens needs all of them
    llm = LLM(tiny_model("qwen3"), kvcache_block_size=16, num_kvcache_blocks=6)
    prompt, other = random_prompts([50, 50], seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    doomed = llm.add_request(prompt, params)
    for _ in range(3):
        llm.step()
    assert llm.block_manager.num_free_blocks < 6
    llm.abort_request(doomed)
    assert llm.block_manager.num_free_blocks == 6  # at once, before any step
    survivor = llm.add_request(other, params)
    outputs = run_until_done(llm)
    assert outputs[doomed]["finish_reason"] == "abort" and outputs[doomed]["finished"]
    assert outputs[survivor]["token_ids"] == hf_greedy(tiny_model("qwen3"), [other], 40)[0]
    assert llm.stats()["preemptions"] == 0
    llm.abort_request(doomed)  # finished or unknown: nothing happens
    assert_all_blocks_free(llm)


def test_a_second_thread_gets_a_clear_error(tiny_model):
    llm = LLM(tiny_model("qwen3"), kvcache_block_size=16)
    inside, release, errors = threading.Event(), threading.Event(), []
    step = llm.runner.launch

    def slow_launch(batch):
        inside.set()
        release.wait(10)
        return step(batch)
    llm.runner.launch = slow_launch
    first = threading.Thread(target=llm.generate, args=([[5, 6, 7]], GREEDY),
                             kwargs=dict(use_tqdm=False))
    first.start()
    inside.wait(10)
    for call in (lambda: llm.generate([[1, 2]], GREEDY, use_tqdm=False), llm.step,
                 lambda: llm.add_request([1, 2])):
        with pytest.raises(RuntimeError, match="another thread"):
            call()
    release.set()
    first.join()
    llm.runner.launch = step
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(
        tiny_model("qwen3"), [[5, 6, 7]], 12)[0]


@pytest.mark.parametrize("prompt, params, message", [
    ([], None, "empty prompt"),
    ([1, 999], None, "token id 999 is outside the vocabulary"),
    ([1] * 300, None, "max_model_len=256 leaves no room"),
    ("text", None, "has no tokenizer"),
    ([1, 2], "greedy", "must be a SamplingParams"),
    ([1, 2], SamplingParams(stop_token_ids=[400]), "stop_token_ids"),
    ([1, 2], SamplingParams(stop=["x"]), "stop strings need a tokenizer"),
    ([1] * 100, SamplingParams(max_tokens=200), "could never run"),
])
def test_bad_requests_through_add_request(tiny_model, prompt, params, message):
    llm = LLM(tiny_model("qwen3"), kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=256,
              max_num_seqs=8)
    good = llm.add_request([5, 6, 7], GREEDY)
    llm.step()
    with pytest.raises(ValueError, match=message):
        llm.add_request(prompt, params)
    outputs = run_until_done(llm)
    assert list(outputs) == [good]
    assert outputs[good]["token_ids"] == hf_greedy(tiny_model("qwen3"), [[5, 6, 7]], 12)[0]
    assert_all_blocks_free(llm)


def test_generate_refuses_while_step_api_requests_run(tiny_model):
    llm = LLM(tiny_model("qwen3"), kvcache_block_size=16)
    rid = llm.add_request([5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False)
    llm.abort_request(rid)
    assert [o["finish_reason"] for o in llm.step()] == ["abort"]
    assert not llm.has_unfinished_requests()
    assert len(llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0]["token_ids"]) == 12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_mixed_graphs_match_eager_mixed_steps(tiny_model, family):
    """Requests arriving while others decode make mixed steps: replayed from the grid's graphs
    they give the tokens eager mixed steps give (float32), greedy and seeded with top-p alike."""
    path = tiny_model(family)
    prompts = random_prompts([5, 150, 90, 40, 7, 200, 33], seed=13)
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True)
               for i in range(len(prompts))]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    params = [sampled[i] if i % 2 else greedy for i in range(len(prompts))]
    results = []
    for eager in (True, False):
        llm = LLM(path, dtype="float32", kvcache_block_size=16, enforce_eager=eager,
                  max_num_mixed_tokens=64, cuda_graph_sizes=[1, 2, 4, 8])
        ids = []
        for prompt, p in zip(prompts, params):  # one arrival every second step
            ids.append(llm.add_request(prompt, p))
            llm.step()
            llm.step()
        outputs = run_until_done(llm)
        results.append(([outputs[i]["token_ids"] for i in ids], llm.stats()))
        llm.close()
    (eager, _), (graphs, stats) = results
    assert graphs == eager
    assert stats["mixed_steps"] >= 10 and stats["mixed_graph_hit_rate"] >= 0.9
    assert stats["graph_replays"] > 0 and len(stats["mixed_graph_grid"]) == 4


def mixed_step_after(num_short: int, prompt_len: int):
    """A scheduler of 16 seats (prefill budgets 256, and 128 while decoding) whose `num_short`
    sequences decode, and the step it makes once a prompt of `prompt_len` tokens waits."""
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    sched = Scheduler(BlockManager(256, 16, False), max_num_seqs=16,
                      max_num_batched_tokens=256, max_num_mixed_tokens=128)
    sched.waiting.extend(Sequence(i, [1, 2, 3], params, 16) for i in range(num_short))
    first = sched.schedule()
    assert first.kind == "prefill" and first.num_tokens == [3] * num_short
    sched.update(first, [5] * num_short)
    sched.waiting.append(Sequence(num_short, list(range(prompt_len)), params, 16))
    step = sched.schedule()
    assert step.kind == "mixed" and step.num_decodes == num_short
    return step


def test_the_prefill_budget_follows_the_free_seats():
    """A mixed step's prefill tokens: max_num_mixed_tokens by the share of seats not decoding,
    never under a sixteenth of it (a backlog large enough not to matter)."""
    for num_short, prefill_tokens in ((2, 128 * 14 // 16), (15, 128 // 16)):
        step = mixed_step_after(num_short, prompt_len=2000)
        assert step.num_tokens == [1] * num_short + [prefill_tokens]


def test_a_small_backlog_goes_in_over_several_steps():
    """With free seats to spare, a mixed step prefills an eighth of the prompt tokens waiting
    (DRAIN_STEPS), never under an eighth of max_num_mixed_tokens, and never over the seat
    rule's budget."""
    assert DRAIN_STEPS == 8
    for prompt_len, prefill_tokens in ((500, 500 // 8), (100, 128 // 8), (2000, 128 * 14 // 16)):
        assert mixed_step_after(2, prompt_len).num_tokens == [1, 1, prefill_tokens]


def test_the_backlog_counts_the_sequences_that_could_take_a_seat_soon():
    """The backlog walks at most max_num_seqs waiting sequences (a bounded cost a step, however
    many wait); more decode rows than seats (a limit lowered at run time) leave the floor."""
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    sched = Scheduler(BlockManager(256, 16, False), max_num_seqs=2,
                      max_num_batched_tokens=256, max_num_mixed_tokens=128)
    sched.waiting.extend(Sequence(i, list(range(400)), params, 16) for i in range(5))
    assert sched.prefill_budget(0) == 2 * 400 // DRAIN_STEPS  # not 5 x 400: the seat rule's 128
    assert sched.prefill_budget(3) == 128 // 16
