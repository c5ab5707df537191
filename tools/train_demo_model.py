"""Train nanograph's demo model: a tiny Qwen3 that writes Python.

nanograph ships a model it trained itself so that ``python example.py`` can
generate real code offline, with nothing downloaded. This script produces that
model from data every Python install already has: the source of the standard
library and of the installed, permissively licensed packages.

How it works, and why:

* Data. The ``*.py`` files of the standard library (PSF licence) and of every
  installed distribution whose metadata grants a permissive licence (BSD, MIT,
  Apache, PSF, ISC, zlib, ...: ``License-Expression``, else the ``License`` field
  and the licence classifiers; a distribution with no permissive licence found,
  or with any copyleft or proprietary one, is skipped). A distribution's files
  are the ``*.py`` entries of its ``RECORD``; vendored copies (``_vendor``
  folders) are skipped, as are files that are not UTF-8, larger than 512 kB or
  with a line over 1,000 characters (generated tables). Files are deduplicated by
  content hash. Which packages and licences went in is written to the model's
  README. Every docstring of more than one line is cut to its first sentence, on
  one line (``short_docstrings``): library code is about one fifth docstrings,
  and the previous model, trained on them whole, spent 12 of its 13 unparsable
  64-token completions inside a docstring it never got to close. A model of 8M
  parameters is shown writing code, not Args sections; it still writes a
  one-line docstring where the code it learnt from had one.
* Split. Whole packages are held out, not files: packages are taken in the
  order of a hash of their name, each no larger than 1.5% of the corpus, until
  3% of the corpus is held out. The split depends only on what is installed, so
  it is the same on every run; a file of a training package that is identical to
  a held-out one is dropped. ``--max-mb`` then caps the training corpus (and the
  held-out set in proportion) with a hash-ordered subsample of files.
* Tokenizer. A byte-level BPE with 2048 tokens (``--vocab-size``) trained on
  the first 24 MB of the (hash-ordered) training files. A small vocabulary suits
  a tiny model: the embedding takes 0.66M of the parameters instead of 1.3M at
  4096 tokens, and each byte of text gets more compute; the price is about 10%
  fewer characters per 64-token completion (2.8 instead of 3.1 bytes per token
  on held-out code). Per-token losses of different tokenizers do not compare;
  bits per byte do, so both are reported. Newlines are split off before the
  byte-level step, so a prompt that ends in "\\n" ends on the same token boundary
  the model saw in training (otherwise "\\n" would usually be merged with the
  next line's indentation). ``<|endoftext|>`` precedes every file in training
  and is also added in front of every encoded prompt (and is the EOS): a prompt
  is read as the start of a file, at column 0. Without that marker the model
  cannot tell a top-level ``def`` from a method whose indentation fell outside
  its window.
* Model. ``Qwen3ForCausalLM`` from transformers: 7 layers of width 320, 5 query
  heads and 1 KV head of 64, the MLP as wide as a 8.25M-parameter budget allows
  (864 at 2048 tokens; 15.6 MiB in bf16, under the package's 16 MiB); any
  Qwen3-capable engine (nanograph included) loads it.
* Training. The token stream is one long packed sequence; each batch takes
  random 512-token windows from it (128 a step: large enough that a GPU whose
  CPUs are busy is not kept waiting by Python). Training stops at
  ``--max-steps`` or when the wall-clock budget runs out, whichever comes
  first; the learning-rate schedule is defined over "progress", the larger of
  the step and time fractions, so the cosine decay ends on time however fast
  the GPU turns out to be. The checkpoint with the best held-out loss is kept
  (early stopping), in case the data is small enough to be memorised.
* Metrics. Validation loss (nats per token, and bits per byte, on the held-out
  packages) and a parse rate: greedy completions (64 new tokens) of 20 held-out
  top-level function headers, cut where the function ends (the first line back
  at column 0, or the end of the file), or, when the 64 tokens run out first,
  after the last complete line; each is checked with ``ast.parse``. Everything is
  measured on the saved files as reloaded with ``AutoModelForCausalLM`` /
  ``AutoTokenizer``. ``metrics.json`` gets the figures, the checked completions
  and greedy completions of example.py's demo prompts; ``README.md`` (the model
  card) gets the data table, the figures and those completions.

Usage: ``python -m tools.train_demo_model --out DIR [--minutes 11] [--max-mb 320]``;
``--minutes`` is the whole run's wall clock: reading (~5 s), the tokenizer
(~10-20 s), encoding (~30-60 s on a few cores; stopped after 150 s whatever is
left), training, then ~75 s kept for saving and evaluation.
A smoke run on a CPU: ``--minutes 3 --max-mb 3 --device cpu --batch-size 4``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import json
import math
import multiprocessing
import os
import platform
import re
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                          PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM)

EOT = "<|endoftext|>"
VOCAB_SIZE = 2048  # default of --vocab-size
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 320, 7, 5, 1, 64
PARAM_BUDGET = 8_250_000  # 15.7 MiB in bf16; the MLP width is whatever fills it
SEQ_LEN = 512
HELD_OUT_PERCENT, HELD_OUT_MAX_PACKAGE_PERCENT = 3.0, 1.5
MAX_FILE_CHARS, MAX_LINE_CHARS = 512_000, 1_000
TOKENIZER_SAMPLE_MB = 24  # the BPE is trained on at most this much of the training text
ENCODE_LIMIT_S = 150  # a safety net: encoding stops (at a file boundary) after this long, what is done is used
PEAK_LR, MIN_LR_RATIO, WARMUP_STEPS = 3e-3, 0.1, 200
NEW_TOKENS = 64  # per completion, for the parse rate and the samples
RESERVE_S = 75  # kept back from the time budget for saving, evaluation and generation (+30 s for --baseline)
MAX_WEIGHTS_MIB = 16  # what the package may ship
SHIPPED_DIR = "nanograph/pretrained/pycoder"  # where the model is shipped (for the README's command line)
DEFAULT_PROMPTS = ["def parse_header(line):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
                   "import os\nimport sys\n"]

# SPDX ids counted as permissive (BSD, MIT, Apache, PSF and their kin).
PERMISSIVE_SPDX = {"MIT", "MIT-0", "BSD-2-Clause", "BSD-3-Clause", "0BSD", "Apache-2.0", "PSF-2.0",
                   "Python-2.0", "Python-2.0.1", "CNRI-Python", "ISC", "Zlib", "CC0-1.0", "Unlicense",
                   "BSL-1.0", "HPND", "NCSA", "X11"}
PERMISSIVE_TEXT = re.compile(r"\bMIT\b|\bBSD\b|Apache|\bPSF\b|Python Software Foundation|\bISC\b|zlib"
                             r"|Unlicense|Boost Software", re.I)
RESTRICTIVE_TEXT = re.compile(r"GPL|\bMPL\b|Mozilla|EUPL|\bEPL\b|Eclipse|CDDL|SSPL|Proprietary"
                              r"|Commercial|Business Source|\bBUSL\b|NVIDIA|Other/", re.I)


# --- Data -------------------------------------------------------------------

@dataclass
class Package:
    name: str
    version: str
    license: str
    files: dict[str, str] = field(default_factory=dict)  # path -> source text

    @property
    def nbytes(self) -> int:
        return sum(len(t) for t in self.files.values())


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _spdx_permissive(expression: str) -> bool:
    """An SPDX expression is permissive if AND-ed ids all are and some OR-ed alternative is."""
    tokens = re.findall(r"[()]|[^\s()]+", re.sub(r"\s+WITH\s+\S+", "", expression))

    def chain(i, op, operand, combine):  # expression := operand (op operand)*
        ok, i = operand(i)
        while i < len(tokens) and tokens[i].upper() == op:
            rhs, i = operand(i + 1)
            ok = combine(ok, rhs)
        return ok, i

    def any_of(i):
        return chain(i, "OR", all_of, lambda a, b: a or b)

    def all_of(i):
        return chain(i, "AND", atom, lambda a, b: a and b)

    def atom(i):
        if i < len(tokens) and tokens[i] == "(":
            ok, i = any_of(i + 1)
            return ok, i + 1
        return i < len(tokens) and tokens[i].rstrip("+") in PERMISSIVE_SPDX, i + 1

    ok, end = any_of(0)
    return ok and end == len(tokens)


def permissive_license(metadata) -> str | None:
    """The distribution's licence as recorded, if it is permissive; None otherwise (skip it)."""
    expression = (metadata.get("License-Expression") or "").strip()
    if expression:
        return expression if _spdx_permissive(expression) else None
    text = (metadata.get("License") or "").strip()
    text = text.splitlines()[0][:80] if text and text.upper() != "UNKNOWN" else ""
    classifiers = [c.split(" :: ")[-1] for c in metadata.get_all("Classifier") or []
                   if c.startswith("License ::")]
    evidence = [text] * bool(text) + classifiers
    if not evidence or any(RESTRICTIVE_TEXT.search(e) for e in evidence):
        return None
    if not any(PERMISSIVE_TEXT.search(e) for e in evidence):
        return None
    return "; ".join(dict.fromkeys(evidence))


