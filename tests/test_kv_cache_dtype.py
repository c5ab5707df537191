"""kv_cache_dtype="fp8": the KV cache in float8 e4m3 (kernels/kv_store.py). On the CPU the torch
backend stores K/V rounded to e4m3 as the kernels do and attends in the model's dtype."""
import pytest
import torch

from nanograph import LLM, SamplingParams
from nanograph.config import Config
from nanograph.engine import model_runner


def test_bad_kv_cache_dtype(tiny_model):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Config(tiny_model("qwen3"), kv_cache_dtype="fp16")
    from nanograph.kernels.backends import check_flash_attn  # (config.py's check, on CUDA)
    with pytest.raises(ValueError, match="'flash_attn' cannot read kv_cache_dtype='fp8'"):
        check_flash_attn(Config(tiny_model("qwen3"), kv_cache_dtype="fp8"))


def test_fp8_cache_blocks_by_bytes_and_greedy_tokens(tiny_model, monkeypatch):
    """A cache budget of 1 MiB holds 4x the blocks in fp8 as in the float32 model's dtype; greedy
    completions stay close to those of a float32 cache: every first token the same, at least half
    of all tokens before each completion's first difference (rounding K/V to e4m3 moves the
    logits a little; the tiny random model has near-ties, and after one flips a completion goes
    its own way)."""
    monkeypatch.setattr(model_runner, "CPU_KV_CACHE_BYTES", 1 << 20)
    prompts = [[(7 * i + 3 * j) % 300 + 2 for j in range(20 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    blocks, tokens = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(tiny_model("qwen3"), kv_cache_dtype=kv_cache_dtype, kvcache_block_size=16,
                 max_model_len=256) as llm:
            stats = llm.stats()
            blocks[kv_cache_dtype] = stats["num_kvcache_blocks"]
            expected = {"auto": "float32", "fp8": "float8_e4m3fn"}[kv_cache_dtype]
            assert stats["kv_cache_dtype"] == expected
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[kv_cache_dtype] = [out["token_ids"] for out in outs]
    assert blocks["fp8"] == 4 * blocks["auto"]
    # tokens until each completion's first difference from the float32 cache's
    same = [next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref))
            for ref, out in zip(tokens["auto"], tokens["fp8"])]
    print("fp8 against auto, identical prefix lengths:", same)  # [9, 3, 16, 16, 9, 14] when written
    assert min(same) >= 1 and sum(same) >= len(prompts) * 16 // 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_graphs_give_eager_tokens(tiny_model):
    """The Triton kernels with an fp8 cache, graphs against eager, and against the torch oracle
    (which rounds K/V as the kernels do): the batch shrinks from 6 to 1 as completions end, so
    both decode paths (split, and fused at batch <= 4) run."""
    prompts = [[(7 * i + 3 * j) % 300 + 2 for j in range(20 + 9 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(6)]
    tokens = {}
    for name, kwargs in (("graphs", {}), ("eager", dict(enforce_eager=True)),
                         ("torch", dict(enforce_eager=True, attention_backend="torch"))):
        with LLM(tiny_model("qwen3"), kv_cache_dtype="fp8", kvcache_block_size=16, max_model_len=256,
                 num_kvcache_blocks=64, dtype="float32", **kwargs) as llm:
            assert llm.runner.kv_cache.dtype == torch.float8_e4m3fn
            tokens[name] = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["graphs"] == tokens["eager"] == tokens["torch"]


def fp8_tokens(path, prompts, generations=1, lora_request=None, **knobs):
    """Greedy token ids of the last of `generations` generate calls with an fp8 cache (float32
    model, torch backend), and the stats."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(path, kv_cache_dtype="fp8", kvcache_block_size=16, max_model_len=256,
             dtype="float32", **knobs) as llm:
        for _ in range(generations):
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        return [out["token_ids"] for out in outs], llm.stats()


def test_fp8_with_prefix_caching_preemption_drafts_and_lora(tiny_model, adapters):
    """Each feature on an fp8 cache gives the tokens of a plain fp8 run: cached prefixes and
    recomputed (preempted) sequences read the same e4m3 K/V, drafts are checked against it, and
    adapters batched with the base model give what each gives alone."""
    path = tiny_model("qwen3")
    shared = [(5 * j) % 200 + 2 for j in range(40)]
    prompts = [shared + [(11 * i + j) % 300 + 2 for j in range(3 + 6 * i)] for i in range(5)]
    plain, _ = fp8_tokens(path, prompts, enable_prefix_caching=False)
    # 5 x ~90 tokens need ~30 blocks of 16: 14 force preemption; the 2nd call hits the cache
    cached, stats = fp8_tokens(path, prompts, generations=2, num_kvcache_blocks=14)
    assert cached == plain
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["preemptions"] > 0
    drafts = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8,
              "disable_by_payoff": False}
    spec, stats = fp8_tokens(path, prompts, speculative_config=drafts)
    assert spec == plain and stats["spec_decode_num_drafts"] > 0
    requests = adapters("qwen3")
    loras = [requests["qv8"], None, requests["all16"], None, requests["qv8"]]
    batched, _ = fp8_tokens(path, prompts, enable_lora=True, max_lora_rank=16,
                            lora_request=loras)
    alone = [fp8_tokens(path, [prompt], enable_lora=True, max_lora_rank=16,
                        lora_request=[lora])[0][0] for prompt, lora in zip(prompts, loras)]
    assert batched == alone
    assert batched[1] == plain[1] and batched[0] != plain[0]  # (an adapter changes the output)
