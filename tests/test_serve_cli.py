"""`fxspeed serve` (fxspeed/tools/serve_cli.py): a causal LM built from a Hugging Face config,
served from the command line, prints the greedy tokens of HF `generate`; a bad request is
reported and makes the exit code 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def test_fxspeed_serve_prints_hugging_faces_greedy_tokens_and_reports_a_bad_request():
    from fxspeed.tools.serve_cli import build_model

    cmd = [sys.executable, "-m", "fxspeed", "serve", "--model", "gpt2", "--layers", "1", "--prompt", "1 2 3",
           "--prompt", "7 8", "--prompt", "", "--max-new-tokens", "3", "--token-budget", "8"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # the empty prompt failed, alone
    lines = [line for line in proc.stdout.splitlines() if line.startswith("request ")]
    model = build_model("gpt2", 1)
    with torch.no_grad():
        for i, p in enumerate(([1, 2, 3], [7, 8])):
            want = model.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(p):].tolist()
            assert lines[i] == f"request {i}: {' '.join(map(str, want))}"
    assert lines[2].startswith("request 2: error:") and "empty" in lines[2]


@pytest.mark.parametrize("name,hint", [("lama", "did you mean llama"), ("nosuchmodel", "e.g. gpt2, llama")])
def test_an_unknown_model_name_is_refused_with_the_closest_model_types_not_all_of_them(name, hint):
    from fxspeed.tools.serve_cli import build_model

    with pytest.raises(SystemExit, match=hint) as e:
        build_model(name, 1)
    assert len(str(e.value)) < 300  # Hugging Face's own message lists all ~800 types
