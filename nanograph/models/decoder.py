"""One decoder-only transformer covering the Llama, Qwen2 and Qwen3 families.

The three differ only in small switches read from the HF config:
- Qwen2 (and Llama with `attention_bias`): a bias on the Q/K/V projections;
- Qwen3: RMSNorm over each query and key head before rotary ("qk-norm"), no bias;
- Llama 3.x: scaled rotary frequencies (see rotary.py); all: GQA, tied or untied LM head.

The forward pass takes a flat batch of tokens ([num_tokens]), not [batch, seq]: prefill chunks of
different lengths and decode tokens are concatenated, and attention finds each token's sequence
through the per-step metadata. The parameter names match the HF checkpoints, except that
q/k/v and gate/up are fused; `packed_modules` tells the loader how to fill the fused weights.
The embedding is torch's (row `id` of a [vocab, hidden] weight), the LM head a linear layer of
the same shape; a tied head shares the embedding's weight tensor.

Each block is the textbook pre-norm pair, with the residual stream carried beside the hidden
state so that each add runs inside the norm that follows it (layers/norm.py):
    norm -> QKV -> rotary, K/V store and attention -> O        (attention)
    norm -> [gate | up] -> SiLU(gate) * up -> down            (MLP)
Extensions change a block from outside, by swapping modules in (llm.py installs them).
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanograph.layers.attention import Attention
from nanograph.layers.linear import Linear
from nanograph.layers.norm import RMSNorm
from nanograph.layers.rotary import RotaryEmbedding
from nanograph.utils.compile import cuda_compiled


def head_dim(cfg):
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


@cuda_compiled
def silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class DecoderAttention(nn.Module):
    def __init__(self, cfg, rope: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim(cfg)
        # (tensor parallelism leaves each rank its own heads: engine/tp.py)
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = getattr(cfg, "attention_bias", cfg.model_type == "qwen2")
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias)
        self.o_proj = Linear(q_size, [cfg.hidden_size], bias and cfg.model_type != "qwen2")
        # Qwen3's per-head qk-norm, applied (fused with rotary) by attn
        qk_norm = cfg.model_type == "qwen3"
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.head_dim ** -0.5, rope, self.q_norm, self.k_norm)

    def forward(self, positions, x):
        q, k, v = self.split_heads(self.qkv_proj(x))
        return self.o_proj(self.attn(positions, q, k, v).flatten(1))

    def split_heads(self, qkv):
        """[tokens, (Hq + 2 Hkv) D] -> q [tokens, Hq, D], k and v [tokens, Hkv, D]."""
        heads = qkv.unflatten(-1, (-1, self.head_dim))
        return heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)


class DecoderMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = Linear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias)
        self.down_proj = Linear(cfg.intermediate_size, [cfg.hidden_size], bias)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, rope)
        self.mlp = DecoderMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual):
        # residual carries the un-normalised stream
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        # (its weight left unset, not drawn at random: the loader fills it)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        rotary = RotaryEmbedding(head_dim(cfg), cfg.max_position_embeddings, cfg.rope_parameters)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class DecoderForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, part)
    packed_modules = {"q_proj": ("qkv_proj", 0),
                      "k_proj": ("qkv_proj", 1),
                      "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg):
        super().__init__()
        if cfg.model_type not in ("llama", "qwen2", "qwen3"):
            raise ValueError(
                f"model_type {cfg.model_type!r} is not supported (llama, qwen2, qwen3 are)")
        self.model = DecoderModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size])
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)
