"""vLLM's request surface against HF on a tiny model with a real tokenizer (CPU, float32): stop
strings across token boundaries, finish and stop reasons, min_tokens, n > 1 on one computed
prompt, logprobs, chat, streamed text through the step API, with and without overlap."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from nanograph import LLM, SamplingParams
from test_engine import assert_all_blocks_free, random_prompts
from test_mixed_steps import run_until_done

PROMPT = "def parse(line):\n"


def engine(path, **kwargs) -> LLM:
    return LLM(path, kvcache_block_size=16, **kwargs)


def greedy(max_tokens=30, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def boundary_stop(llm: LLM, token_ids: list[int]) -> tuple[str, int, int]:
    """A 2-character stop string made of the last character of one token's text and the first of
    the next one's, found nowhere earlier: (the string, where it starts, the index of the token
    that completes it)."""
    texts = [llm.tokenizer.decode(token_ids[:i]) for i in range(len(token_ids) + 1)]
    full = texts[-1]
    for k in range(1, len(token_ids) - 1):
        left, right = texts[k], texts[k + 1]
        if left and len(right) > len(left) and full.startswith(right) and "\ufffd" not in right:
            stop = left[-1] + right[len(left)]
            if full.find(stop) == len(left) - 1:
                return stop, len(left) - 1, k
    pytest.skip("no token boundary to cut in this text")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_a_token_boundary(text_model, include):
    llm = engine(text_model())
    free = llm.generate([PROMPT], greedy(), use_tqdm=False)[0]
    stop, start, last = boundary_stop(llm, free["token_ids"])
    out = llm.generate([PROMPT], greedy(stop=["never there", stop], include_stop_str_in_output=include),
                       use_tqdm=False)[0]
    assert out["text"] == free["text"][:start + len(stop) * include]
    assert out["token_ids"] == free["token_ids"][:last + 1]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop)
    assert_all_blocks_free(llm)


def test_finish_and_stop_reasons(text_model):
    llm = engine(text_model())
    free = llm.generate([PROMPT], greedy(12), use_tqdm=False)[0]
    assert (free["finish_reason"], free["stop_reason"]) == ("length", None)
    stop_id = free["token_ids"][4]
    out = llm.generate([PROMPT], greedy(12, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop_id)
    assert out["token_ids"] == free["token_ids"][:free["token_ids"].index(stop_id) + 1]
    llm.eos_ids = frozenset({stop_id})  # EOS: stop_reason None
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", None)
    assert out["token_ids"][-1] == stop_id


def test_a_stop_tokens_text_is_left_out_unless_asked(text_model):
    """vLLM's rule: a completion that ends on a stop id (or EOS, special tokens not skipped)
    has that token in token_ids, its text in text only with include_stop_str_in_output."""
    llm = engine(text_model())
    free = llm.generate([PROMPT], greedy(12), use_tqdm=False)[0]
    stop_id = free["token_ids"][4]
    for include in (False, True):
        for params in (greedy(12, stop_token_ids=[stop_id], include_stop_str_in_output=include),
                       SamplingParams(temperature=0, max_tokens=12, skip_special_tokens=False,
                                      include_stop_str_in_output=include)):
            llm.eos_ids = frozenset() if params.stop_token_ids else frozenset({stop_id})
            out = llm.generate([PROMPT], params, use_tqdm=False)[0]
            ids = out["token_ids"]
            assert ids[-1] == stop_id and out["finish_reason"] == "stop"
            assert out["text"] == llm.tokenizer.decode(ids if include else ids[:-1])


def test_min_tokens_masks_eos_and_stop_ids_like_hf(tiny_model):
    path = tiny_model("qwen3")
    prompt = random_prompts([10], seed=5)[0]
    llm = engine(path)
    free = llm.generate([prompt], greedy(12), use_tqdm=False)[0]["token_ids"]
    eos = free[1]
    llm.eos_ids = frozenset({eos})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=6), use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=6,
                              do_sample=False, eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
    assert out["token_ids"] == expected and eos not in out["token_ids"][:6]
    if eos in expected:
        assert out["finish_reason"] == "stop"


def test_n_completions_share_one_computed_prompt(text_model):
    path = text_model()
    prompt = random_prompts([40], seed=6)[0]  # 2 full blocks of 16 and 8 tokens
    params = SamplingParams(n=4, seed=7, temperature=1.0, max_tokens=10, ignore_eos=True)
    llm = engine(path)
    rid = llm.add_request(prompt, params)
    llm.step()  # the prompt's step: the first completion computes it, alone
    assert llm.stats()["steps"] == {"prefill": 1}
    assert len(llm.block_manager.blocks) - llm.block_manager.num_free_blocks == 3
    llm.step()  # the others start from its 2 cached blocks: each computes the last 8 tokens
    assert llm.stats()["prefix_cache_hit_tokens"] == 3 * 32
    assert llm.stats()["steps"] == {"prefill": 1, "mixed": 1}
    assert len(llm.block_manager.blocks) - llm.block_manager.num_free_blocks == 3 + 3
    out = run_until_done(llm)[rid]
    completions = [o["token_ids"] for o in out["outputs"]]
    assert out["token_ids"] == completions[0] and len(completions) == 4
    assert len(set(map(tuple, completions))) > 1
    # each completion's stream is a hash of (seed, i): repeatable, independent of the sharing
    # (the first is what the seed gives alone), and not another seed's (seed + i would be seed 8's)
    again = engine(path).generate([prompt], params, use_tqdm=False)[0]["outputs"]
    assert [o["token_ids"] for o in again] == completions
    for seed, completion in ((7, completions[0]), (8, None)):
        single = SamplingParams(seed=seed, temperature=1.0, max_tokens=10, ignore_eos=True)
        alone = engine(path).generate([prompt], single, use_tqdm=False)[0]["token_ids"]
        assert alone == completion if completion else alone not in completions
    assert_all_blocks_free(llm)


def test_logprobs_equal_hf_log_softmax(tiny_model):
    path = tiny_model("llama")
    prompts = random_prompts([9, 20], seed=8)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = engine(path).generate(prompts, params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        tokens = out["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits, dim=-1)
        assert len(out["logprobs"]) == len(tokens)
        for row, token, entry in zip(expected, tokens, out["logprobs"]):
            top = row.topk(3).indices.tolist()
            assert set(entry) == set(top) | {token}
            for token_id, logprob in entry.items():
                assert logprob == pytest.approx(row[token_id].item(), abs=1e-3)
        assert out["cumulative_logprob"] == pytest.approx(sum(e[t] for e, t in zip(out["logprobs"], tokens)))
    plain = engine(path).generate(prompts, SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True),
                                  use_tqdm=False)
    assert [o["token_ids"] for o in plain] == [o["token_ids"] for o in outs]
    assert plain[0]["logprobs"] is None and plain[0]["cumulative_logprob"] is None


def test_prompt_logprobs_equal_hf_log_softmax_in_chunks_and_past_the_prefix_cache(tiny_model):
    """vLLM's layout: one entry per prompt token, the first None, each {token id: logprob} of the
    prompt's token and the top N, from the raw logits. The prompts run in chunks of 16 beside each
    other; the second call finds the prompts' blocks cached and computes them again (a cached block
    has no logits), while a request without prompt logprobs still takes the hits."""
    path = tiny_model("qwen3")
    prompts = random_prompts([40, 23], seed=9)
    llm = engine(path, max_num_batched_tokens=16)
    params = greedy(max_tokens=2, prompt_logprobs=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for call in range(2):
        hits = llm.stats()["prefix_cache_hit_tokens"]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["prefix_cache_hit_tokens"] == hits  # none taken
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
            entries = out["prompt_logprobs"]
            assert len(entries) == len(prompt) and entries[0] is None
            for row, token, entry in zip(expected, prompt[1:], entries[1:]):
                assert set(entry) == set(row.topk(2).indices.tolist()) | {token}
                for token_id, logprob in entry.items():
                    assert logprob == pytest.approx(row[token_id].item(), abs=1e-4)
    plain = llm.generate(prompts, greedy(max_tokens=2), use_tqdm=False)
    assert [o["token_ids"] for o in plain] == [o["token_ids"] for o in outs]
    assert plain[0]["prompt_logprobs"] is None and llm.stats()["prefix_cache_hit_tokens"] > hits
    assert_all_blocks_free(llm)


def test_chat_is_generate_on_the_templated_text(text_model, tiny_model):
    llm = engine(text_model())
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    [chat] = llm.chat(conversation, greedy(8), use_tqdm=False)
    assert chat == llm.generate([text], greedy(8), use_tqdm=False)[0]
    both = llm.chat([conversation, conversation[1:]], greedy(8), use_tqdm=False)
    assert both[0] == chat and both[1] != chat
    with pytest.raises(ValueError, match="no chat template"):
        engine(tiny_model("qwen3")).chat(conversation, use_tqdm=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be >= 1"),
    (dict(n=1.5), "n must be an integer"),
    (dict(logprobs=-1), "logprobs must be >= 0"),
    (dict(min_tokens=-1), "min_tokens must be >= 0"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens \\(9\\) is above max_tokens"),
    (dict(stop=""), "stop must be a non-empty string"),
    (dict(stop=["a", ""]), "stop must be a non-empty string"),
    (dict(stop=[1]), "stop must be a non-empty string"),
])
def test_bad_request_surface_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("overlap", [False, True])
def test_step_api_streams_stable_text_and_the_same_results(text_model, overlap):
    path = text_model()
    offline = engine(path)
    free = offline.generate([PROMPT], greedy(), use_tqdm=False)[0]
    stop, _, _ = boundary_stop(offline, free["token_ids"])
    params = [greedy(stop=[stop]), SamplingParams(temperature=0.9, seed=3, max_tokens=20, n=2, logprobs=1),
              greedy(16, stop=["\ufffd never"])]
    expected = offline.generate([PROMPT] * 3, params, use_tqdm=False)
    llm = engine(path, overlap_scheduling=overlap)
    ids = [llm.add_request(PROMPT, p) for p in params]
    streams = {i: [] for i in ids}
    while llm.has_unfinished_requests():
        for out in llm.step():
            streams[out["request_id"]].append(out)
    for i, want in zip(ids, expected):
        texts = [o["text"] for o in streams[i]]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # given out, never taken back
        last = streams[i][-1]
        assert last["finished"] and all(last[k] == want[k] for k in ("text", "token_ids", "finish_reason"))
        for got, completion in zip(last["outputs"], want["outputs"]):  # batched otherwise: float noise
            assert got["token_ids"] == completion["token_ids"] and got["text"] == completion["text"]
            assert got["cumulative_logprob"] == pytest.approx(completion["cumulative_logprob"], abs=1e-3)
    assert expected[0]["stop_reason"] == stop
    assert_all_blocks_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logprobs_and_stop_strings_with_graphs(text_model):
    path = text_model()
    results = []
    for eager in (True, False):
        with LLM(path, kvcache_block_size=16, dtype="float32", enforce_eager=eager,
                 cuda_graph_sizes=[1, 2, 4], max_num_mixed_tokens=64) as llm:
            free = llm.generate([PROMPT], greedy(), use_tqdm=False)[0]
            stop, _, _ = boundary_stop(llm, free["token_ids"])
            params = [greedy(stop=[stop], logprobs=2), SamplingParams(temperature=0.9, seed=3, max_tokens=20, n=3)]
            outs = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
            results.append((outs, llm.stats()))
    (eager, _), (graphs, stats) = results
    assert stats["graph_replays"] > 0
    assert [o["outputs"] for o in graphs][1] == [o["outputs"] for o in eager][1]
    assert graphs[0]["text"] == eager[0]["text"] and graphs[0]["stop_reason"] == eager[0]["stop_reason"]
    for g, e in zip(graphs[0]["logprobs"], eager[0]["logprobs"]):
        assert g.keys() == e.keys() and all(abs(g[t] - e[t]) < 1e-3 for t in g)
