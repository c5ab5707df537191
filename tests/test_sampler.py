"""Sampling: top-k / top-p masks, greedy, the exponential race's distribution, seeds."""
import torch

from conftest import hf_greedy
from nanograph import LLM, SamplingParams
from nanograph.layers.sampler import SamplingBatch, sample, top_k_top_p_filter


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3], [0.25] * 4]))
    out = top_k_top_p_filter(logits, torch.tensor([2, 4, 4]), torch.tensor([1.0, 0.65, 0.5]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [[False, True, False, True],     # top-2: 0.4, 0.3
                             [False, True, False, True],     # 0.4 + 0.3 reaches 0.65
                             [True, True, False, False]]     # ties: 2 of 4 reach 0.5
    assert torch.equal(out[kept], logits[kept])


def batch(temps, generators=None, top_ks=None, top_ps=None):
    t = torch.tensor(temps, dtype=torch.float)
    return SamplingBatch(t, all(x == 0 for x in temps), top_ks, top_ps, generators or [None] * len(temps))


def test_sampling_follows_the_distribution_and_greedy_rows_take_argmax():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4).clone()
    tokens = sample(logits, batch([1.0] * 20000))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)
    mixed = sample(torch.randn(6, 50), batch([0, 1, 0, 1, 0, 1]))
    assert mixed.shape == (6,)
    logits = torch.randn(3, 50)
    assert torch.equal(sample(logits, batch([0, 0, 0])), logits.argmax(-1))


def test_low_temperature_and_top_k_1_are_greedy():
    logits = torch.randn(8, 100)
    assert torch.equal(sample(logits, batch([1e-4] * 8)), logits.argmax(-1))
    ks, ps = torch.ones(8, dtype=torch.long), torch.ones(8)
    assert torch.equal(sample(logits, batch([2.0] * 8, top_ks=ks, top_ps=ps)), logits.argmax(-1))


def test_seeded_generator_rows_are_reproducible():
    logits = torch.randn(4, 1000)
    a = sample(logits, batch([1.0] * 4, [torch.Generator().manual_seed(7), None, None, None]))
    b = sample(logits, batch([1.0] * 4, [torch.Generator().manual_seed(7), None, None, None]))
    assert a[0] == b[0]


def test_seeded_request_reproduces_whatever_its_batch(tiny_model):
    path = tiny_model("qwen3")
    llm = LLM(path, kvcache_block_size=16)
    prompt = [5, 9, 31, 77, 120, 3]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    crowd = llm.generate([[7, 8, 9], prompt, [100] * 20], [others, seeded, others], use_tqdm=False)
    assert crowd[1]["token_ids"] == alone
    unseeded = [llm.generate([prompt], others, use_tqdm=False)[0]["token_ids"] for _ in range(2)]
    assert unseeded[0] != unseeded[1] or unseeded[0] != alone   # sampling is actually random
    assert alone != hf_greedy(path, [prompt], 16)[0]
