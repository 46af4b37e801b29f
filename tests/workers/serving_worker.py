"""Run under `fxspeed run -n T -m tests.workers.serving_worker --case CASE --out DIR`.

Tensor-parallel serving: every rank calls fxspeed.serve(model, devices=T, Config(tensor=T)) and
generate with the same prompts (mixed lengths, a token budget of 8 so prompts are split into
chunks beside other requests' decode tokens). Each case compares with the same model run eagerly
in this process (one device, whole weights):

    gpt2, llama, gpt, opt,  greedy tokens equal Hugging Face `generate` (fxspeed's GPT: greedy by
                            hand), every sampled row's logits within 1e-4 (relative to the
                            largest logit, when above 1) of a full forward; the
                            cache holds kv_heads / T heads per rank (the program is cut by heads,
                            not left replicated), the embedding/head is split by vocabulary rows,
                            and the plan counts tp collectives
    gemma3                  (local layers and a global one) the same, and the local layers' cache is a
                            pool of its own, smaller than the global layer's
    llama_fused             llama with the fusion passes on (FXSPEED_FUSE_ON_CPU=1: the fused ops run
                            their torch fallback): the same checks, and each rank's programs hold the
                            fused norms, rotaries, SwiGLU and residual norms on its own heads
    sampling                temperature / top_k sampling with no seed (each rank would draw its own):
                            every rank returns the same tokens
    bad_request             an empty prompt and an out-of-vocabulary id fail alone; the other
                            requests' tokens are those of one device; ranks passing different
                            prompts are refused (ConfigError on every rank) and the engine goes on
    uneven_heads            Llama with 6 query / 3 key/value heads at T=2 (they do not split): served,
                            one device's tokens and logits
    bucket_layouts          a narrow Llama (4 query / 2 key/value heads, hidden 32) on a slow device: a
                            larger bucket, left to the cost model, computed one layer's attention whole
                            and cut the other's heads from keys repeated whole; every bucket now caches
                            1 key/value head per layer per rank, as the first does
    stream_stops            a stream stopped at different tokens on the ranks is an error on the rank
                            that goes on, at its next step; at the same token, none; the engine goes on

Each rank writes "ok" or what went wrong to DIR/{case}_rank{r}.txt (tests/workers/common.py
run_cases).
"""

from __future__ import annotations

import copy
from typing import Any, Callable
import os

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.models import GPT, GPTConfig
from tests.workers.common import run_cases

V = 2048  # the solver splits the embedding/head by vocabulary rows at this size (at 96: whole)
D = 256  # wide enough that the placement cost model splits attention and MLP (narrower: replicated)
PROMPTS = [[5, 17, 3], list(range(10, 30)), [7], [40, 41, 42, 43, 44, 45, 46, 47, 48], list(range(60, 72))]
NEW = [6, 5, 7, 4, 6]
KV_HEADS = {"gpt2": 4, "llama": 2, "gpt": 4, "opt": 4, "gemma3": 2}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        m = GPT(GPTConfig(vocab_size=V, block_size=64, n_layer=2, n_head=4, n_embd=D))
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(4.0)  # away from near-uniform logits, so greedy choices are not ties
        return m.eval()
    import transformers

    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=V, max_position_embeddings=64, attn_implementation="sdpa")
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=4, n_positions=64, vocab_size=V,
                                      attn_implementation="sdpa", initializer_range=0.2)
        return transformers.GPT2LMHeadModel(cfg).eval()
    if name == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=D, intermediate_size=2 * D,
                                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, **common)
        return transformers.LlamaForCausalLM(cfg).eval()
    if name == "opt":
        cfg = transformers.OPTConfig(num_hidden_layers=2, hidden_size=D, ffn_dim=2 * D, num_attention_heads=4,
                                     word_embed_proj_dim=D, init_std=0.2, **common)
        return transformers.OPTForCausalLM(cfg).eval()
    if name == "gemma3":  # local layers (window 5) and a global one: two block tables, two pools
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=3, hidden_size=D, intermediate_size=2 * D,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                            initializer_range=0.2, sliding_window=5,
                                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                            **common)
        return transformers.Gemma3ForCausalLM(cfg).eval()
    if name == "llama_6_3heads":  # 6 query heads split over 2 ranks, 3 key/value heads do not
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=192, intermediate_size=384,
                                       num_attention_heads=6, num_key_value_heads=3, initializer_range=0.2, **common)
        return transformers.LlamaForCausalLM(cfg).eval()
    if name == "llama_narrow":  # small enough that the solver's choices differ between buckets
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, **common)
        return transformers.LlamaForCausalLM(cfg).eval()
    if name == "phi3":  # a fused qkv projection, 4 query / 2 key/value heads
        cfg = transformers.Phi3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                                      initializer_range=0.2, pad_token_id=0,
                                      **{**common, "max_position_embeddings": 128, "vocab_size": 256})
        return transformers.Phi3ForCausalLM(cfg).eval()
    raise ValueError(name)


