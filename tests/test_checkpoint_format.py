"""The canonical checkpoint format (fxspeed.runtime.checkpoint): full tensors under original names
in torch.distributed.checkpoint's format, saved by any number of ranks holding any subsets of
the keys, loaded by any other layout; and consolidated safetensors / Hugging Face exports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fxspeed.errors import FxspeedError
from fxspeed.runtime import checkpoint as ckpt
from fxspeed.runtime.checkpoint import (CanonicalState, export_hf, export_safetensors, load_checkpoint,
                                        save_checkpoint)
from tests.multiprocess import rank_env, run_ranks
from tests.workers.checkpoint_format_worker import rank_state

ROOT = Path(__file__).resolve().parents[1]


def sample_state() -> CanonicalState:
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(40, generator=g)  # views of one buffer: only the viewed elements are saved
    model = {
        "wte.weight": torch.randn(10, 4, generator=g),
        "h.0.attn.weight": flat[:16].view(4, 4),
        "h.0.attn.bias": flat[16:20],
        "h.0.ln.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "h.0.ln.weight_t": torch.randn(4, 3, generator=g).t(),  # non-contiguous
        "num_batches_tracked": torch.tensor(12, dtype=torch.int64),  # 0-dim integer buffer
    }
    optimizer = {n: {"exp_avg": torch.randn(t.shape, generator=g), "exp_avg_sq": torch.rand(t.shape, generator=g),
                     "step": torch.tensor(3.0)} for n, t in model.items() if t.is_floating_point()}
    extra = {"scheduler": {"last_epoch": 3, "base_lrs": [3e-4]}, "scaler": {"scale": 65536.0},
             "rng": torch.get_rng_state(), "mesh": {"zero": 2, "pipeline": 1, "dp": 4}}
    return CanonicalState(model=model, optimizer=optimizer, extra=extra)


def assert_states_equal(got: CanonicalState, want: CanonicalState) -> None:
    assert list(got.model) == list(want.model) or set(got.model) == set(want.model)
    for name, t in want.model.items():
        assert got.model[name].dtype == t.dtype and torch.equal(got.model[name], t), name
    assert set(got.optimizer) == set(want.optimizer)
    for name, slots in want.optimizer.items():
        assert set(got.optimizer[name]) == set(slots), name
        for slot, t in slots.items():
            assert got.optimizer[name][slot].dtype == t.dtype and torch.equal(got.optimizer[name][slot], t), (name, slot)


def test_a_single_process_checkpoint_round_trips_bit_exactly_with_extra_intact(tmp_path: Path) -> None:
    state = sample_state()
    save_checkpoint(f"{tmp_path}/ckpt/", state)  # a trailing separator names the same directory
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "no temporary directory may be left next to it"
    got = load_checkpoint(tmp_path / "ckpt")
    assert_states_equal(got, state)
    assert got.extra["scheduler"] == state.extra["scheduler"] and got.extra["mesh"] == state.extra["mesh"]
    assert torch.equal(got.extra["rng"], state.extra["rng"])
    # only the views' elements were written, not the 40-float buffer behind them
    assert got.model["h.0.attn.bias"].untyped_storage().nbytes() == 4 * 4

    part = load_checkpoint(tmp_path / "ckpt", names=["h.0.attn.weight", "num_batches_tracked"])
    assert set(part.model) == {"h.0.attn.weight", "num_batches_tracked"}
    assert set(part.optimizer) == {"h.0.attn.weight"} and part.extra["mesh"] == state.extra["mesh"]
    with pytest.raises(FxspeedError, match=r"no tensors named \['lm_head.weight'\]"):
        load_checkpoint(tmp_path / "ckpt", names=["wte.weight", "lm_head.weight"])

    state.model["wte.weight"] = state.model["wte.weight"] + 1  # saving again replaces the checkpoint
    save_checkpoint(tmp_path / "ckpt", state)
    assert_states_equal(load_checkpoint(tmp_path / "ckpt"), state)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of the worker: ckpt/union saved by 2 gloo ranks, out/ holding what each rank saw."""
    base = tmp_path_factory.mktemp("checkpoint_format")
    (base / "ckpt").mkdir()
    (base / "out").mkdir()
    cmd = [sys.executable, "-m", "fxspeed", "run", "-n", "2", "-m", "tests.workers.checkpoint_format_worker",
           "--ckpt", str(base / "ckpt"), "--out", str(base / "out")]
    env = rank_env()
    proc = run_ranks(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return base


def test_a_checkpoint_saved_by_two_ranks_with_different_parameters_loads_as_their_union(two_rank_run: Path) -> None:
    r0, r1 = rank_state(0), rank_state(1)
    union = CanonicalState(model={**r0.model, **r1.model}, optimizer={**r0.optimizer, **r1.optimizer})
    assert set(r0.model) & set(r1.model) == {"embed.weight"} and set(r0.model) != set(r1.model)
    got = load_checkpoint(two_rank_run / "ckpt" / "union")  # one process, no process group
    assert_states_equal(got, union)
    assert got.extra["saved_by"] == 0, "extra is group rank 0's"
    assert [p.name for p in (two_rank_run / "ckpt").iterdir()] == ["union"]


def test_each_rank_of_a_group_loads_only_the_names_it_asks_for(two_rank_run: Path) -> None:
    for rank in (0, 1):
        got = torch.load(two_rank_run / "out" / f"loaded_rank{rank}.pt", weights_only=False)
        assert_states_equal(got, rank_state(rank))


def test_ranks_holding_one_name_with_different_shapes_are_refused_on_every_rank(two_rank_run: Path) -> None:
    for rank in (0, 1):
        msg = (two_rank_run / "out" / f"mismatch_rank{rank}.txt").read_text()
        assert msg.startswith("FxspeedError"), msg
        assert "model['embed.weight']: rank 0 has shape [16, 8]" in msg and "rank 1 has shape [16, 9]" in msg, msg
    assert not (two_rank_run / "ckpt" / "mismatch").exists()


def test_an_incomplete_or_missing_checkpoint_is_refused_with_a_message_naming_what_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FxspeedError, match="no checkpoint at .*nowhere.*does not exist"):
        load_checkpoint(tmp_path / "nowhere")

    first = sample_state()
    save_checkpoint(tmp_path / "ckpt", first)

    def die(*args: object) -> None:  # the process dies after writing every file, before the rename
        raise SystemExit("killed")

    monkeypatch.setattr(ckpt, "_move_into_place", die)
    second = sample_state()
    second.model["wte.weight"] = second.model["wte.weight"] * 2
    with pytest.raises(SystemExit):
        save_checkpoint(tmp_path / "ckpt", second)
    monkeypatch.undo()
    assert_states_equal(load_checkpoint(tmp_path / "ckpt"), first)  # the earlier checkpoint is intact

    with pytest.raises(SystemExit):
        monkeypatch.setattr(ckpt, "_move_into_place", die)
        save_checkpoint(tmp_path / "fresh", first)
    monkeypatch.undo()
    with pytest.raises(FxspeedError, match=r"no checkpoint at .*fresh.*fresh\.tmp-.*did not finish"):
        load_checkpoint(tmp_path / "fresh")

    os.remove(tmp_path / "ckpt" / "COMPLETE")  # e.g. a copy that stopped half-way
    with pytest.raises(FxspeedError, match=r"checkpoint .*ckpt' is incomplete: missing COMPLETE"):
        load_checkpoint(tmp_path / "ckpt")

    save_checkpoint(tmp_path / "fresh", first)  # a later save to the same path clears its leftovers
    assert [p for p in sorted(os.listdir(tmp_path)) if p.startswith("fresh")] == ["fresh"]


