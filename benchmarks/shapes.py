"""Public model shapes with random weights: nothing to download, the same shape for every engine.

Each shape is the config.json of a public checkpoint (Qwen3 0.6B/1.7B/4B/8B, Llama 3.2-1B, Llama
3.1-8B: the values of their HF configs). nanograph builds it with `load_format="dummy"`; decode
speed does not depend on the weights' values, only on their shapes and dtype. `--quick` runs the
tiny model of each shape's family instead, small enough for two CPU cores.
"""
import os


def llama3_rope(factor: float) -> dict:
    return dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)


QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
             head_dim=128, num_key_value_heads=8, rope_theta=1_000_000.0,
             max_position_embeddings=40960, rms_norm_eps=1e-6, eos_token_id=151645,
             bos_token_id=151643)
LLAMA3 = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
              num_key_value_heads=8, rope_theta=500_000.0, max_position_embeddings=131072,
              rms_norm_eps=1e-5, eos_token_id=128001, bos_token_id=128000)
# --quick: small enough that the whole bench runs in seconds on two CPU cores
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=1,
            bos_token_id=0, tie_word_embeddings=True)

SHAPES = {
    "qwen3-0.6b": dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-1.7b": dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-4b": dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=True),
    "qwen3-8b": dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False),
    "llama3.2-1b": dict(LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, head_dim=64, tie_word_embeddings=True,
                        rope_scaling=llama3_rope(32.0)),
    "llama3.1-8b": dict(LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, head_dim=128, tie_word_embeddings=False,
                        rope_scaling=llama3_rope(8.0)),
    "tiny": dict(QWEN3, **TINY, max_position_embeddings=4096),
    "tiny-llama": dict(LLAMA3, **TINY, max_position_embeddings=16384,
                       rope_scaling=llama3_rope(32.0)),
}
BENCH_SHAPES = [name for name in SHAPES if not name.startswith("tiny")]


def quick_shape(shape: str) -> str:
    """The tiny model of a shape's family, for --quick."""
    return "tiny-llama" if SHAPES[shape]["model_type"] == "llama" else "tiny"


def write_model_dir(shape: str, root: str) -> str:
    """config.json of a shape, with its model_type and architectures, as HF would write it."""
    from transformers import AutoConfig
    config = dict(SHAPES[shape])
    path = os.path.join(root, shape)
    AutoConfig.for_model(config.pop("model_type"), **config).save_pretrained(path)
    return path
