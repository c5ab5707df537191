"""The chain: the decoder stack and the LM head, swapped in on CUDA, falling back above 16 rows.

`FastDecodeChain.install` replaces the model's `DecoderModel` and LM head with modules built
around the same modules (same parameters), whose forward runs a step of up to MAX_ROWS tokens as
below and any larger one through the textbook forward.

A layer on the chain, with the residual stream r beside the hidden state x:

    QKV     gemv(x + r, normed by input_layernorm as it loads; writes x + r, the new r)
    attn    the textbook attention (kernels/paged_decode.py rotates, stores and attends)
    O       gemv, then the bias (a row-parallel layer's `reduce`: the all-reduce, then the bias)
    gate_up gemv(o + r, normed by post_attention_layernorm; SiLU(gate) * up at its end)
    down    gemv, then the bias (or `reduce`)

A deferred norm's residual output is a fresh buffer that the GEMV's first program fills. The
kernel picks CUDA cores or tensor cores by rows: the GEMV reduces each row on CUDA cores, at
least one FMA per weight and row, holding whole rows (next_pow2(K) elements) in registers: the
fastest at one row, and at two where the model's widest product input K is at most 4,096
(`cuda_core_rows`). The tensor-core kernel makes the extra rows almost free and takes the rest,
up to 16. Where the rules come from: docs/experiments.md ("GEMV and tensor-core products").

LoRA on the chain. In a step with adapters every product gets its rows' deltas inside the GEMV
(lora/layer.py's `gemv_lora`): O and down shrink their input (and, folding, their consumer's
h too: `LoRALinear.shrink` with the residual stream), and QKV and gate/up take the fold's h,
their norms still deferred. A consumer whose producer has no fold (the first layer's QKV,
tensor parallelism, a producer with a bias) gets its norm run as a kernel and shrinks the normed
input itself.
"""
import torch
from torch import nn

from nanograph.engine.model_runner import RunnerExtension
from nanograph.kernels.gemv import gemv
from nanograph.lora.layer import LoRALinear
from nanograph.models.decoder import DecoderModel

MAX_ROWS = 16  # gemv.py's kernels take up to this many rows


def cuda_core_rows(widest_input: int) -> int:
    """Up to how many rows the CUDA-core GEMV runs a model whose widest product input is
    `widest_input` (the tensor-core kernel takes the rest up to MAX_ROWS): see above."""
    return 2 if widest_input <= 4096 else 1


def lora_of(linear) -> LoRALinear | None:
    """`linear` when it adds LoRA deltas this step."""
    return linear if isinstance(linear, LoRALinear) and linear.adapters.rank else None


class FastDecodeChain(RunnerExtension):
    def install(self, model):
        layer = model.model.layers[0]
        widest = max(layer.self_attn.qkv_proj.weight.shape[1],
                     layer.self_attn.o_proj.weight.shape[1],
                     layer.mlp.down_proj.weight.shape[1])
        model.model = FastDecoderModel(model.model, cuda_core_rows(widest))
        model.lm_head = FastLMHead(model.lm_head, cuda_core_rows(widest))


class FastDecoderModel(DecoderModel):
    """The textbook DecoderModel's own modules, run on the chain up to MAX_ROWS tokens."""

    def __init__(self, textbook: DecoderModel, cuda_core_rows: int):
        nn.Module.__init__(self)
        self.embed_tokens = textbook.embed_tokens
        self.layers = textbook.layers
        self.norm = textbook.norm
        self.cuda_core_rows = cuda_core_rows

    def forward(self, input_ids, positions):
        if input_ids.shape[0] > MAX_ROWS:
            return super().forward(input_ids, positions)
        # fold: the h that the last product made for the next one (LoRA), else None
        x, residual, fold = self.embed_tokens(input_ids), None, None
        for layer in self.layers:
            x, residual, fold = self.layer_forward(layer, positions, x, residual, fold)
        return self.norm(x, residual)[0]

    def layer_forward(self, layer, positions, x, residual, fold):
        attention, mlp = layer.self_attn, layer.mlp
        qkv, residual = self.normed_product(layer.input_layernorm, x, residual,
                                            attention.qkv_proj, fold)
        out = attention.attn(positions, *attention.split_heads(qkv)).flatten(1)
        x, fold = self.product(attention.o_proj, out, residual)
        activation, residual = self.normed_product(layer.post_attention_layernorm, x, residual,
                                                   mlp.gate_up_proj, fold, silu_and_mul=True)
        x, fold = self.product(mlp.down_proj, activation, residual)
        return x, residual, fold

    def normed_product(self, norm, x, residual, linear, fold, silu_and_mul=False):
        """linear(norm(x + residual)) of a column-parallel layer, and the new residual stream."""
        lora = lora_of(linear)
        if lora is not None and fold is None:  # no fold's h: the norm runs, the product shrinks
            x, residual = norm(x, residual)
            h, _ = lora.shrink(x)
            return self.gemv(x, linear, linear.bias, silu_and_mul, lora=lora.gemv_lora(h)), residual
        residual_out = None if residual is None else torch.empty_like(x)
        y = self.gemv(x, linear, linear.bias, silu_and_mul,
                      norm=norm, residual=residual, residual_out=residual_out,
                      lora=None if lora is None else lora.gemv_lora(fold))
        return y, (x if residual is None else residual_out)

    def product(self, linear, x, residual):
        """O's or down's output, and the h it folds for the next product (None without). Under
        tensor parallelism the layer's `reduce` sums the ranks' partial products, then adds the
        bias (engine/tp.py)."""
        lora, fold, gemv_lora = lora_of(linear), None, None
        if lora is not None:
            h, fold = lora.shrink(x, residual)
            gemv_lora = lora.gemv_lora(h)
        y = self.gemv(x, linear, None, lora=gemv_lora)
        if hasattr(linear, "reduce"):
            return linear.reduce(y), fold
        return (y if linear.bias is None else y + linear.bias), fold

    def gemv(self, x, linear, bias, silu_and_mul=False, norm=None, residual=None,
             residual_out=None, lora=None):
        return gemv(x, linear.weight, bias, silu_and_mul,
                    norm_weight=None if norm is None else norm.weight,
                    eps=0.0 if norm is None else norm.eps,
                    residual=residual,
                    residual_out=residual_out,
                    lora=lora,
                    tensor_cores=x.shape[0] > self.cuda_core_rows)


class FastLMHead(nn.Module):
    """The textbook LM head (its weight tied or not), through the GEMV up to MAX_ROWS rows."""

    def __init__(self, textbook: nn.Module, cuda_core_rows: int):
        super().__init__()
        self.textbook = textbook
        self.cuda_core_rows = cuda_core_rows

    def forward(self, hidden):
        if hidden.shape[0] > MAX_ROWS:
            return self.textbook(hidden)
        tensor_cores = hidden.shape[0] > self.cuda_core_rows
        logits = gemv(hidden, self.textbook.weight, tensor_cores=tensor_cores)
        # a vocabulary-parallel head (engine/tp.py) gathers every rank's slice of the logits
        return self.textbook.gather(logits) if hasattr(self.textbook, "gather") else logits