def _usable(path: Path) -> str | None:
    """The file's text, or None for binary/mis-encoded, huge or generated-looking files."""
    try:
        data = path.read_bytes()
        if len(data) > MAX_FILE_CHARS:
            return None
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.strip() or max(map(len, text.splitlines())) > MAX_LINE_CHARS:
        return None
    return text


def _vendored(parts) -> bool:
    return any("vendor" in p.lower() for p in parts)


def stdlib_package(root: Path | None = None) -> Package:
    """Every usable ``*.py`` file of a CPython standard library (minus installed packages)."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    version = platform.python_version() if root == Path(sysconfig.get_paths()["stdlib"]) else root.name
    pkg = Package("python-stdlib", version, "PSF-2.0")
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if {"site-packages", "dist-packages"} & set(parts) or _vendored(parts):
            continue
        if (text := _usable(path)) is not None:
            pkg.files[f"stdlib/{'/'.join(parts)}"] = text
    return pkg


def installed_packages() -> tuple[list[Package], list[tuple[str, str]]]:
    """Permissively licensed distributions on sys.path, with their files; and the skipped ones."""
    packages, skipped, seen = [], [], set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name") or ""
        key = re.sub(r"[-_.]+", "-", name).lower()
        if not key or key in seen:  # the first on sys.path wins, as for imports
            continue
        seen.add(key)
        py_files = [f for f in dist.files or [] if f.suffix == ".py" and ".." not in f.parts
                    and not _vendored(f.parts)]
        if not py_files:
            continue
        license = permissive_license(dist.metadata)
        if license is None:
            lic = dist.metadata.get("License-Expression") or (dist.metadata.get("License") or "")[:60]
            skipped.append((name, lic.splitlines()[0] if lic.strip() else "no licence found"))
            continue
        pkg = Package(name, dist.version, license)
        for f in sorted(py_files, key=str):
            if (text := _usable(Path(dist.locate_file(f)))) is not None:
                pkg.files[f"{key}/{f.as_posix()}"] = text
        if pkg.files:
            packages.append(pkg)
    return sorted(packages, key=lambda p: p.name.lower()), skipped


def split_packages(packages: list[Package]) -> tuple[list[Package], list[Package]]:
    """Whole packages held out: in name-hash order, each <= 1.5% of the corpus, until 3% is."""
    total = sum(p.nbytes for p in packages)
    held, held_bytes = set(), 0
    for pkg in sorted(packages, key=lambda p: _stable_hash(p.name.lower())):
        if held_bytes >= total * HELD_OUT_PERCENT / 100:
            break
        if pkg.nbytes <= total * HELD_OUT_MAX_PACKAGE_PERCENT / 100:
            held.add(pkg.name)
            held_bytes += pkg.nbytes
    return [p for p in packages if p.name not in held], [p for p in packages if p.name in held]


def dedupe_and_cap(train: list[Package], held: list[Package], max_mb: float | None) -> dict:
    """Drop duplicate files (held-out copies win), then cap both sets; edits the packages in place."""
    seen: set[bytes] = set()
    stats = {"duplicates_dropped": 0, "dropped_by_max_mb": 0}
    for pkg in held + train:
        for path, text in list(pkg.files.items()):
            digest = hashlib.sha256(text.encode()).digest()
            if digest in seen:
                del pkg.files[path]
                stats["duplicates_dropped"] += 1
            seen.add(digest)
    if max_mb:
        for group, cap in ((train, max_mb), (held, max_mb * HELD_OUT_PERCENT / (100 - HELD_OUT_PERCENT))):
            files = sorted(((_stable_hash(path), pkg, path) for pkg in group for path in pkg.files),
                           key=lambda x: x[0])
            kept = 0
            for _, pkg, path in files:
                size = len(pkg.files[path])
                if kept and kept + size > cap * 1e6:
                    del pkg.files[path]
                    stats["dropped_by_max_mb"] += 1
                else:
                    kept += size
    return stats


def short_docstrings(text: str) -> str:
    """The source with every docstring of more than one line cut to its first sentence, on one line.

    Files that do not parse, and docstrings that share a line with other code or whose sentence
    holds a backslash or quotes, are left as they are.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return text
    lines, edits = text.splitlines(keepends=True), []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        doc = node.body[0]
        if (not isinstance(doc, ast.Expr) or not isinstance(doc.value, ast.Constant)
                or not isinstance(doc.value.value, str) or doc.end_lineno == doc.lineno):
            continue
        indent = lines[doc.lineno - 1][:doc.col_offset]  # col_offset counts UTF-8 bytes: fine for whitespace
        paragraph = " ".join(re.split(r"\n\s*\n", doc.value.value.strip())[0].split())
        sentence = re.match(r"(.+?\.)(\s|$)", paragraph)
        summary = sentence.group(1) if sentence else paragraph
        if (indent.strip() or lines[doc.end_lineno - 1].encode()[doc.end_col_offset:].strip() or not summary
                or '"' in summary or "\\" in summary):
            continue
        edits.append((doc.lineno, doc.end_lineno, f'{indent}"""{summary}"""\n'))
    for start, end, line in sorted(edits, reverse=True):  # bottom up, so earlier line numbers stay valid
        lines[start - 1:end] = [line]
    return "".join(lines)