def test_saving_over_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(FxspeedError, match="not an fxspeed checkpoint .*refusing to replace it"):
        save_checkpoint(tmp_path / "data", sample_state())
    assert os.listdir(tmp_path / "data") == ["notes.txt"]
    with pytest.raises(FxspeedError, match=r"optimizer\['w'\]\['step'\] is a int, not a tensor"):
        save_checkpoint(tmp_path / "x", CanonicalState(model={"w": torch.ones(1)}, optimizer={"w": {"step": 3}}))
    assert not (tmp_path / "x").exists()


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: state_dict() lists both names, one storage
        self.register_buffer("pos", torch.arange(4.0))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


def test_a_safetensors_export_of_a_module_with_a_tied_weight_loads_with_strict_load_state_dict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    export_safetensors(tmp_path / "model.safetensors", model.state_dict(), metadata={"step": "7"})
    export_safetensors(tmp_path / "other.safetensors", model.state_dict(), rank=1)  # only rank 0 writes
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]

    torch.manual_seed(1)
    fresh = TiedLM()
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    assert fresh.head.weight is fresh.emb.weight

    flat = torch.randn(12)  # disjoint views of one flat buffer, as ZeRO's flat parameters are
    export_safetensors(tmp_path / "flat.safetensors", {"a": flat[:8].view(2, 4), "b": flat[8:]})
    got = load_file(tmp_path / "flat.safetensors")
    assert torch.equal(got["a"], flat[:8].view(2, 4)) and torch.equal(got["b"], flat[8:])


def test_a_hugging_face_gpt2_export_loads_with_from_pretrained_and_gives_identical_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    assert ckpt.tied_aliases(model) == {"lm_head.weight": "transformer.wte.weight"}
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x).logits
    # the canonical state omits tied aliases; which of the two names it kept must not matter
    full = model.state_dict()
    for dropped in ("lm_head.weight", "transformer.wte.weight"):
        out = tmp_path / dropped
        export_hf(out, model, {k: v for k, v in full.items() if k != dropped})
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
        assert "lm_head.weight" not in load_file(out / "model.safetensors")  # as save_pretrained writes it
        loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
        with torch.no_grad():
            assert torch.equal(loaded.eval()(x).logits, want), dropped
    with pytest.raises(FxspeedError, match=r"missing \['transformer.h.0.mlp.c_fc.bias'\]"):
        export_hf(tmp_path / "bad", model, {k: v for k, v in full.items() if k != "transformer.h.0.mlp.c_fc.bias"})
