"""Train nanograph's demo model: a tiny Qwen3 that writes Python.

nanograph ships a model it trained itself so that ``python example.py`` can
generate real code offline, with nothing downloaded. This script produces that
model from data every Python install already has: the standard library source.

How it works, and why:

* Data. Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (minus
  ``site-packages`` and the few test files that are not valid UTF-8), in sorted
  order. About 3% of the files are held out for validation, chosen by a hash of
  the relative path, so the split is the same on every machine and every run.
* Tokenizer. A byte-level BPE with 4096 tokens trained on the training files.
  Newlines are split off before the byte-level step, so a prompt that ends in
  "\\n" ends on the same token boundary the model saw in training (otherwise
  "\\n" would usually be merged with the next line's indentation). Files are
  joined with ``<|endoftext|>``, which is also the model's EOS.
* Model. ``Qwen3ForCausalLM`` from transformers, about 7M parameters, so any
  Qwen3-capable engine (nanograph included) can load it; bf16 safetensors.
* Training. The token stream is one long packed sequence; each batch takes
  random 512-token windows from it. The data is small (3-10M tokens, by
  Python install), so the model sees it many times and would end up memorising
  it: the checkpoint with the best held-out loss is kept (early stopping).
  Training stops at ``--max-steps`` or when the wall-clock budget runs out,
  whichever comes first; the learning-rate schedule is defined over "progress",
  the larger of the step and time fractions, so the cosine decay ends on time
  however fast the GPU turns out to be.
* Metrics. Validation loss (nats per token on the held-out files) and a parse
  rate: greedy completions of 20 held-out function headers, cut at the first
  blank line, checked with ``ast.parse``. Both are measured on the saved files
  as reloaded with ``AutoModelForCausalLM``/``AutoTokenizer``, and written to
  ``metrics.json`` beside them.

Usage: ``python tools/train_demo_model.py --out DIR [--minutes 7]``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                          PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM)

EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
SEQ_LEN = 512
HELD_OUT_PERCENT = 3
PEAK_LR, MIN_LR_RATIO, WARMUP_STEPS = 3e-3, 0.1, 200
RESERVE_S = 60  # kept back from the time budget for saving, evaluation and generation


# --- Data -------------------------------------------------------------------

def stdlib_sources(root: Path | None = None) -> dict[str, str]:
    """Relative path -> source text of every UTF-8 ``*.py`` file in the stdlib, sorted."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    sources = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/"):
            continue
        try:
            sources[rel] = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:  # deliberately mis-encoded test data
            continue
    return sources