def shorten_docstrings(packages: list[Package]) -> None:
    """short_docstrings on every file, on all cores (ast.parse runs at ~2 MB/s on one); edits in place."""
    items = [(pkg, path) for pkg in packages for path in pkg.files]
    with multiprocessing.Pool() as pool:
        texts = pool.map(short_docstrings, [pkg.files[path] for pkg, path in items], chunksize=32)
    for (pkg, path), text in zip(items, texts):
        pkg.files[path] = text


def texts_of(packages: list[Package]) -> list[str]:
    return [t for pkg in packages for _, t in sorted(pkg.files.items())]


def held_out_function_headers(texts: list[str], n: int = 20) -> list[str]:
    """``n`` top-level ``def ...:`` lines (plus "\\n") spread evenly over the held-out files."""
    headers = []
    for text in texts:
        for line in text.splitlines():
            line = line.rstrip()
            if line.startswith("def ") and line.endswith(":") and _parses(line + "\n    pass\n"):
                headers.append(line + "\n")
    if len(headers) <= n:
        return headers
    return [headers[i * len(headers) // n] for i in range(n)]


def parse_rate(headers: list[str], complete: Callable[[str], str]) -> tuple[float, list[dict]]:
    """Fraction of headers that parse together with their (cut) completion, and the checks.

    ``complete(prompt)`` returns generated text only, with ``<|endoftext|>`` kept if it was
    generated; any engine can supply it.
    """
    checks = []
    for header in headers:
        completion = complete(header)
        checks.append({"header": header, "completion": completion,
                       "parses": _parses(header + cut_function(completion))})
    return sum(c["parses"] for c in checks) / max(len(checks), 1), checks


def cut_function(completion: str) -> str:
    """The completed function body: up to the first line back at column 0 (the function ended) or
    the end of the file; if generation ran out first, without the unfinished last line."""
    text, ended, _ = completion.partition(EOT)
    lines = text.split("\n")
    if not ended:
        lines = lines[:-1]
    body = []
    for line in lines:
        if line[:1] not in ("", " ", "\t"):
            break
        body.append(line)
    return "".join(line + "\n" for line in body)


def hf_completer(model, tokenizer, max_new_tokens: int = NEW_TOKENS,
                 skip_special_tokens: bool = False) -> Callable[[str], str]:
    """Greedy completion with Hugging Face ``generate``, returning only the new text."""
    def complete(prompt: str) -> str:
        inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=skip_special_tokens)
    return complete


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def demo_prompts() -> list[str]:
    """example.py's DEMO_PROMPTS, read without importing it (so nanograph need not import here)."""
    example = Path(__file__).resolve().parents[1] / "example.py"
    try:
        for node in ast.parse(example.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "DEMO_PROMPTS" for t in node.targets):
                return ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        pass
    return DEFAULT_PROMPTS


# --- Tokenizer --------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    eot_id = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B",
                                                       special_tokens=[(EOT, eot_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   clean_up_tokenization_spaces=False)


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str], time_limit_s: float | None = None,
                  chunk_chars: int = 4_000_000) -> tuple[torch.Tensor, int]:
    """Texts as one int32 token stream, each file preceded by ``<|endoftext|>``, one at the end.

    Encodes batches of files (in parallel, in Rust) and stops starting new batches after
    ``time_limit_s``; returns the stream and how many of the texts it holds (a prefix).
    """
    backend, eot = tokenizer.backend_tokenizer, tokenizer.eos_token_id
    parts, done, start = [], 0, time.time()
    while done < len(texts) and (time_limit_s is None or time.time() - start < time_limit_s):
        end, size = done, 0
        while end < len(texts) and (end == done or size < chunk_chars):
            size, end = size + len(texts[end]), end + 1
        for enc in backend.encode_batch_fast(texts[done:end], add_special_tokens=False):
            parts.append(np.array([eot] + enc.ids, dtype=np.int32))
        done = end
    parts.append(np.array([eot], dtype=np.int32))
    return torch.from_numpy(np.concatenate(parts)), done


