"""Bad input gets a ValueError naming the request and the reason, before any work; the engine stays usable."""
import pytest
import torch

from nanograph import LLM, SamplingParams
from nanograph.config import Config


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("qwen3"), kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=256)


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "request 1: empty prompt"),
    ([1] * 300, SamplingParams(), "request 1: prompt has 300 tokens, max_model_len=256"),
    ([1, 320], SamplingParams(), "request 1: token id 320 is outside the vocabulary"),
    ([1, -1], SamplingParams(), "request 1: token id -1"),
    ("hello", SamplingParams(), "request 1: text prompt but model"),
    ([1] * 100, SamplingParams(max_tokens=100), "request 1: needs up to 13 KV blocks"),
])
def test_bad_request_is_rejected_before_any_work(llm, prompt, params, message):
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        llm.generate([[5, 6, 7], prompt], [good, params], use_tqdm=False)
    assert not llm.scheduler.waiting and not llm.scheduler.running
    assert llm.block_manager.num_free_blocks == 8
    out = llm.generate([[5, 6, 7]], good, use_tqdm=False)   # still usable afterwards
    assert len(out[0]["token_ids"]) == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_k=0), "top_k must be -1"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path_and_bad_knobs(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="not a local directory and could not be fetched"):
        LLM(str(tmp_path / "missing" / "model"))
    with pytest.raises(ValueError, match="could not be fetched from the hub"):
        LLM("nanograph-test/definitely-not-a-model")
    with pytest.raises(ValueError, match="kvcache_block_size must be a power of two"):
        LLM(tiny_model("qwen3"), kvcache_block_size=24)
    with pytest.raises(ValueError, match="max_lora_rank must be an integer >= 1"):
        LLM(tiny_model("qwen3"), max_lora_rank=0)


@pytest.mark.parametrize("knobs, message", [
    (dict(max_model_len="big"), "max_model_len must be an integer >= 1, got 'big'"),
    (dict(num_kvcache_blocks=2.5), "num_kvcache_blocks must be an integer"),
    (dict(dtype="int8"), "dtype must be 'auto' or one of"),
    (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization must be in"),
    (dict(device="cuda"), "device='cuda', but CUDA is not available"),
    (dict(attention_backend="triton"), "attention_backend='triton' needs CUDA"),
    (dict(attention_backend="flash_attn"), "attention_backend='flash_attn' needs CUDA"),
])
def test_bad_knobs_are_value_errors_naming_them(tiny_model, monkeypatch, knobs, message):
    if torch.cuda.is_available() and ("device" in knobs or "attention_backend" in knobs):
        pytest.skip("CUDA is here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (set by conftest for the kernels)
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model("qwen3"), **knobs)


def test_vllms_block_size_is_kvcache_block_size(tiny_model):
    llm = LLM(tiny_model("qwen3"), block_size=16, num_kvcache_blocks=8, max_model_len=64)
    assert llm.config.kvcache_block_size == llm.block_manager.block_size == 16
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 20  # over more than one block


@pytest.mark.parametrize("kwargs", [dict(temperature="0.7"), dict(temperature=None),
                                    dict(top_p="0.5"), dict(ignore_eos="no"),
                                    dict(skip_special_tokens=None), dict(n="2"),
                                    dict(include_stop_str_in_output=1),
                                    dict(prompt_logprobs=-1), dict(prompt_logprobs=1.5)])
def test_sampling_params_check_every_fields_type(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingParams(**kwargs)


def test_sampling_params_take_max_tokens_none_and_prompt_logprobs():
    params = SamplingParams(max_tokens=None, min_tokens=5, prompt_logprobs=3)
    assert params.max_tokens is None and params.prompt_logprobs == 3


def test_flash_attn_needs_block_size_256(tiny_model):
    from nanograph.kernels.backends import check_flash_attn  # (config.py's check, on CUDA)
    with pytest.raises(ValueError, match="flash_attn' needs kvcache_block_size=256"):
        check_flash_attn(Config(tiny_model("qwen3"), kvcache_block_size=16))


def test_generate_after_close_is_a_clear_error(tiny_model):
    llm = LLM(tiny_model("qwen3"), kvcache_block_size=16, num_kvcache_blocks=8)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]], use_tqdm=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=float("nan")), "temperature must be >= 0 and finite, got nan"),
    (dict(temperature=float("inf")), "temperature must be >= 0 and finite, got inf"),
    (dict(top_p=float("nan")), "top_p must be in"),
    (dict(top_p=float("inf")), "top_p must be in"),
    (dict(max_tokens=2.5), "max_tokens must be an integer or None, got 2.5"),
    (dict(max_tokens=True), "max_tokens must be an integer or None, got True"),
    (dict(top_k=1.5), "top_k must be an integer, got 1.5"),
    (dict(seed=1.5), "seed must be an integer or None, got 1.5"),
    (dict(seed="7"), "seed must be an integer or None, got '7'"),
    (dict(stop_token_ids=[-3]), "stop_token_ids must be a list of token ids >= 0, got \\[-3\\]"),
    (dict(stop_token_ids=[2.0]), "stop_token_ids must be a list"),
    (dict(stop_token_ids=7), "stop_token_ids must be a list"),
])
def test_malformed_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_token_outside_vocabulary_is_rejected_at_intake(llm):
    with pytest.raises(ValueError, match="request 0: stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
