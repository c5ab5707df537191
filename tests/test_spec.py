"""Speculative decoding's building blocks: prompt-lookup drafts (the host oracle and the batched
tensor version, also captured in a CUDA graph) and the bench's forced acceptance. The engine's use
of them (outputs equal to plain decoding) is tests/test_spec_engine.py."""
import random

import pytest
import torch

from nanograph.spec.ngram import propose_ngram_batched


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


def test_batched_ngram_equals_the_host_version_on_random_sequences():
    rng = random.Random(0)
    for trial in range(30):
        rows, width = 16, 40
        alphabet = rng.choice([2, 3, 5, 50])  # small: many matches; 50: few
        low = rng.randint(1, 3)
        high = rng.randint(low, 5)
        k = rng.randint(1, 5)
        seqs = [[rng.randrange(alphabet) for _ in range(rng.randint(1, width))]
                for _ in range(rows)]
        # past each sequence: junk that must not be matched
        tokens = torch.tensor([s + [rng.randrange(alphabet) for _ in range(width - len(s))]
                               for s in seqs])
        drafts, num_drafts = propose_ngram_batched(tokens, torch.tensor([len(s) for s in seqs]),
                                                   k, low, high)
        for row, seq in enumerate(seqs):
            expected = propose_ngram(seq, k, low, high)
            assert num_drafts[row] == len(expected), (trial, seq)
            assert drafts[row, :len(expected)].tolist() == expected, (trial, seq)


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
    from benchmarks.spec import SPEC_K, time_forced
    from nanograph import SamplingParams

    setup = build_setup(parse_args(["--quick", "--device", "cpu", "--spec"]), str(tmp_path),
                        "qwen3-0.6b")
    prompts = [prompt[:8] for prompt in setup.workload.prompts]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    spec = setup.llm(max_model_len=80, speculative_config={"num_speculative_tokens": SPEC_K})
    runs = {acceptance: time_forced(spec, prompts, params, "cpu", acceptance,
                                    disable_by_batch_size=len(prompts))
            for acceptance in (1.0, 0.7)}
    spec.close()
    assert runs[1.0]["accepted_tokens"] == runs[1.0]["draft_tokens"] > 0
    assert runs[0.7]["verifies"] > 100
    assert abs(runs[0.7]["measured_acceptance"] - 0.7) < 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_ngram_captures_in_a_cuda_graph():
    """Prompt lookup runs on the device without a host round trip: captured in a CUDA graph,
    whose replay on new inputs equals the eager run, and the eager run equals the CPU's."""
    generator = torch.Generator().manual_seed(7)
    rows, width, k = 64, 512, 4
    history = torch.randint(0, 8, (rows, width), generator=generator)  # repetitive: matches
    lengths = torch.randint(2, width, (rows,), generator=generator)
    on_cpu = propose_ngram_batched(history, lengths, k, 1, 3)
    static = [history.cuda(), lengths.cuda()]
    eager = propose_ngram_batched(*static, k, 1, 3)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(eager, on_cpu))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = propose_ngram_batched(*static, k, 1, 3)
    for tensor in static:  # new sequences and lengths in the same buffers
        tensor.copy_(tensor.roll(1, dims=0))
    graph.replay()
    again = propose_ngram_batched(*static, k, 1, 3)
    assert all(torch.equal(a, b) for a, b in zip(captured, again))