def logits_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    out = model(torch.tensor([ids]))
    return (out if isinstance(out, torch.Tensor) else out.logits)[0]


def greedy(model: torch.nn.Module, name: str, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        if name != "gpt":
            return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(logits_of(model, seq)[-1].argmax()))
        return seq[len(prompt):]


_SERVED: dict[str, tuple[fxspeed.Engine, torch.nn.Module]] = {}


def served(name: str) -> tuple[fxspeed.Engine, torch.nn.Module]:
    """(the TP engine of model `name`, an eager copy with the whole weights); made once per launch
    and shared by the cases (compiling the buckets is most of a case's time). "<model>_fused":
    compiled with the fusion passes on."""
    if name not in _SERVED:
        T = int(os.environ["WORLD_SIZE"])
        model = build(name.removesuffix("_fused"))
        eager = copy.deepcopy(model)
        fused = name.endswith("_fused")
        if fused:
            os.environ["FXSPEED_FUSE_ON_CPU"] = "1"  # read once, where serve derives the pass options
        try:
            engine = fxspeed.serve(model, devices=T, config=fxspeed.Config(tensor=T), token_budget=8, max_batch=3,
                                   block_size=4, cache_tokens=96)
        finally:
            os.environ.pop("FXSPEED_FUSE_ON_CPU", None)
        _SERVED[name] = engine, eager
    return _SERVED[name]


FUSED_OPS = ("rms_norm_fwd", "add_rms_norm_fwd", "rotary_fwd", "swiglu_fwd")


def case_fused(name: str) -> str:
    engine, _ = served(name)
    for bucket in engine._serving.programs.values():
        ops = {n.target._opname for n in bucket.program.gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "namespace", "") == "fxspeed"}
        if missing := [op for op in FUSED_OPS if op not in ops]:
            return f"not fused on this tp rank: {missing}"
    return case_model(name)


def case_model(name: str) -> str:
    T = int(os.environ["WORLD_SIZE"])
    engine, eager = served(name)
    family = name.removesuffix("_fused")
    heads = engine._serving.cache.tensors["0.k"].shape[2]
    if heads != KV_HEADS[family] // T:
        return f"the cache holds {heads} key/value heads per rank, expected {KV_HEADS[family]} / {T}: not cut by heads"
    by_rows = [full for p, d, b, full in engine._tp.layout.values() if d == 0 and full[0] == V]
    if not by_rows:
        return "the embedding/head is not split by vocabulary rows (vocabulary-parallel) on this rank"
    if engine.plan.tensor != T or engine.plan.tp_collectives_per_step < 2:
        return f"plan: tensor={engine.plan.tensor}, {engine.plan.tp_collectives_per_step} tp collectives per step"
    return generates_like_one_device(engine, eager, family)


def generates_like_one_device(engine: fxspeed.Engine, eager: torch.nn.Module, family: str) -> str:
    """Greedy tokens equal one device's, every sampled row's logits within 1e-4 of a full forward."""
    engine._serving.record_logits = {}
    outs = engine.generate(PROMPTS, max_new_tokens=NEW)
    recorded, engine._serving.record_logits = engine._serving.record_logits, None
    for i, (p, n, o) in enumerate(zip(PROMPTS, NEW, outs)):
        ref = greedy(eager, family, p, n)
        if o != ref:
            return f"request {i}: tokens {o} != one device's {ref}"
        with torch.no_grad():
            full = logits_of(eager, p + o)[len(p) - 1:len(p) + n - 1]
        err = (torch.stack(recorded[i]) - full).abs().max().item()
        scale = max(1.0, full.abs().max().item())  # float32 rounding grows with the logits
        if err > 1e-4 * scale:
            return f"request {i}: logits differ from the eager model's by {err:.3g} (> 1e-4 x {scale:.3g})"
    return "ok"


def case_hybrid_windows() -> str:
    """Gemma3 with local and global layers at T=2: each rank's sliding layers keep a ring of blocks
    in a pool of their own, its global layer every block; one device's tokens and logits."""
    engine, _ = served("gemma3")
    sizes = engine._serving.cache.sizes
    if set(sizes) != {"", "window"} or not sizes["window"] < sizes[""]:
        return f"the cache's pools are {sizes}, expected a smaller 'window' pool beside the global one"
    return case_model("gemma3")


