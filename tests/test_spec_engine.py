"""Speculative decoding in the engine (CPU, tiny): with prompt-lookup drafts the output is plain
decoding's, token for token, whatever else is on: greedy on the demo model and on HF's tiny
models, seeded sampling with top-k / top-p, min_tokens, logprobs, stop strings and stop ids,
n > 1, preemption, prefix hits, chunked prefill, overlap scheduling. Rollback leaves the block
tables and the prefix cache holding accepted tokens only. (Prompt lookup itself:
tests/test_spec.py.)"""
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanograph import LLM, SamplingParams
from nanograph.engine.sequence import Sequence, Status
from nanograph.spec.drafter import NgramDrafter, SpeculativeConfig
from nanograph.spec.scheduler import VerifyBatch

DEMO = str(Path(__file__).resolve().parents[1] / "nanograph" / "pretrained" / "pycoder")
# drafts on up to 32 decode rows (the default, 2, would leave most of these batches without any),
# whatever the clock says (the payoff rule measures wall time: its own tests below)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "disable_by_batch_size": 32, "disable_by_payoff": False}
# repetitive Python: the demo model repeats itself, prompt lookup guesses it
PYTHON = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
          "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n",
          "for i in range(10):\n    print(i)\nfor j in range(10):\n"]
KNOBS = dict(dtype="float32", kvcache_block_size=16, max_model_len=256, enforce_eager=True)


def run_both(prompts, params, spec=NGRAM, model=DEMO, repeat=1, **knobs):
    """Plain and speculative results of the same requests (each generate `repeat` times), and the
    speculative LLM's stats."""
    outputs = []
    for speculative_config in (None, spec):
        llm = LLM(model, **KNOBS | knobs, speculative_config=speculative_config)
        for _ in range(repeat):
            out = llm.generate(prompts, params, use_tqdm=False)
        outputs.append(out)
    return *outputs, llm.stats()


def assert_same(plain, spec):
    for a, b in zip(plain, spec):
        for x, y in zip(a["outputs"], b["outputs"]):
            assert x["token_ids"] == y["token_ids"]
            assert (x["text"], x["finish_reason"], x["stop_reason"]) \
                == (y["text"], y["finish_reason"], y["stop_reason"])
            if x["logprobs"] is not None:
                assert [d.keys() for d in x["logprobs"]] == [d.keys() for d in y["logprobs"]]
                for d, e in zip(x["logprobs"], y["logprobs"]):
                    assert list(d.values()) == pytest.approx(list(e.values()), abs=1e-4)
                assert x["cumulative_logprob"] == pytest.approx(y["cumulative_logprob"], abs=1e-3)


