"""Run under `fxspeed run -n 2 -m tests.workers.pipeline_hf_worker --case CASE --out DIR`.

A 2-stage pipeline (1F1B, 2 micro-batches) of a tiny HF Llama with tied embeddings, against eager
training of the same model in this process (AdamW with Config's settings, the whole batch):

    llama_eval            eval_step after two train steps equals eager's eval loss (the eval
                          trace's module names dropped Llama's own `model.` prefix, so the training
                          split point `model.layers.2` was "not a module the forward runs")
    llama_frozen_tied     the tied embedding/head frozen (requires_grad=False): trains as eager
                          does (a KeyError at the first step: the weight shared by both stages was
                          summed over them though it has no gradient)
    qwen2_position_ids    a 2-layer Qwen2 (q/k/v biases, GQA, tied) given a Hugging Face batch: left
                          padding, explicit position_ids, int32 ids sliced from a wider tensor;
                          against eager's mean of the two micro-batch
                          means (the rotary table's nodes inside layers.1 were offered as the cut
                          "after the last block": stage 0 ended inside layers.1's attention, the
                          split was refused under checkpointing, and without it stage 1 failed
                          with "view size is not compatible" on the q/k/v it received)
    transposed_message    a stage boundary (user split point) crossed by a transposed value whose
                          transpose the next stage views: it travels in its traced layout (it was
                          received contiguous: "view size is not compatible" at the first step)

Each rank writes "ok" or what went wrong to DIR/{case}_rank{r}.txt (tests/workers/common.py).
"""

from __future__ import annotations

import copy
import os

import torch

import fxspeed
from fxspeed.data import local_batch
from tests.workers.common import run_cases


def _llama() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def _compare(freeze: bool, unused: bool = False) -> str:
    model = _llama()
    if freeze:
        model.get_input_embeddings().weight.requires_grad_(False)
    if unused:  # a module forward never calls: no stage reads it, every rank freed it
        model.extra = torch.nn.Linear(8, 8)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": (x := torch.randint(0, 128, (4, 16), generator=g)), "labels": x} for _ in range(2)]
    cfg = fxspeed.Config(pipeline=2, microbatches=2, schedule="1f1b", lr=1e-2)
    engine = fxspeed.compile(model, 2, cfg, example_inputs=batches[0])  # one pipeline: the whole batch
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    for i, b in enumerate(batches):
        got = engine.train_step(**local_batch(b, engine.dp_rank, engine.dp_size))
        if err := _eager_step_agrees(got, ref(**b).loss, opt, i):
            return err
    if err := _weights_agree(engine, ref):
        return err
    state = engine.state_dict()
    if freeze and not torch.equal(state["model.embed_tokens.weight"], _llama().get_input_embeddings().weight):
        return "the frozen embedding moved"
    if unused:  # it survives a checkpoint round trip too
        path = os.path.join(os.environ["WORKER_OUT"], "unused_ckpt")
        engine.save(path)
        engine.load(path)
        if not torch.equal(engine.state_dict()["extra.weight"], ref.extra.weight):
            return "extra.weight changed through save and load"
    with torch.no_grad():
        want = ref.eval()(**batches[0]).loss.item()
    got = engine.eval_step(**local_batch(batches[0], engine.dp_rank, engine.dp_size))
    if abs(got - want) > 1e-5 * abs(want):
        return f"eval loss {got} != eager {want}"
    return "ok"


def _qwen2_position_ids() -> str:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    # a vocabulary large enough that the balanced cut falls late in layers.1 (at 128 it fell between layers)
    cfg = transformers.Qwen2Config(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True, use_cache=False, pad_token_id=0)
    model = transformers.Qwen2ForCausalLM(cfg)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(4, 12, dtype=torch.long)
    for r, pad in enumerate((0, 3, 5, 1)):
        mask[r, :pad] = 0  # left padding
    wide = torch.randint(1, 1024, (4, 24), generator=g, dtype=torch.int32)
    ids = wide[:, ::2]  # not contiguous
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
             "labels": ids.long().masked_fill(mask == 0, -100)}
    cfg = fxspeed.Config(pipeline=2, microbatches=2, lr=1e-2)
    engine = fxspeed.compile(model, 2, cfg, example_inputs=batch)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    for i in range(2):  # the second step reads the first one's updated weights
        got = engine.train_step(**batch)
        # each micro-batch averages over its own targets (as torch's pipelining does)
        want = sum(ref(**{k: v[h * 2:(h + 1) * 2] for k, v in batch.items()}).loss / 2 for h in range(2))
        if err := _eager_step_agrees(got, want, opt, i):
            return err
    return _weights_agree(engine, ref) or "ok"


def _eager_step_agrees(got: float, loss: torch.Tensor, opt: torch.optim.Optimizer, i: int) -> str | None:
    """Step eager on `loss`; None when the engine's loss `got` agrees with it, else what differs."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    if abs(got - loss.item()) > 1e-5 * abs(loss.item()):
        return f"step {i}: loss {got} != eager {loss.item()}"
    return None


def _weights_agree(engine: fxspeed.Engine, ref: torch.nn.Module) -> str | None:
    state = engine.state_dict()
    for n, t in ref.state_dict().items():
        if not torch.allclose(state[n], t, rtol=1e-4, atol=1e-5):
            return f"{n} differs from eager by {(state[n] - t).abs().max().item():.3g}"
    return None


class _MergeHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = t.shape
        return self.proj(t.transpose(1, 2).reshape(b, s, 16))  # traced as a view of the transpose


class _Heads(torch.nn.Module):
    """Stage 1 (`out`) views the transpose of the [B, H, S, D] value stage 0 made by transposing."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 16)
        self.out = _MergeHeads()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        t = self.inp(x).view(b, s, 2, 8).transpose(1, 2) * 2  # [B, 2, S, 8] laid out [B, S, 2, 8]
        return torch.nn.functional.mse_loss(self.out(t), y)


def _transposed_message() -> str:
    torch.manual_seed(0)
    model = _Heads()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
    engine = fxspeed.compile(model, 2, fxspeed.Config(pipeline=2, microbatches=2, split_points=("out",), lr=1e-2),
                             example_inputs=(x, y))
    got = engine.train_step(x, y)
    want = sum(ref(x[h * 2:(h + 1) * 2], y[h * 2:(h + 1) * 2]) / 2 for h in range(2))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    want.backward()  # the gradient message back to stage 0 is laid out as traced too
    opt.step()
    if abs(got - want.item()) > 1e-5 * abs(want.item()):
        return f"loss {got} != eager {want.item()}"
    state = engine.state_dict()
    bad = [n for n, t in ref.state_dict().items() if not torch.allclose(state[n], t, rtol=1e-5, atol=1e-6)]
    return f"{bad} differ from eager after the step" if bad else "ok"


CASES = {"transposed_message": _transposed_message, "qwen2_position_ids": _qwen2_position_ids,
         "llama_eval": lambda: _compare(False), "llama_frozen_tied": lambda: _compare(True),
         "llama_unused": lambda: _compare(False, unused=True)}

if __name__ == "__main__":
    run_cases(CASES)
