"""Speculative decoding with a draft model (CPU, tiny models, float32): the draft model drafts
greedily, so the output is plain decoding's, token for token, whatever the draft model and the
temperature; a draft model with the target's own weights has (nearly) all its drafts accepted,
and its engine's prefix cache makes each round recompute only the tail. Bad draft models are
refused naming the key. (Prompt lookup's engine tests: test_spec_engine.py.)"""
import shutil

import pytest
import torch

from nanograph import LLM, SamplingParams
from test_spec_engine import DEMO, KNOBS, PYTHON, assert_same, run_both

# (a draft model as costly as its target never pays: the payoff rule would turn these off)
DRAFT = {"num_speculative_tokens": 4, "disable_by_batch_size": 4, "disable_by_payoff": False}


def test_the_target_drafting_for_itself_has_its_drafts_accepted_and_plain_greedy_output():
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = LLM(DEMO, **KNOBS, speculative_config=DRAFT | {"model": DEMO})
    draft_engine = llm.spec.drafter.engine
    rounds = []  # the draft engine's prompt lengths, one list per call

    def recording(prompts, *args, **kwargs):
        rounds.append([len(prompt) for prompt in prompts])
        return generate(prompts, *args, **kwargs)
    generate, draft_engine.generate = draft_engine.generate, recording
    spec = llm.generate(PYTHON, params, use_tqdm=False)
    plain = LLM(DEMO, **KNOBS).generate(PYTHON, params, use_tqdm=False)
    assert_same(plain, spec)
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 32
    assert stats["spec_decode_num_accepted_tokens"] >= 0.95 * stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_mean_accepted_length"] > 4
    assert sum(stats["steps"].values()) < 16  # 32 tokens a sequence, about 5 a step
    # After a sequence's first round (its prompt, all new to the draft engine) each round's
    # prompt starts with blocks the last one registered: it computes at most its last partial
    # block (15 tokens), the target's token and the accepted drafts, and its decode steps.
    assert len(rounds[0]) == len(PYTHON)
    computed = sum(map(sum, rounds)) - draft_engine.stats()["prefix_cache_hit_tokens"]
    later_rounds = sum(map(len, rounds[1:]))
    assert later_rounds > 10
    assert computed <= sum(rounds[0]) + later_rounds * (15 + 1 + DRAFT["num_speculative_tokens"])
    llm.close()


def test_a_different_draft_model_gives_plain_greedy_output(tiny_model):
    """A tiny Llama drafting for a tiny Qwen3 of the same vocabulary: drafts mostly wrong,
    output exact."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9, 10, 9], list(range(2, 40))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain, spec, stats = run_both(prompts, params, model=tiny_model("qwen3"),
                                  spec=DRAFT | {"model": tiny_model("llama")})
    assert_same(plain, spec)
    assert stats["steps"]["verify"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("draft", ["demo", "tiny"])
def test_sampling_gives_plain_sampling_s_tokens(tiny_model, draft):
    """Temperature 1, seeded and not, n = 2, top-k: each emitted token is the one plain
    sampling draws at its index (spec/verify.py), whether the greedy drafts are right (the
    target's own weights) or not (a tiny model of the same vocabulary)."""
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=11),
              SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, n=2),
              SamplingParams(temperature=1.0, top_k=40, max_tokens=20, seed=5, logprobs=1)]
    prompts, model, draft_model = PYTHON, DEMO, DEMO
    if draft == "tiny":
        prompts = [[5, 6, 7, 8] * 3, [9, 10] * 4, [3, 4, 5]]
        model, draft_model = tiny_model("qwen3"), tiny_model("llama")
    plain, spec, stats = run_both(prompts, params, model=model,
                                  spec=DRAFT | {"model": draft_model})
    assert_same(plain, spec)
    assert stats["spec_decode_num_draft_tokens"] > 0
    if draft == "demo":
        assert stats["spec_decode_num_accepted_tokens"] > 0


@pytest.fixture
def damaged_model(tiny_model, tmp_path):
    """A copy of the tiny Qwen3 with its weights file cut short."""
    path = tmp_path / "damaged"
    shutil.copytree(tiny_model("qwen3"), path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return str(path)


@pytest.mark.parametrize("config, match", [
    ({"model": "/nonexistent/draft"}, r"speculative_config\['model'\]: model '/nonexistent"),
    ("damaged", r"speculative_config\['model'\]: cannot read"),
    ("tiny", r"speculative_config\['model'\]: the draft model's vocab_size is 320, the target"),
    ({"method": "draft_model"}, r"speculative_config\['model'\], a draft model's path"),
    ({"method": "ngram", "model": DEMO}, r"speculative_config\['model'\].*'ngram'"),
    ({"model": 3}, r"speculative_config\['model'\]"),
])
def test_bad_draft_models_are_refused_naming_the_key(tiny_model, damaged_model, config, match):
    if config == "damaged":
        config = {"model": damaged_model}
    elif config == "tiny":  # another vocabulary
        config = {"model": tiny_model("qwen3")}
    with pytest.raises(ValueError, match=match):
        LLM(DEMO, **KNOBS, speculative_config=DRAFT | config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_draft_model_greedy_equals_plain_greedy_with_graphs_on_the_demo_model():
    """On CUDA (float32, triton, graphs): the demo model drafting for itself; both engines replay
    their graphs, and the output is plain greedy decoding's."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    knobs = dict(dtype="float32", max_model_len=512, kvcache_block_size=16)
    with LLM(DEMO, **knobs) as llm:
        plain = llm.generate(PYTHON, params, use_tqdm=False)
    with LLM(DEMO, **knobs, speculative_config=DRAFT | {"model": DEMO}) as llm:
        spec = llm.generate(PYTHON, params, use_tqdm=False)
        stats, draft_stats = llm.stats(), llm.spec.drafter.engine.stats()
    assert_same(plain, spec)
    assert stats["spec_verify_graph_replays"] == stats["steps"]["verify"] > 0
    assert stats["spec_decode_num_accepted_tokens"] >= 0.9 * stats["spec_decode_num_draft_tokens"]
    assert draft_stats["graph_replays"] > 0 and draft_stats["prefix_cache_hit_tokens"] > 0
