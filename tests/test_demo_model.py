"""The bundled demo model: it loads, nanograph's greedy completions equal HF's, example.py runs."""
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanograph import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "nanograph" / "pretrained" / "pycoder"
PROMPTS = ["def read_config(path):\n", "class Stack:\n    def __init__(self):\n", "import re\n"]


def test_bundled_model_matches_hf_greedy():
    tok = AutoTokenizer.from_pretrained(DEMO)
    hf = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    llm = LLM(str(DEMO), dtype="float32", max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                          do_sample=False)[0, ids.shape[1]:].tolist()
        assert out["token_ids"] == ref
        assert out["text"] == tok.decode(ref) and out["text"].strip()


def test_bundled_model_fits_the_package_budget():
    assert (DEMO / "model.safetensors").stat().st_size <= 16 * 2**20


def test_example_runs_offline_and_prints_completions():
    proc = subprocess.run([sys.executable, "example.py", "--max-tokens", "16", "--device", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("=== completion") == 3
    completions = [part.split("=== prompt")[0].strip() for part in proc.stdout.split("=== completion")[1:]]
    assert all(completions)