def is_held_out(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def held_out_function_headers(texts: list[str] | None = None, n: int = 20) -> list[str]:
    """``n`` top-level ``def ...:`` lines (plus "\\n") spread evenly over the held-out files."""
    if texts is None:
        texts = [t for rel, t in stdlib_sources().items() if is_held_out(rel)]
    headers = []
    for text in texts:
        for line in text.splitlines():
            line = line.rstrip()
            if line.startswith("def ") and line.endswith(":") and _parses(line + "\n    pass\n"):
                headers.append(line + "\n")
    if len(headers) <= n:
        return headers
    return [headers[i * len(headers) // n] for i in range(n)]


def parse_rate(headers: list[str], complete: Callable[[str], str]) -> float:
    """Fraction of headers that parse together with their (cut) completion.

    ``complete(prompt)`` returns generated text only; any engine can supply it.
    """
    ok = sum(_parses(h + _cut(complete(h))) for h in headers)
    return ok / max(len(headers), 1)


def _cut(completion: str) -> str:
    """Up to the first blank line; without one, generation ran out: drop the unfinished line."""
    if "\n\n" in completion:
        return completion.split("\n\n", 1)[0]
    return completion[:completion.rfind("\n") + 1]


def hf_completer(model, tokenizer, max_new_tokens: int = 128) -> Callable[[str], str]:
    """Greedy completion with Hugging Face ``generate``, returning only the new text."""
    def complete(prompt: str) -> str:
        inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return complete


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


# --- Tokenizer --------------------------------------------------------------

def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT,
                                   clean_up_tokenization_spaces=False)


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, each file followed by ``<|endoftext|>``."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch_fast(texts):
        ids.extend(enc.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


# --- Model and training -----------------------------------------------------

def build_model(eot_id: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, intermediate_size=768, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=2048, rms_norm_eps=1e-6,
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=eot_id, eos_token_id=eot_id,
                                               pad_token_id=eot_id)
    return model


def lr_factor(step: int, progress: float) -> float:
    """Linear warm-up over steps, then cosine decay to MIN_LR_RATIO over progress."""
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return min(1.0, (step + 1) / WARMUP_STEPS) * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * cosine)


def window_loss(model, windows: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over a batch of (seq_len + 1)-token windows."""
    with torch.autocast(windows.device.type, torch.bfloat16, enabled=windows.is_cuda):
        logits = model(input_ids=windows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten(), reduction="sum")


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, max_windows: int | None = None, batch: int = 64) -> float:
    """Mean loss per predicted token; windows overlap by one token so each is predicted once."""
    windows = [stream[s:s + SEQ_LEN + 1] for s in range(0, len(stream) - 1, SEQ_LEN)][:max_windows]
    full = [w for w in windows if len(w) == SEQ_LEN + 1]
    batches = [torch.stack(full[i:i + batch]) for i in range(0, len(full), batch)]
    batches += [w[None] for w in windows if len(w) < SEQ_LEN + 1]  # the short last window
    model.eval()
    total = sum(window_loss(model, b).item() for b in batches)
    model.train()
    return total / sum(b[:, 1:].numel() for b in batches)


def train(model, data: torch.Tensor, val: torch.Tensor, args, budget_s: float) -> tuple[int, int]:
    """Train until max steps or the time budget; returns (steps, tokens seen)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=PEAK_LR, betas=(0.9, 0.95), fused=data.is_cuda)
    gen = torch.Generator(data.device).manual_seed(args.seed)
    offsets = torch.arange(SEQ_LEN + 1, device=data.device)
    tokens_per_step = args.batch_size * SEQ_LEN
    step, logged_step, progress, next_log = 0, 0, 0.0, 0.0
    loss_sum = torch.zeros((), device=data.device)  # summed on device: no sync per step
    best_val, best_state = float("inf"), None
    start = time.time()
    while progress < 1.0:
        for group in opt.param_groups:
            group["lr"] = PEAK_LR * lr_factor(step, progress)
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (args.batch_size, 1),
                               device=data.device, generator=gen)
        loss = window_loss(model, data[starts + offsets]) / tokens_per_step
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        step += 1
        elapsed = time.time() - start
        progress = max(step / args.max_steps, elapsed / budget_s)
        if progress >= next_log or progress >= 1.0:
            val_loss = evaluate(model, val, max_windows=64)
            if val_loss < best_val:  # early stopping: the stdlib is small enough to memorise
                best_val, best_state = val_loss, {k: v.clone() for k, v in model.state_dict().items()}
            print(f"step {step:6d} | {100 * min(progress, 1):5.1f}% | "
                  f"train {loss_sum.item() / (step - logged_step):.3f} | "
                  f"val {val_loss:.3f} | "
                  f"lr {opt.param_groups[0]['lr']:.2e} | {step * tokens_per_step / elapsed:,.0f} tok/s",
                  flush=True)
            loss_sum.zero_()
            logged_step, next_log = step, next_log + 0.05
    model.load_state_dict(best_state)
    print(f"kept the checkpoint with the best held-out loss, {best_val:.3f}")
    return step, step * tokens_per_step


# --- Main -------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    p.add_argument("--minutes", type=float, default=7.0, help="total wall-clock budget")
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=64, help="sequences of 512 tokens per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-files", type=int, default=None, help="use fewer files (smoke runs)")
    p.add_argument("--stdlib", type=Path, default=None,
                   help="a CPython standard library directory (default: this interpreter's)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    t0 = time.time()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    sources = stdlib_sources(args.stdlib)
    train_texts = [t for rel, t in sources.items() if not is_held_out(rel)][:args.max_files]
    val_texts = [t for rel, t in sources.items() if is_held_out(rel)]
    if args.max_files:
        val_texts = val_texts[:max(1, args.max_files * HELD_OUT_PERCENT // 100)]
    tokenizer = train_tokenizer(train_texts)
    data = encode_stream(tokenizer, train_texts).to(device)
    val = encode_stream(tokenizer, val_texts).to(device)
    print(f"{len(train_texts)} train files ({len(data):,} tokens), "
          f"{len(val_texts)} held-out files ({len(val):,} tokens), data ready in {time.time() - t0:.0f}s")

    model = build_model(tokenizer.eos_token_id).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")
    budget_s = args.minutes * 60 - (time.time() - t0) - RESERVE_S
    if budget_s <= 0:
        sys.exit(f"data preparation used up the {args.minutes}-minute budget; raise --minutes")
    t_train = time.time()
    steps, tokens = train(model, data, val, args, budget_s)
    train_s = time.time() - t_train

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.out).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    headers = held_out_function_headers(val_texts)
    metrics = {
        "val_loss": round(evaluate(model, val), 4),
        "parse_rate": parse_rate(headers, hf_completer(model, tokenizer)),
        "headers": len(headers),
        "parameters": n_params,
        "train_tokens": tokens,
        "steps": steps,
        "train_seconds": round(train_s, 1),
        "tokens_per_second": round(tokens / train_s),
        "wall_seconds": round(time.time() - t0, 1),
        "python": sys.version.split()[0],
        "stdlib": str(args.stdlib or sysconfig.get_paths()["stdlib"]),
        "seed": args.seed,
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
