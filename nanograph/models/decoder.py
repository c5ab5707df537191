"""One decoder-only transformer covering the Llama, Qwen2 and Qwen3 families.

The three differ only in small switches read from the HF config:
- Qwen2 (and Llama with `attention_bias`): a bias on the Q/K/V projections;
- Qwen3: RMSNorm over each query and key head before rotary ("qk-norm"), no bias;
- Llama 3.x: scaled rotary frequencies (see rotary.py); all: GQA, tied or untied LM head.

The forward pass takes a flat batch of tokens ([num_tokens]), not [batch, seq]: prefill chunks of
different lengths and decode tokens are concatenated, and attention finds each token's sequence
through the per-step metadata. The parameter names match the HF checkpoints, except that
q/k/v and gate/up are fused; `packed_modules` tells the loader how to fill the fused weights.
"""
import torch.nn.functional as F
from torch import nn

from nanograph.layers.attention import Attention
from nanograph.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanograph.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear, gemv_max_rows, tp_size, use_gemv)
from nanograph.layers.norm import RMSNorm
from nanograph.layers.rotary import RotaryEmbedding
from nanograph.utils.compile import cuda_compiled
from nanograph.utils.context import get_step_metadata


def head_dim(cfg):
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


@cuda_compiled
def silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def defer_norm(x):
    """Whether the norm of `x` is deferred into the GEMV that reads it (see norm.py): at small
    decode batches on CUDA, and in a LoRA step only where a fold has made the GEMV's h
    (layers/lora_slots.py): not the first layer's, nor with tp > 1."""
    md = get_step_metadata()
    return use_gemv(x) and not (md.lora_rank and md.lora_fold is None)


class DecoderAttention(nn.Module):
    def __init__(self, cfg, rope: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim(cfg)
        bias = getattr(cfg, "attention_bias", cfg.model_type == "qwen2")
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        bias and cfg.model_type != "qwen2")
        # Qwen3's per-head qk-norm, applied (fused with rotary) by attn
        qk_norm = cfg.model_type == "qwen3"
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.head_dim ** -0.5, rope, self.q_norm, self.k_norm)

    def forward(self, positions, x, residual):
        heads = self.qkv_proj(x).unflatten(-1, (-1, self.head_dim))
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(positions, q, k, v).flatten(1), residual)


class DecoderMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size,
                                                       [cfg.intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias)

    def forward(self, x, residual):
        # the GEMV applies the activation itself (after the LoRA delta, kernels/gemv.py)
        gate_up = self.gate_up_proj(x, silu_and_mul=True) if use_gemv(x) \
            else silu_and_mul(self.gate_up_proj(x))
        return self.down_proj(gate_up, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, rope)
        self.mlp = DecoderMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual):
        # residual carries the un-normalised stream
        x, residual = self.input_layernorm(x, residual, defer_norm(x))
        x = self.self_attn(positions, x, residual)
        x, residual = self.post_attention_layernorm(x, residual, defer_norm(x))
        return self.mlp(x, residual), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rope = dict(getattr(cfg, "rope_parameters", None)
                    or getattr(cfg, "rope_scaling", None)
                    or {})
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        rotary = RotaryEmbedding(head_dim(cfg), cfg.max_position_embeddings, rope)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class DecoderForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules = {"q_proj": ("qkv_proj", "q"),
                      "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg):
        super().__init__()
        if cfg.model_type not in ("llama", "qwen2", "qwen3"):
            raise ValueError(
                f"model_type {cfg.model_type!r} is not supported (llama, qwen2, qwen3 are)")
        self.model = DecoderModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        widest_input = max(cfg.hidden_size,
                           cfg.num_attention_heads * head_dim(cfg) // tp_size(),
                           cfg.intermediate_size // tp_size())
        for module in self.modules():
            if hasattr(module, "gemv_rows"):
                module.gemv_rows = gemv_max_rows(widest_input)

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)

    def lora_folds(self):
        """(producer, consumer, norm): the consumer's input is norm(the producer's output + the
        residual stream). With one rank and no bias in the producer, the consumer's LoRA shrink
        folds into the producer's (layers/lora_slots.py)."""
        layers = self.model.layers
        folds = [(layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.post_attention_layernorm)
                 for layer in layers]
        folds += [(a.mlp.down_proj, b.self_attn.qkv_proj, b.input_layernorm)
                  for a, b in zip(layers, layers[1:])]
        return [fold for fold in folds if fold[0].bias is None] if tp_size() == 1 else []