# --- Model and training -----------------------------------------------------

def mlp_size(vocab_size: int) -> int:
    """The widest MLP (a multiple of 32) that keeps the model within PARAM_BUDGET."""
    attention = HIDDEN * HEAD_DIM * (2 * HEADS + 2 * KV_HEADS) + 2 * HIDDEN + 2 * HEAD_DIM  # + norms
    rest = PARAM_BUDGET - LAYERS * attention - (vocab_size + 1) * HIDDEN  # tied embedding, final norm
    return rest // (3 * HIDDEN * LAYERS) // 32 * 32


def build_model(vocab_size: int, eot_id: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=mlp_size(vocab_size),
        tie_word_embeddings=True,
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
    windows = windows.long()
    with torch.autocast(windows.device.type, torch.bfloat16, enabled=windows.is_cuda):
        logits = model(input_ids=windows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten(), reduction="sum")


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, max_windows: int | None = None, batch: int = 64) -> float:
    """Mean loss per predicted token; windows overlap by one token so each is predicted once.

    With ``max_windows``, that many windows spread evenly over the stream (all held-out packages).
    """
    windows = [stream[s:s + SEQ_LEN + 1] for s in range(0, len(stream) - 1, SEQ_LEN)]
    if max_windows and len(windows) > max_windows:
        windows = [windows[i * len(windows) // max_windows] for i in range(max_windows)]
    full = [w for w in windows if len(w) == SEQ_LEN + 1]
    batches = [torch.stack(full[i:i + batch]) for i in range(0, len(full), batch)]
    batches += [w[None] for w in windows if len(w) < SEQ_LEN + 1]  # the short last window
    model.eval()
    total = sum(window_loss(model, b).item() for b in batches)
    model.train()
    return total / sum(b[:, 1:].numel() for b in batches)


def train(model, data: torch.Tensor, val: torch.Tensor, args, budget_s: float) -> tuple[int, int, list]:
    """Train until max steps or the time budget; returns (steps, tokens seen, log rows)."""
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
    best_val, best_state, log = float("inf"), None, []
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
            val_loss = evaluate(model, val, max_windows=256)
            if val_loss < best_val:  # early stopping, should the data be small enough to memorise
                best_val, best_state = val_loss, {k: v.clone() for k, v in model.state_dict().items()}
            train_loss = loss_sum.item() / (step - logged_step)
            log.append([step, round(elapsed), round(train_loss, 3), round(val_loss, 3)])
            print(f"step {step:6d} | {100 * min(progress, 1):5.1f}% | train {train_loss:.3f} | "
                  f"val {val_loss:.3f} | lr {opt.param_groups[0]['lr']:.2e} | "
                  f"{step * tokens_per_step / elapsed:,.0f} tok/s | {elapsed:.0f}s", flush=True)
            loss_sum.zero_()
            logged_step, next_log = step, next_log + 0.05
    if best_state is not None:  # None only if every evaluation gave NaN
        model.load_state_dict(best_state)
    print(f"kept the checkpoint with the best held-out loss, {best_val:.3f}")
    return step, step * tokens_per_step, log


# --- Model card -------------------------------------------------------------

def write_readme(out: Path, metrics: dict, train: list[Package], held: list[Package],
                 skipped: list[tuple[str, str]], args) -> None:
    m, c = metrics, metrics["model"]

    def table(pkgs):
        rows = [f"| {p.name} | {p.version} | {p.license.replace('|', '/')} | {len(p.files):,} | "
                f"{p.nbytes / 1e6:.2f} |" for p in pkgs]
        return "\n".join(["| package | version | licence | files | MB |", "| --- | --- | --- | ---: | ---: |",
                          *rows])

    samples = "\n\n".join(f"```python\n{s['prompt']}{s['completion']}\n```" for s in m["samples"])
    skipped_text = ", ".join(f"{n} ({lic})" for n, lic in skipped) or "none"
    argv, rest = [], list(sys.argv[1:])  # the command as run, writing where the model is shipped, no --baseline
    while rest:
        a = rest.pop(0)
        name, has_value = a.split("=", 1)[0], "=" in a
        value = a.split("=", 1)[1] if has_value else (rest.pop(0) if name in ("--out", "--baseline") and rest else None)
        if name == "--out":
            argv += ["--out", SHIPPED_DIR]
        elif name != "--baseline":
            argv += [a] if value is None or has_value else [a, value]
    cmd = " ".join(["python", "tools/train_demo_model.py", *argv])
    left_out = [f"{m['data']['dropped_by_max_mb']:,} files beyond `--max-mb {args.max_mb:g}`"] * bool(
        m["data"]["dropped_by_max_mb"]) + [f"the files the {ENCODE_LIMIT_S} s encoding limit did not reach"] * bool(
        m["data"]["encode_limit_hit"])
    capped = f" (a hash-ordered subsample: left out were {' and '.join(left_out)})" if left_out else ""
    baseline = ""
    if "baseline" in m:
        b = m["baseline"]
        baseline = (f"\n* On the same held-out data and headers, `{b['model']}` (the previous demo model,\n"
                    f"  with its own tokenizer) scores {b['val_loss']:.3f} nats per token\n"
                    f"  ({b['val_bits_per_byte']:.3f} bits per byte) and a parse rate of {b['parse_rate']:.0%}.")
    kv = c["num_key_value_heads"]
    text = f"""# nanograph demo model

A tiny ({m['parameters'] / 1e6:.1f}M-parameter) causal language model with the Qwen3
architecture, trained from scratch by nanograph's `tools/train_demo_model.py` on
Python source: the standard library and the permissively licensed packages that
were installed where it was trained (listed below). It exists so that
`python example.py` can generate real-looking Python offline, and so that tests
have a real model to run. It is a toy: it completes Python code, often plausibly,
but it is not a useful assistant.

## Files

| file | contents |
| --- | --- |
| `config.json` | `Qwen3ForCausalLM` config (bf16, tied embeddings) |
| `generation_config.json` | EOS/BOS/PAD = `<|endoftext|>` |
| `model.safetensors` | weights, bf16 |
| `tokenizer.json`, `tokenizer_config.json` | the tokenizer |
| `metrics.json` | results of the training run below, with the checked completions |

Loads with plain transformers:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(path)
tokenizer = AutoTokenizer.from_pretrained(path)
```

## Model

Qwen3 decoder: {c['num_hidden_layers']} layers, hidden size {c['hidden_size']},
{c['num_attention_heads']} query heads and {kv} KV head{'s' * (kv > 1)} of dimension {c['head_dim']},
MLP size {c['intermediate_size']},
RoPE theta 10000, RMSNorm eps 1e-6, tied input and output embeddings, context up
to 2048 positions (trained on {SEQ_LEN}).

## Tokenizer

Byte-level BPE with {c['vocab_size']:,} tokens, trained with the `tokenizers` library on
the training files. Newlines are split off before the byte-level step, so a
prompt ending in `\\n` is tokenized the way the model saw such text in training.
Decoding reproduces the source text byte for byte. `<|endoftext|>` (id 0) is
put in front of every file in training and in front of every encoded prompt
(the tokenizer adds it, as a BOS), so a prompt reads as the start of a file; it
is also the EOS.

## Training data

`*.py` files from the `RECORD` of each installed distribution whose metadata
(`License-Expression`, else the `License` field and licence classifiers) grants
a permissive licence, plus the standard library; without vendored copies
(`_vendor` folders), files that are not UTF-8, over 512 kB or with a line over
1,000 characters, and duplicates (by content hash: {m['data']['duplicates_dropped']:,} files dropped).
Every docstring of more than one line is cut to its first sentence, on one line
(in the held-out files too), so the model spends its tokens on code rather than
on Args sections.
Whole packages are held out for validation: in the order of a hash of the name,
each no larger than 1.5% of the corpus, until 3% is held out.
Training: {m['data']['train_files']:,} files, {m['data']['train_mb']:.1f} MB,
{m['data']['train_tokens']:,} tokens{capped}.
Held out: {m['data']['val_files']:,} files, {m['data']['val_mb']:.1f} MB, {m['data']['val_tokens']:,} tokens.

Training packages:

{table(train)}

Held-out packages (never trained on):

{table(held)}

Skipped, no permissive licence found: {skipped_text}.

## Training

Random {SEQ_LEN}-token windows from the packed token stream, {args.batch_size} per step,
AdamW (peak LR {PEAK_LR}, betas 0.9/0.95, weight decay 0.1), {WARMUP_STEPS} warm-up steps,
cosine decay to {MIN_LR_RATIO:.0%} over the time budget, bf16 autocast, seed {args.seed}.
{m['steps']:,} steps, {m['train_tokens']:,} training tokens
({m['train_tokens'] / max(m['data']['train_tokens'], 1):.1f} epochs), {m['train_seconds']:.0f} s of training on
{m['device']} ({m['wall_seconds']:.0f} s in all, with data preparation and evaluation). The
checkpoint with the best held-out loss (evaluated every 5% of the run) is kept.

## Results

* Validation loss: {m['val_loss']:.3f} nats per token ({m['val_bits_per_byte']:.3f} bits per byte)
  on the held-out packages. Per-token losses depend on the tokenizer (this one
  has {c['vocab_size']:,} tokens); bits per byte do not.
* Parse rate: {m['parse_rate']:.0%} ({round(m['parse_rate'] * m['headers'])} of {m['headers']}) held-out top-level
  function headers, completed greedily ({NEW_TOKENS} new tokens) and cut where the function ends
  (the first line back at column 0, or the end of the file) or, when the tokens
  run out first, after the last complete line, parse with `ast.parse`. The
  completions are in `metrics.json`.{baseline}

Greedy completions ({NEW_TOKENS} new tokens) of `example.py`'s prompts:

{samples}

## Reproduce

From the nanograph repository root, on one GPU:

```sh
{cmd}
```

The data split, tokenizer, initialization and batch order are deterministic
for a given set of installed packages; the number of steps depends on the
GPU's speed because training stops at `--max-steps` or at the wall-clock budget
(`--minutes`, which includes data preparation and evaluation), whichever comes first.
"""
    (out / "README.md").write_text(text)


# --- Main -------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    p.add_argument("--minutes", type=float, default=11.0,
                   help="total wall-clock budget, data preparation and evaluation included")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=128, help=f"sequences of {SEQ_LEN} tokens per step")
    p.add_argument("--max-mb", type=float, default=320,
                   help="cap on the training corpus (MB of source; 0: no cap); the held-out set in proportion")
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE,
                   help="BPE vocabulary; the MLP is sized so the model stays within the 16 MiB budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--stdlib", type=Path, default=None,
                   help="a CPython standard library directory (default: this interpreter's)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="another model directory to score on the same held-out data (e.g. the previous demo model)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    t0 = time.time()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    timings = {}

    packages, skipped = installed_packages()
    packages.append(stdlib_package(args.stdlib))
    train_pkgs, held_pkgs = split_packages(packages)
    data_stats = dedupe_and_cap(train_pkgs, held_pkgs, args.max_mb)
    train_pkgs = [p for p in train_pkgs if p.files]
    held_pkgs = [p for p in held_pkgs if p.files]
    if not train_pkgs or not held_pkgs:
        sys.exit(f"too few usable packages: {len(train_pkgs)} to train on, {len(held_pkgs)} to hold out")
    shorten_docstrings(train_pkgs + held_pkgs)
    train_files = sorted(((path, pkg) for pkg in train_pkgs for path in pkg.files),
                         key=lambda item: _stable_hash(item[0]))  # the order --max-mb capped in
    train_texts, val_texts = [pkg.files[path] for path, pkg in train_files], texts_of(held_pkgs)
    timings["read_s"] = round(time.time() - t0, 1)
    print(f"{len(packages)} packages ({len(skipped)} skipped for their licence): "
          f"{len(train_pkgs)} for training, {len(held_pkgs)} held out "
          f"({', '.join(p.name for p in held_pkgs)}); read in {timings['read_s']}s", flush=True)

    t = time.time()
    sample, size = [], 0
    for text in train_texts:  # the first TOKENIZER_SAMPLE_MB of the hash-ordered files
        if size > TOKENIZER_SAMPLE_MB * 1e6:
            break
        sample.append(text)
        size += len(text)
    tokenizer = train_tokenizer(sample, args.vocab_size)
    timings["tokenizer_s"] = round(time.time() - t, 1)
    t = time.time()
    val = encode_stream(tokenizer, val_texts)[0].to(device)
    data, done = encode_stream(tokenizer, train_texts, ENCODE_LIMIT_S)
    data = data.to(device)
    timings["encode_s"] = round(time.time() - t, 1)
    if done < len(train_texts):
        print(f"encoding hit its {ENCODE_LIMIT_S}s limit: training on {done:,} of {len(train_texts):,} files")
        for path, pkg in train_files[done:]:
            del pkg.files[path]
        train_texts, train_pkgs = train_texts[:done], [p for p in train_pkgs if p.files]
    data_stats["encode_limit_hit"] = done < len(train_files)
    train_bytes, val_bytes = sum(len(s.encode()) for s in train_texts), sum(len(s.encode()) for s in val_texts)
    data_stats.update(train_files=len(train_texts), train_mb=round(train_bytes / 1e6, 2), train_tokens=len(data),
                      val_files=len(val_texts), val_mb=round(val_bytes / 1e6, 2), val_tokens=len(val))
    print(f"{len(train_texts):,} train files ({train_bytes / 1e6:.1f} MB, {len(data):,} tokens), "
          f"{len(val_texts):,} held-out files ({val_bytes / 1e6:.1f} MB, {len(val):,} tokens); "
          f"tokenizer {timings['tokenizer_s']}s, encoding {timings['encode_s']}s, "
          f"data ready in {time.time() - t0:.0f}s", flush=True)

    model = build_model(len(tokenizer), tokenizer.eos_token_id).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters ({n_params * 2 / 2**20:.2f} MiB in bf16)", flush=True)
    budget_s = args.minutes * 60 - (time.time() - t0) - RESERVE_S - 30 * bool(args.baseline)
    if budget_s <= 0:
        sys.exit(f"data preparation used up the {args.minutes}-minute budget; raise --minutes")
    t_train = time.time()
    steps, tokens, log = train(model, data, val, args, budget_s)
    timings["train_s"] = round(time.time() - t_train, 1)

    t = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    weights_mib = (args.out / "model.safetensors").stat().st_size / 2**20
    if weights_mib > MAX_WEIGHTS_MIB:
        print(f"WARNING: the weights take {weights_mib:.2f} MiB, over the {MAX_WEIGHTS_MIB} MiB the package allows")
    model = AutoModelForCausalLM.from_pretrained(args.out).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    if tokenizer("x").input_ids[0] != tokenizer.eos_token_id:
        print("WARNING: the reloaded tokenizer does not put <|endoftext|> in front of prompts")
    val = encode_stream(tokenizer, val_texts)[0].to(device)  # with the reloaded tokenizer
    val_loss = evaluate(model, val)
    headers = held_out_function_headers(val_texts)
    rate, checks = parse_rate(headers, hf_completer(model, tokenizer))
    sample_of = hf_completer(model, tokenizer, skip_special_tokens=True)
    samples = [{"prompt": p, "completion": sample_of(p)} for p in demo_prompts()]
    metrics = {
        "val_loss": round(val_loss, 4),
        "val_bits_per_byte": round(val_loss * (len(val) - 1) / math.log(2) / val_bytes, 4),
        "parse_rate": rate,
        "headers": len(headers),
        "parameters": n_params,
        "weights_mib": round(weights_mib, 2),
        "train_tokens": tokens,
        "steps": steps,
        "train_seconds": timings["train_s"],
        "tokens_per_second": round(tokens / timings["train_s"]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "seed": args.seed,
        "data": data_stats,
        "model": {k: getattr(model.config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                         "num_key_value_heads", "head_dim", "intermediate_size",
                                                         "vocab_size")},
        "train_packages": {p.name: p.license for p in train_pkgs},
        "held_out_packages": {p.name: p.license for p in held_pkgs},
        "samples": samples,
        "parse_checks": checks,
        "log": log,
    }
    if args.baseline:
        base = AutoModelForCausalLM.from_pretrained(args.baseline).to(device)
        base_tok = AutoTokenizer.from_pretrained(args.baseline)
        base_val = encode_stream(base_tok, val_texts)[0].to(device)
        base_loss = evaluate(base, base_val)
        metrics["baseline"] = {
            "model": str(args.baseline), "val_loss": round(base_loss, 4),
            "val_bits_per_byte": round(base_loss * (len(base_val) - 1) / math.log(2) / val_bytes, 4),
            "parse_rate": parse_rate(headers, hf_completer(base, base_tok))[0]}
    timings["eval_s"] = round(time.time() - t, 1)
    metrics["timings"] = timings
    metrics["wall_seconds"] = round(time.time() - t0, 1)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_readme(args.out, metrics, train_pkgs, held_pkgs, skipped, args)
    summary = {k: v for k, v in metrics.items() if k not in ("parse_checks", "log", "train_packages")}
    print(json.dumps(summary, indent=2))
    print("files:", sorted(os.listdir(args.out)))


if __name__ == "__main__":
    main()