def case_uneven_heads() -> str:
    """Heads that do not split over the ranks (6 query / 3 key/value heads at T=2) are served, not
    refused: what does not divide runs whole on every rank, the rest split; one device's tokens.
    On a device whose slow compute makes every split pay, one layer's values are all-reduced
    between repeat_kv's unsqueeze and expand: the cache still holds the 3 key/value heads of every
    layer, not the 6 repeated ones (it held 6 in that layer)."""
    import dataclasses

    slow = dataclasses.replace(fxspeed.devices("cpu")[0], flops={"fp32": 1e8}, mem_bandwidth=1e7)
    return served_on("llama_6_3heads", slow, [3, 3])


def case_fused_qkv_gqa() -> str:
    """Phi3 (a fused qkv projection, 4 query / 2 key/value heads) on devices whose compute is slow
    next to their links: the solver splits the tokens of one bucket's fused projection and
    all-gathers them after repeat_kv. That bucket cached the 4 repeated heads of one layer where
    the others cached 2, and serve refused the model ("please report this"). Then every bucket
    computed attention whole and cached both key/value heads on each rank; now each rank caches
    its one (the first bucket splits attention by heads where they divide)."""
    return served_on("phi3", fxspeed.DeviceSpec("slow-compute", 1e9, {"fp32": 1e8}, 1e9, 1e12, "cpu"), [1, 1],
                     token_budget=256, max_batch=16, block_size=16, cache_tokens=1024)


def case_bucket_layouts() -> str:
    """Every bucket writes the same cache, so every bucket must cut each layer's heads the same
    way. On this device the 6-token bucket computed layer 0's attention whole on every rank and
    cut layer 1's query heads' keys from keys repeated whole: it cached [2, 2] heads where the
    first bucket cached [1, 1], and serve refused the model ("please report this")."""
    import dataclasses

    slow = dataclasses.replace(fxspeed.devices("cpu")[0], flops={"fp32": 1e8}, mem_bandwidth=1e7)
    return served_on("llama_narrow", slow, [1, 1], token_budget=6, max_batch=3, block_size=3, cache_tokens=90)


def case_gpu_preset() -> str:
    """The H100 preset's costs (as a CPU device): a step saves an all-reduce's latency by computing
    a small Llama's attention whole on every rank, which cached both key/value heads on each rank.
    Served as laid out for its cache: each rank caches its one head, with one device's tokens."""
    import dataclasses

    h100 = dataclasses.replace(fxspeed.devices("H100-80GB")[0], kind="cpu")
    return served_on("llama", h100, [1, 1], token_budget=16, max_batch=4, block_size=4, cache_tokens=128)


def served_on(name: str, device: fxspeed.DeviceSpec, heads: list[int], **serve: Any) -> str:
    """Model `name` served at T=2 on `device`s: the cache holds `heads` per layer on each rank, and
    the tokens and logits are one device's."""
    T = int(os.environ["WORLD_SIZE"])
    model = build(name)
    eager = copy.deepcopy(model)
    serve = {"token_budget": 8, "max_batch": 3, "block_size": 4, "cache_tokens": 96, **serve}
    engine = fxspeed.serve(model, devices=[device] * T, config=fxspeed.Config(tensor=T), **serve)
    if engine.plan.tensor != 2 or engine.plan.tp_collectives_per_step < 2:
        return f"plan: tensor={engine.plan.tensor}, {engine.plan.tp_collectives_per_step} tp collectives per step"
    got = [h for h, _, _ in engine._serving.cache.layout]
    if got != heads:
        return f"the cache holds {got} heads per layer, not {heads}"
    return generates_like_one_device(engine, eager, name)


def case_sampling() -> str:
    engine, _ = served("gpt2")
    outs = engine.generate(PROMPTS, max_new_tokens=NEW, temperature=0.8, top_k=20)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, outs)
    if any(o != every[0] for o in every):
        return f"the ranks sampled different tokens: {every}"
    if [len(o) for o in outs] != NEW:
        return f"lengths {[len(o) for o in outs]} != {NEW}"
    return "ok"


