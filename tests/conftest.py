"""Shared fixtures: tiny random HF checkpoints of each supported family, saved to a temp dir.

No weights can be downloaded here, so every test builds its model from a transformers config
class with a fixed seed and saves it (float32 safetensors + config + generation config); the
LoRA tests' PEFT adapters for those models are made here too, once per session.

Without CUDA the Triton kernels run in Triton's interpreter (the `*_interpreter` tests of
test_kernels.py); the variable must be set before triton is first imported, hence here. A test
that needs triton carries the `triton` marker (a whole module: `pytestmark = pytest.mark.triton`)
and is skipped, with the reason, where `import triton` fails.
"""
import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config, Qwen3Config


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: needs triton (skipped where it does not import)")


@functools.cache
def triton_missing() -> str | None:
    """Why `import triton` fails here, or None where it imports."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"needs triton ({type(e).__name__}: {e})"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("triton") and triton_missing():
            item.add_marker(pytest.mark.skip(reason=triton_missing()))


COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=0)

FAMILIES = {
    "qwen3": lambda: Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 tie_word_embeddings=True, rope_theta=1e6),
    "qwen2": lambda: Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "llama": lambda: LlamaConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    "llama3_rope": lambda: LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
                                       rope_theta=500000.0),
}


def save_tiny_model(path, family: str, seed: int = 0) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights so the greedy argmax is not a near-tie
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=1, bos_token_id=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: tiny_model("qwen3") -> path of a saved checkpoint (cached per family)."""
    cache = {}

    def make(family: str = "qwen3") -> str:
        if family not in cache:
            cache[family] = save_tiny_model(tmp_path_factory.mktemp(family), family)
        return cache[family]
    return make


ADAPTERS = {  # name -> LoraConfig arguments
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]),
    "all16": dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"], use_rslora=True),
    "mlp4": dict(r=4, lora_alpha=4, target_modules=["up_proj", "o_proj"]),
}


@pytest.fixture(scope="session")
def adapters(tiny_model, tmp_path_factory):
    """Factory: adapters("qwen3") -> {name: LoRARequest} of PEFT adapters saved for that model."""
    from peft import LoraConfig, get_peft_model
    from nanograph import LoRARequest
    cache = {}

    def make(family: str) -> dict:
        if family not in cache:
            cache[family] = {}
            for i, (name, kwargs) in enumerate(ADAPTERS.items()):
                torch.manual_seed(10 + i)
                base = AutoModelForCausalLM.from_pretrained(tiny_model(family), dtype=torch.float32)
                peft = get_peft_model(base, LoraConfig(init_lora_weights=False, **kwargs))
                with torch.no_grad():  # larger than PEFT's init, so every adapter moves the argmax
                    for pname, p in peft.named_parameters():
                        if "lora_" in pname:
                            p.mul_(3.0)
                path = tmp_path_factory.mktemp(f"{family}-{name}")
                peft.save_pretrained(path)
                cache[family][name] = LoRARequest(name, str(path))
        return cache[family]
    return make


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The oracle: HF transformers' own generate, one prompt at a time, greedy, EOS ignored."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, min_new_tokens=max_tokens)
        outs.append(out[0, len(prompt):].tolist())
    return outs


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tokenizer(path) -> None:
    """A real byte-level BPE tokenizer over the tiny models' 320 ids (trained here on a small
    corpus: multi-byte characters, words split across tokens), with a chat template; ids 0 / 1
    are BOS / EOS, as in the tiny configs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["def parse(line):\n    return line.split()\n\n", "the quick brown fox jumps over the lazy dog. ",
              "Hello, world! héllo wörld ✓ 日本語\n"] * 50
    tok.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)


@pytest.fixture(scope="session")
def text_model(tmp_path_factory):
    """Factory: text_model("qwen3") -> a tiny checkpoint with a tokenizer and a chat template."""
    cache = {}

    def make(family: str = "qwen3") -> str:
        if family not in cache:
            path = tmp_path_factory.mktemp(f"{family}-text")
            save_tiny_model(path, family)
            save_tokenizer(path)
            cache[family] = str(path)
        return cache[family]
    return make