def test_greedy_on_the_demo_model_equals_plain_greedy_with_most_drafts_accepted():
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, spec, stats = run_both(PYTHON, params)
    assert_same(plain, spec)
    assert stats["steps"]["verify"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_draft_tokens"] / 2
    assert stats["spec_decode_mean_accepted_length"] > 2
    # fewer steps than tokens: drafts paid
    assert sum(stats["steps"].values()) < 40


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_on_hf_tiny_models_equals_hf(tiny_model, family):
    path = tiny_model(family)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9, 10, 9]]
    llm = LLM(path, **KNOBS, speculative_config=NGRAM | {"prompt_lookup_min": 1})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                          min_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        assert out["token_ids"] == ref
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_sampling_filters_logprobs_n_and_stops_give_plain_decoding_s_results():
    """Drafts from prompt lookup are deterministic: each emitted token is what plain sampling
    draws at its index (spec/verify.py), so seeded and unseeded requests, top-k / top-p,
    min_tokens, logprobs and n > 1 give exactly plain decoding's results; a stop string or a
    stop id in the middle of a run of accepted drafts ends the output where plain decoding's
    ends (the drafts after it go, with their logprobs)."""
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=32, seed=3,
                             logprobs=2),
              SamplingParams(temperature=0.5, max_tokens=32, n=2, min_tokens=24),
              SamplingParams(temperature=0, max_tokens=32, logprobs=0),
              SamplingParams(temperature=0, max_tokens=60, stop=["(a, b):\n    return a + b\n"]),
              SamplingParams(temperature=0, max_tokens=60, stop=["__repr__"],
                             include_stop_str_in_output=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[679])]
    plain, spec, stats = run_both(PYTHON * 2, params)
    assert_same(plain, spec)
    assert [out["finish_reason"] for out in spec[3:]] == ["stop"] * 3
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_preemption_prefix_hits_chunked_prefill_and_overlap():
    """A cache too small for all at once (preemptions), prompts cut into chunks, each prompt
    run twice (prefix hits), overlap scheduling on: still plain decoding's tokens."""
    params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=7)
    plain, spec, stats = run_both(PYTHON, params, repeat=2, num_kvcache_blocks=9,
                                  max_num_batched_tokens=16, overlap_scheduling=True)
    assert_same(plain, spec)
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_rollback_keeps_only_accepted_tokens_in_block_tables_and_prefix_cache():
    llm = LLM(DEMO, **KNOBS, speculative_config=NGRAM)
    llm.add_request(PYTHON[0], SamplingParams(temperature=0.9, max_tokens=80, ignore_eos=True))
    block_manager = llm.block_manager
    while llm.has_unfinished_requests():
        llm.step()
        for seq in llm.scheduler.running:
            assert seq.status == Status.RUNNING
            assert min(seq.token_ids) >= 0  # collected: no drafts, no placeholders
            assert seq.num_computed_tokens == len(seq) - 1
            # the blocks of its computed tokens, and the last one's when it starts a block
            assert -(-seq.num_computed_tokens // 16) <= len(seq.block_table) <= seq.num_blocks
            for i in range(seq.num_hashed_blocks):
                assert block_manager.blocks[seq.block_table[i]].token_ids == seq.block_tokens(i)
    stats = llm.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    cached = [block for block in block_manager.blocks if block.hash != -1]
    assert cached and all(len(block.token_ids) == 16 for block in cached)
    assert block_manager.num_free_blocks == len(block_manager.blocks)


def test_the_switch_off_rule():
    """No drafts above `disable_by_batch_size` decode rows or beside prefill chunks, nor where
    lookup finds nothing to copy; a sequence whose last token is in flight is drafted from the
    tokens before it, the guess of that token dropped; the counters count what was accepted."""
    config = SpeculativeConfig.parse(NGRAM | {"disable_by_batch_size": 2}, block_size=16)
    drafter = NgramDrafter(config)
    params = SamplingParams()
    seqs = [Sequence(i, [3, 4, 5, 3, 4], params, 16) for i in range(3)]
    assert drafter.propose(seqs, []) is None
    assert drafter.propose(seqs[:2], [(seqs[2], 5)]) is None
    assert drafter.propose(seqs[:2], []) == {seqs[0]: [5, 3, 4, 5], seqs[1]: [5, 3, 4, 5]}
    seqs[1].token_ids.append(-1)  # a placeholder: [5] guesses it, the drafts follow the guess
    assert drafter.propose(seqs[:2], []) == {seqs[0]: [5, 3, 4, 5], seqs[1]: [3, 4, 5, 3]}
    seqs[1].token_ids.pop()
    assert drafter.propose([Sequence(3, [1, 2, 3], params, 16)], []) is None
    # seqs[0] computed [4, drafts] and the target emitted [5, 3, 9]: two drafts accepted
    seqs[0].token_ids = [3, 4, 5, 3, 5, 3, 9]
    drafter.verified(VerifyBatch(seqs=[seqs[0]], num_decodes=0, num_tokens=[5], starts=[3],
                                 proposed={seqs[0]: [5, 3, 4, 5]}))
    stats = drafter.stats()
    assert (stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"],
            stats["spec_decode_num_accepted_tokens"]) == (1, 4, 2)
    assert drafter.payoff.tokens == 3  # what the row got: its accepted drafts and one token


@pytest.mark.parametrize("drafting_seconds", [0.0, 0.1])
def test_the_payoff_rule_keeps_drafts_that_pay_and_stops_those_that_do_not(drafting_seconds):
    """On the wall clock (spec/payoff.py): prompt lookup on repetitive Python pays (about 5
    tokens a verify for little more than a plain step); the same drafts taking 0.1 s each to make
    cost many plain steps a verify, and stop after the first ones measure that. The tokens are
    plain greedy's either way."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm = LLM(DEMO, **KNOBS, speculative_config=NGRAM | {"disable_by_payoff": True})
    lookup = llm.spec.drafter.proposer

    def slow_lookup(tokens, count):
        time.sleep(drafting_seconds)
        return lookup(tokens, count)
    llm.spec.drafter.proposer = slow_lookup
    spec = llm.generate(PYTHON[:1], params, use_tqdm=False)
    plain = LLM(DEMO, **KNOBS).generate(PYTHON[:1], params, use_tqdm=False)
    assert_same(plain, spec)
    steps = llm.stats()["steps"]
    if drafting_seconds:
        assert steps["verify"] <= 3 and steps["decode"] > 48
    else:
        assert steps["verify"] > 8 and steps["decode"] + steps["verify"] < 32


def test_drafts_only_once_the_batch_is_small_enough():
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 30, 6)]
    plain, spec, stats = run_both(PYTHON, params, spec=NGRAM | {"disable_by_batch_size": 2})
    assert_same(plain, spec)
    assert 0 < stats["spec_decode_num_drafts"] <= 2 * stats["steps"]["verify"]


@pytest.mark.parametrize("config, key", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    (NGRAM | {"num_speculative_tokens": 0}, "num_speculative_tokens"),
    (NGRAM | {"num_speculative_tokens": 16}, "num_speculative_tokens"),
    (NGRAM | {"prompt_lookup_min": 4}, "prompt_lookup_min"),
    (NGRAM | {"prompt_lookup_max": "3"}, "prompt_lookup_max"),
    (NGRAM | {"method": "eagle"}, "method"),
    (NGRAM | {"lookup": 2}, "lookup"),
    (NGRAM | {"disable_by_payoff": "no"}, "disable_by_payoff"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_configs_are_refused_naming_the_key(config, key):
    with pytest.raises(ValueError, match=key):
        LLM(DEMO, **KNOBS, speculative_config=config)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_verify_graphs_match_eager_verify_and_plain_greedy_on_the_demo_model():
    """On CUDA (float32, triton): the verify steps replay their graphs, and give the tokens of
    eager verify steps and of plain decoding (greedy and seeded sampling)."""
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=50, max_tokens=64, ignore_eos=True, seed=1)]
    prompts = PYTHON[:2]
    knobs = dict(dtype="float32", max_model_len=512, kvcache_block_size=16)
    results = {}
    for name, overrides in (("plain", {}), ("graphs", {"speculative_config": NGRAM}),
                            ("eager", {"speculative_config": NGRAM, "enforce_eager": True})):
        with LLM(DEMO, **knobs, **overrides) as llm:
            results[name] = [out["token_ids"] for out in
                             llm.generate(prompts * 2, params * 2, use_tqdm=False)]
            stats = llm.stats()
        if name == "graphs":
            assert stats["spec_verify_graph_replays"] == stats["steps"]["verify"] > 0
            assert stats["spec_decode_num_accepted_tokens"] > 0
    assert results["graphs"] == results["eager"] == results["plain"]


def test_the_server_takes_the_config_as_json_and_exports_the_counters():
    pytest.importorskip("uvicorn")
    from nanograph.serve.cli import parse_args
    from nanograph.serve.metrics import Metrics
    _, knobs, _ = parse_args(["model", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert knobs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(str(DEMO), **KNOBS, speculative_config=knobs["speculative_config"])
    llm.generate([PYTHON[0] * 2], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    metrics = Metrics("demo")
    metrics.update(llm, now=0.0)
    exposition = metrics.exposition().decode()
    drafts = llm.stats()["spec_decode_num_drafts"]
    assert drafts > 0 and f'nanograph:spec_decode_num_drafts{{model_name="demo"}} {float(drafts)}' \
        in exposition
    for name in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert f"nanograph:{name}{{" in exposition


def test_drafting_never_collects_a_plain_step_early():
    """With overlap scheduling, a sequence whose last token is still in flight is drafted from
    the tokens before it: the only steps collected before the next is scheduled are the verify
    steps themselves (a plain step never waits for its token to be known)."""
    llm = LLM(DEMO, **KNOBS, overlap_scheduling=True,
              speculative_config=NGRAM | {"disable_by_batch_size": 1})
    commit, steps = llm.scheduler.commit, []

    def recording(*args):
        batch = commit(*args)
        steps.append((batch.kind, batch.overlap))
        return batch
    llm.scheduler.commit = recording
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec = llm.generate(PYTHON[:1], params, use_tqdm=False)
    plain = LLM(DEMO, **KNOBS).generate(PYTHON[:1], params, use_tqdm=False)
    assert_same(plain, spec)
    assert ("verify", False) in steps
    assert all(overlap for kind, overlap in steps if kind != "verify")
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
