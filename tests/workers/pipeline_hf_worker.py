"""Run under `fxspeed run -n 2 -m tests.workers.pipeline_hf_worker --case CASE --out DIR`.

A 2-stage pipeline (1F1B, 2 micro-batches) of a tiny HF Llama with tied embeddings, against eager
training of the same model in this process (AdamW with Config's settings, the whole batch):

    llama_eval            eval_step after two train steps equals eager's eval loss (the eval
                          trace's module names dropped Llama's own `model.` prefix, so the training
                          split point `model.layers.2` was "not a module the forward runs")
    llama_frozen_tied     the tied embedding/head frozen (requires_grad=False): trains as eager
                          does (a KeyError at the first step: the weight shared by both stages was
                          summed over them though it has no gradient)

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
        loss = ref(**b).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if abs(got - loss.item()) > 1e-5 * abs(loss.item()):
            return f"step {i}: loss {got} != eager {loss.item()}"
    state = engine.state_dict()
    for n, t in ref.state_dict().items():
        if not torch.allclose(state[n], t, rtol=1e-4, atol=1e-5):
            return f"{n} differs from eager by {(state[n] - t).abs().max().item():.3g}"
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


CASES = {"llama_eval": lambda: _compare(False), "llama_frozen_tied": lambda: _compare(True),
         "llama_unused": lambda: _compare(False, unused=True)}

if __name__ == "__main__":
    run_cases(CASES)
