"""--spec: speculative decoding, measured two ways (plain decoding rerun in the same call).

(a) The mechanics, on the shape's dummy weights. Dummy weights make prompt lookup guess nothing,
so drafts come from `ReplayProposer` (spec_proposers.py): the plain engine's own greedy
continuation of each prompt, each draft token corrupted with probability 1 - acceptance. For
each batch size, the plain engine generates the continuations (timed: plain tokens/s), then the
speculative engine (k = SPEC_K, its switch-off rule as a user gets it) generates the same
prompts greedily with the replay drafts at each acceptance rate (timed). The tokens must equal
plain decoding's; the table gives tokens/s against plain and the measured acceptance.
(b) The bundled demo model (a real checkpoint) on Python prompts, greedy, plain against its
drafts: acceptance, speedup. Prompt lookup; and the demo model drafting for itself (a draft
model as costly as its target: near-full acceptance, and the price of the draft engine's steps,
an upper bound on its overhead rather than a gain). The demo model drafting for a larger dummy
target is not meaningful (a dummy target accepts nothing), so not measured.
"""
from pathlib import Path

from benchmarks.harness import Setup
from benchmarks.report import cell, print_table
from benchmarks.spec_proposers import ReplayProposer
from benchmarks.timing import synchronize

SPEC_K = 4
ACCEPTANCES = (0.0, 0.5, 0.7, 0.9)
BATCHES = (1, 4, 16, 64)
PROMPT_LEN, NEW_TOKENS = 128, 128
KEY_TOKENS = 16  # a prompt's first tokens tell the replay proposer which reference it continues
DEMO = Path(__file__).resolve().parents[1] / "nanograph" / "pretrained" / "pycoder"
DEMO_PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n",
    "import os\n\n\ndef list_files(path):\n    for name in os.listdir(path):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n"]
# (b)'s drafters; the demo model drafting for itself accepts nearly everything but costs what
# the target does: it measures the draft engine's overhead, never a gain
DEMO_DRAFTS = {"ngram": {"method": "ngram", "num_speculative_tokens": SPEC_K},
               "draft model": {"model": str(DEMO), "num_speculative_tokens": SPEC_K}}


def timed_generate(llm, prompts, params, device):
    """(token ids per prompt, seconds) of one generate."""
    import time
    synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    synchronize(device)
    return [out["token_ids"] for out in outs], time.perf_counter() - start


def spec_counts(llm) -> tuple[int, int]:
    stats = llm.stats()
    return stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]


def mechanics(setup: Setup, batches, acceptances, prompt_len, new_tokens) -> list[dict]:
    from nanograph import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [p[:prompt_len] for p in setup.workload.prompts if len(p) >= prompt_len]
    max_len = prompt_len + new_tokens + SPEC_K + 1
    plain = setup.llm(max_model_len=max_len)
    timed_generate(plain, prompts[:max(batches)], params, setup.device)  # warm-up
    references, plain_seconds = {}, {}
    for batch in batches:
        outs, plain_seconds[batch] = timed_generate(plain, prompts[:batch], params, setup.device)
        references[batch] = [p + o for p, o in zip(prompts, outs)]
    vocab = plain.config.hf_config.vocab_size
    plain.close()
    # drafts at every batch: these rows measure the verify mechanics, not the switch-off rule
    spec = setup.llm(max_model_len=max_len,
                     speculative_config={"method": "ngram", "num_speculative_tokens": SPEC_K,
                                         "disable_by_batch_size": max(batches)})
    rows = []
    for batch in batches:
        for acceptance in acceptances:
            # (on the host, as the drafter's tokens are)
            proposer = ReplayProposer(references[batch], min(KEY_TOKENS, prompt_len),
                                      1 - acceptance, vocab)
            spec.spec.drafter.proposer = proposer.propose
            before = spec_counts(spec)
            timed_generate(spec, prompts[:batch], params, setup.device)  # warm-up, then timed
            outs, seconds = timed_generate(spec, prompts[:batch], params, setup.device)
            drafted, accepted = (b - a for a, b in zip(before, spec_counts(spec)))
            same = all(p + o == r for p, o, r in zip(prompts, outs, references[batch]))
            rows.append({"batch": batch, "acceptance": acceptance,
                         "plain_tok_s": batch * new_tokens / plain_seconds[batch],
                         "spec_tok_s": batch * new_tokens / seconds,
                         "speedup": plain_seconds[batch] / seconds,
                         "measured_acceptance": accepted / drafted if drafted else None,
                         "draft_tokens": drafted, "same_tokens": same})
    spec.close()
    print_table(f"--spec (a): replayed drafts, k={SPEC_K}, {prompt_len}-token prompts, "
                f"{new_tokens} new tokens, greedy",
                ["batch", "acceptance", "plain tok/s", "spec tok/s", "speedup", "measured",
                 "same tokens"],
                [[r["batch"], r["acceptance"], cell(r["plain_tok_s"], ".0f"),
                  cell(r["spec_tok_s"], ".0f"), cell(r["speedup"], ".2f", "x"),
                  cell(r["measured_acceptance"], ".2f"), r["same_tokens"]] for r in rows])
    return rows


def demo_drafts(setup: Setup, batches, new_tokens) -> list[dict]:
    """Plain, then each of DEMO_DRAFTS, on the demo model: one row per drafter and batch.
    (Only `setup.device` and `setup.dtype` are read.)"""
    from nanograph import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    knobs = dict(device=setup.device, dtype=setup.dtype, max_model_len=1024)
    rows, plain = [], {}
    for name, config in [("plain", None), *DEMO_DRAFTS.items()]:
        llm = LLM(str(DEMO), **knobs, speculative_config=config)
        for batch in batches:
            prompts = (DEMO_PROMPTS * batch)[:batch]
            timed_generate(llm, prompts, params, setup.device)  # warm-up
            before = spec_counts(llm) if config else (0, 0)
            outs, seconds = timed_generate(llm, prompts, params, setup.device)
            if config is None:
                plain[batch] = outs, seconds
                continue
            drafted, accepted = (b - a for a, b in zip(before, spec_counts(llm)))
            plain_outs, plain_s = plain[batch]
            rows.append({"drafts": name, "batch": batch, "acceptance": accepted / max(drafted, 1),
                         "speedup": plain_s / seconds, "same_tokens": outs == plain_outs,
                         "plain_tok_s": batch * new_tokens / plain_s,
                         "spec_tok_s": batch * new_tokens / seconds})
        llm.close()
    print_table(f"--spec (b): the demo model (k={SPEC_K}), Python prompts, {new_tokens} new "
                "tokens, greedy",
                ["drafts", "batch", "acceptance", "plain tok/s", "spec tok/s", "speedup",
                 "same tokens"],
                [[r["drafts"], r["batch"], cell(r["acceptance"], ".2f"),
                  cell(r["plain_tok_s"], ".0f"), cell(r["spec_tok_s"], ".0f"),
                  cell(r["speedup"], ".2f", "x"), r["same_tokens"]] for r in rows])
    return rows


def section_spec(setup: Setup) -> dict:
    quick = setup.args.quick
    batches = (1, 4) if quick else BATCHES
    acceptances = (0.0, 0.7) if quick else ACCEPTANCES
    prompt_len, new_tokens = (8, 12) if quick else (PROMPT_LEN, NEW_TOKENS)
    return {"mechanics": mechanics(setup, batches, acceptances, prompt_len, new_tokens),
            "demo_drafts": demo_drafts(setup, batches, new_tokens if not quick else 24)}
