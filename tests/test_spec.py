"""Speculative decoding's building blocks: prompt-lookup drafts (the engine's search against an
obvious oracle) and the bench's forced acceptance. The engine's use of them (outputs equal to
plain decoding) is tests/test_spec_engine.py."""
import random

from nanograph.spec.ngram import propose_ngram as propose_ngram_fast


# ---- the payoff rule ------------------------------------------------------------------------

def test_the_payoff_rule_prices_a_verify_with_its_lost_overlap_and_its_drafts(monkeypatch):
    """spec/payoff.py on a made-up clock: plain steps take 1 s; the step before a verify 1.25 s
    (its update waited for the verify's drafts), the verify 1.25 s and the plain step after it
    1.5 s (its host work no longer overlapped): the verify's price is 2 s, and no plain step is
    measured with the drafts in it."""
    from nanograph.spec import payoff as payoff_module
    from nanograph.spec.payoff import PROBE_EVERY, WEIGHT, Payoff
    now = 0.0
    monkeypatch.setattr(payoff_module, "clock", lambda: now)
    payoff = Payoff()

    def step(kind: str, seconds: float):
        nonlocal now
        now += seconds
        payoff.tick(kind)

    step("prefill", 1.0)
    for _ in range(3):
        assert not payoff.allows()  # nothing drafts before a plain step is measured
        step("decode", 1.0)
    assert payoff.plain == 1.0 and payoff.allows()  # a verify's price: not yet known
    for kind, seconds in (("decode", 1.25), ("verify", 1.25), ("decode", 1.5)):
        step(kind, seconds)
    assert payoff.plain == 1.0 and payoff.verify == 1.25 + 1.25 + 1.5 - 2 * 1.0
    payoff.tokens = 2.5  # 2.5 tokens a row for 2 s, where plain steps give 2: drafts pay
    assert payoff.allows()
    payoff.tokens = 1.5  # they do not: only a probe, PROBE_EVERY prices after the last verify
    last_verify = now - 1.5
    now = last_verify + PROBE_EVERY * 2.0 - 0.1
    assert not payoff.allows()
    now += 0.1
    assert payoff.allows()
    step("verify", 1.0)  # a verify after a verify: its interval is its whole price
    step("verify", 4.0)
    assert payoff.verify == 2.0 + WEIGHT * (4.0 - 2.0)


# ---- prompt lookup --------------------------------------------------------------------------

def propose_ngram(tokens: list[int], num_speculative_tokens: int, prompt_lookup_min: int,
                  prompt_lookup_max: int) -> list[int]:
    """The oracle of spec/ngram.py's rule: the draft for one sequence, k tokens, or [] when its
    last n tokens (any n in [min, max]) never occurred before."""
    length = len(tokens)
    for n in range(min(prompt_lookup_max, length - 1), prompt_lookup_min - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):  # the most recent occurrence first
            if tokens[end - n:end] == suffix:
                period = length - end
                return [tokens[end + j % period] for j in range(num_speculative_tokens)]
    return []


def test_ngram_takes_the_longest_suffix_then_its_most_recent_occurrence():
    # [1, 2] occurred once (followed by 9); [2] alone most recently at index 5 (followed by 8)
    tokens = [7, 1, 2, 9, 5, 2, 8, 1, 2]
    assert propose_ngram(tokens, 2, prompt_lookup_min=1, prompt_lookup_max=2) == [9, 5]
    assert propose_ngram(tokens, 2, prompt_lookup_min=1, prompt_lookup_max=1) == [8, 1]
    assert propose_ngram(tokens, 2, prompt_lookup_min=3, prompt_lookup_max=4) == []
    # [2, 9, 2, 9] last occurred ending at 6: the copy runs on into its own drafts, period 2
    assert propose_ngram([5, 2, 9, 2, 9, 2, 9], 5, 2, 4) == [2, 9, 2, 9, 2]
    # vLLM's docstring example, [2, 3] followed by [4, 2, 3] and then the copy repeats
    assert propose_ngram([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3, 4]
    assert propose_ngram([3], 4, 1, 3) == [] and propose_ngram([3, 3], 3, 1, 3) == [3, 3, 3]


def test_the_engine_s_search_equals_the_oracle_on_random_sequences():
    """spec/ngram.py's bytes search against the loop above: small alphabets (many matches, and
    hits straddling two tokens), large ones (few), ids up to 2**31 - 1."""
    rng = random.Random(0)
    for trial in range(2000):
        alphabet = rng.choice([2, 3, 5, 50, 2**16 + 1, 2**31 - 1])
        low = rng.randint(1, 3)
        high = rng.randint(low, 5)
        k = rng.randint(1, 5)
        seq = [rng.randrange(alphabet) for _ in range(rng.randint(1, 60))]
        assert propose_ngram_fast(seq, k, low, high) == propose_ngram(seq, k, low, high), seq


# ---- verification ---------------------------------------------------------------------------
def test_bench_mechanics_run_at_the_set_acceptance(tmp_path):
    """bench.py --spec (a)'s measurement on the tiny model: its random drafts are accepted at the
    set rate (a model accepts next to none of them), so the counters read that rate back: every
    draft at 1.0, about 0.7 of them per draft at 0.7 (4 standard deviations over some 140
    verifies)."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import parse_args
    from benchmarks.harness import build_setup
    from benchmarks.spec import MIN_SEQUENCES, SPEC_K, cell_batches, time_forced
    from nanograph import SamplingParams

    setup = build_setup(parse_args(["--quick", "--device", "cpu", "--spec"]), str(tmp_path),
                        "qwen3-0.6b")
    prompts = [prompt[:8] for prompt in setup.workload.prompts]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    spec = setup.llm(max_model_len=80, speculative_config={"num_speculative_tokens": SPEC_K})
    runs = {acceptance: time_forced(spec, [prompts], params, "cpu", acceptance,
                                    disable_by_batch_size=len(prompts), payoff=False)
            for acceptance in (1.0, 0.7)}
    spec.close()
    assert runs[1.0]["accepted_tokens"] == runs[1.0]["draft_tokens"] > 0
    assert runs[0.7]["verifies"] > 100
    assert abs(runs[0.7]["measured_acceptance"] - 0.7) < 0.1
    # a batch-1 cell times MIN_SEQUENCES different prompts, one after another
    assert cell_batches(prompts, 1) == [[prompt] for prompt in prompts[:MIN_SEQUENCES]]
    assert cell_batches(prompts, 64) == [prompts[:64]]


def test_bench_spec_batches_picks_the_batch_sizes(tmp_path):
    """bench.py --spec --spec-batches 1: both parts of the section measure batch 1 only (a cheap
    call for the batch-1 targets), where --quick alone measures 1 and 4."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import parse_args
    from benchmarks.harness import build_setup
    from benchmarks.spec import section_spec

    args = parse_args(["--quick", "--device", "cpu", "--spec", "--spec-batches", "1"])
    section = section_spec(build_setup(args, str(tmp_path), "qwen3-0.6b"))
    assert {row["batch"] for row in section["mechanics"]} == {1}
    assert {row["batch"] for row in section["demo_drafts"]} == {1}
    assert section["mechanics"][0]["plain_tok_s"] > 0