def case_bad_request() -> str:
    engine, eager = served("llama")
    prompts = [PROMPTS[0], [], PROMPTS[1], [3, V + 5]]
    outs = engine.generate(prompts, max_new_tokens=4, on_error="return")
    from fxspeed.runtime.serving import RequestError

    if not (isinstance(outs[1], RequestError) and isinstance(outs[3], RequestError)):
        return f"bad requests were not refused alone: {outs}"
    for i in (0, 2):
        ref = greedy(eager, "llama", prompts[i], 4)
        if outs[i] != ref:
            return f"request {i}: {outs[i]} != one device's {ref}"
    # other prompts of the same lengths on rank 1: the ranks all-reduced activations of different
    # tokens and returned rank 0's choices from the mix, with no error
    mine = [p if dist.get_rank() == 0 else [t + 1 for t in p] for p in PROMPTS]
    try:
        engine.generate(mine, max_new_tokens=NEW)
        return "ranks with different prompts were served"
    except fxspeed.ConfigError as e:
        if "ranks disagree on the requests of engine.generate()" not in str(e):
            return f"unexpected error: {e}"
    if engine.generate(PROMPTS[:1], max_new_tokens=4)[0] != greedy(eager, "llama", PROMPTS[0], 4):
        return "the engine did not serve after the refused call"
    return "ok"


def case_stream_stops() -> str:
    """A stream stopped at different tokens on the ranks: the rank that goes on gets an error at
    its next step, in seconds (it waited in a collective no rank joined until dist_timeout_s);
    stopped at the same token, or one rank at the last token, nothing is said; the engine serves
    on after each."""
    import time

    engine, eager = served("gpt2")
    rank = dist.get_rank()
    total = sum(NEW)

    def take(n: int | None) -> int:
        got = 0
        for _ in engine.stream(PROMPTS, max_new_tokens=NEW):
            got += 1
            if got == n:
                break
        return got

    def told(stop_on_rank0: Callable[[], object], case: str) -> str:
        """Run a stream that rank 0 stops early: "" if rank 1 was told so by the stop error."""
        try:
            stop_on_rank0()
        except fxspeed.FxspeedError as e:
            if rank == 0 or "another tensor-parallel rank stopped iterating" not in str(e):
                return f"unexpected error on rank {rank} ({case}): {e}"
            return ""
        return f"rank 1 was not told that rank 0 stopped ({case})" if rank != 0 else ""

    def stop_at_refused_request() -> None:  # yielded before any step
        for _ in engine.stream([[], *PROMPTS[:2]], max_new_tokens=4):
            if rank == 0:
                break

    def hold_after_break() -> None:  # rank 0 keeps the stream; the next call closes it
        held = engine.stream(PROMPTS, max_new_tokens=NEW)
        for i, _ in enumerate(held):
            if rank == 0 and i == 1:
                break
        hold_after_break.held = held  # type: ignore[attr-defined]

    ok = lambda: engine.generate(PROMPTS[:2], max_new_tokens=4) == [greedy(eager, "gpt2", p, 4) for p in PROMPTS[:2]]  # noqa: E731
    t = time.perf_counter()
    if msg := told(lambda: take(2 if rank == 0 else None), "stopped after 2 tokens"):
        return msg
    if time.perf_counter() - t > 60:
        return f"took {time.perf_counter() - t:.0f} s"
    if not ok():
        return "the engine did not serve after a stream stopped on one rank"
    if take(3) != 3 or not ok():  # the same token on every rank
        return "a stream stopped at the same token on every rank broke the engine"
    if take(total if rank == 0 else None) != total or not ok():  # one rank breaks at the last token
        return "a stream broken at its last token on one rank broke the engine"
    t = time.perf_counter()
    for stop, case in ((stop_at_refused_request, "a refused request"), (hold_after_break, "a held stream")):
        if msg := told(stop, case):
            return msg
        if not ok():  # for the held stream: rank 0's generate closes it first, which tells rank 1
            return f"the engine did not serve after {case}"
    if time.perf_counter() - t > 60:
        return f"the refused-request and held-stream stops took {time.perf_counter() - t:.0f} s"
    return "ok"


CASES = {
    "gpt2": lambda: case_model("gpt2"),
    "llama": lambda: case_model("llama"),
    "gpt": lambda: case_model("gpt"),
    "opt": lambda: case_model("opt"),
    "gemma3": case_hybrid_windows,
    "llama_fused": lambda: case_fused("llama_fused"),
    "sampling": case_sampling,
    "bad_request": case_bad_request,
    "stream_stops": case_stream_stops,
    "uneven_heads": case_uneven_heads,
    "fused_qkv_gqa": case_fused_qkv_gqa,
    "bucket_layouts": case_bucket_layouts,
    "gpu_preset": case_gpu_preset,
}

if __name__ == "__main__":
    run_cases(CASES)
