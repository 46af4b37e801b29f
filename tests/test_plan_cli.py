"""`fxspeed plan`: a Hugging Face config planned on the meta device for a cluster, one table row per
strategy, the same numbers as fxspeed.plan called directly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fxspeed
from fxspeed.tools.cli import main

transformers = pytest.importorskip("transformers")

TINY_LLAMA = ["--model", "llama", "--set", "hidden_size=64", "--set", "intermediate_size=128",
              "--set", "num_attention_heads=4", "--set", "num_key_value_heads=2", "--set", "vocab_size=256",
              "--layers", "2"]


def test_plan_prints_a_row_per_zero_stage_with_the_numbers_fxspeed_plan_gives(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plans.json"
    code = main(["plan", *TINY_LLAMA, "--devices", "H100-80GB:8", "--batch", "2", "--seq", "32",
                 "--zero", "0,3", "--precision", "bf16", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "LlamaForCausalLM" in text and "8 x H100-80GB" in text and "2 x 32 tokens per replica" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:2] in (["0", "bf16"], ["3", "bf16"])]
    assert [r[0] for r in rows] == ["0", "3"], text
    saved = json.loads(out.read_text())
    assert [p["config"]["zero"] for p in saved] == [0, 3]
    states = [sum(p["plan"]["model_states"].values()) for p in saved]
    assert states[1] < states[0] / 4  # ZeRO-3 over 8 ranks keeps an eighth of the states, ZeRO-0 all of them

    # the same model planned directly: the same figures
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=256, num_hidden_layers=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    plan = fxspeed.plan(model, fxspeed.devices("H100-80GB", 8), fxspeed.Config(zero=3, precision="bf16"),
                        example_inputs={"input_ids": ids, "labels": ids})
    assert saved[1]["plan"]["model_states"] == plan.model_states
    assert saved[1]["plan"]["rank_memory"] == plan.rank_memory


def test_plan_of_one_combination_prints_the_whole_summary_and_a_bad_one_names_its_config(capsys) -> None:
    assert main(["plan", *TINY_LLAMA, "--devices", "cpu:2", "--seq", "16", "--zero", "1"]) == 0
    text = capsys.readouterr().out
    assert "memory per rank (rank 0)" in text and "time per step (predicted)" in text and "zero=1" in text
    # tensor=3 does not divide 2 devices: that row says why, the other is planned
    assert main(["plan", *TINY_LLAMA, "--devices", "cpu:2", "--seq", "16", "--tensor", "1,3"]) == 0
    text = capsys.readouterr().out
    assert "tensor=3" in text and "does not divide the 2 devices" in text


def test_a_misspelt_config_key_is_refused_before_the_model_is_built(capsys) -> None:
    assert main(["plan", "--model", "no-such-type", "--config", "zer0=1"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'zero'" in err
    with pytest.raises(SystemExit, match="has no field 'hidden_sise'"):
        main(["plan", "--model", "llama", "--set", "hidden_sise=64"])


def test_device_presets_are_named_in_any_case_and_without_their_memory_suffix(capsys) -> None:
    assert fxspeed.devices("h100", 2) == fxspeed.devices("H100-80GB", 2)
    assert fxspeed.devices("a100-80gb")[0].name == "A100-80GB" and fxspeed.devices("CPU")[0].kind == "cpu"
    with pytest.raises(SystemExit, match=r"--devices 'X100:8': devices: unknown device preset 'X100'; accepted: "
                                         r"'auto', 'cpu'"):
        main(["plan", "--model", "gpt2", "--devices", "X100:8"])


def test_set_on_a_model_folder_derives_the_fields_that_follow_it_and_flags_keys_are_refused_in_config(
        tmp_path: Path, capsys) -> None:
    """A folder's config.json stores the fields a config derives (Llama's head_dim, Qwen2's
    layer_types): --set hidden_size / --layers derive them again instead of keeping the stored
    ones, which described another shape (head_dim stayed 16 with hidden_size 128 over 4 heads)."""
    from fxspeed.tools.serve_cli import hf_config

    transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                             num_hidden_layers=4).save_pretrained(tmp_path / "llama")
    cfg, _ = hf_config(str(tmp_path / "llama"), None, "plan", {"hidden_size": 128})
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.intermediate_size) == (128, 4, 32, 128)
    transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                             num_hidden_layers=4).save_pretrained(tmp_path / "qwen2")
    cfg, _ = hf_config(str(tmp_path / "qwen2"), 2, "plan")
    assert cfg.num_hidden_layers == 2 and len(cfg.layer_types) == 2
    with pytest.raises(SystemExit, match=r"(?s)a config it refuses: .*not a multiple"):
        hf_config("llama", None, "plan", {"num_attention_heads": 5, "hidden_size": 64})
    assert main(["plan", "--model", "llama", "--config", "zero=3"]) == 2
    assert "--config zero=...: use --zero" in capsys.readouterr().err
