"""Run under `fxspeed run -n T -m tests.workers.tensor_parallel_worker --case CASE --out DIR`.

Every rank passes the same (global) batch: with Config(tensor=T) and T devices there is no data
parallelism, so the T ranks together run one step on that batch. Each case compares, after 5
AdamW steps, the loss of every step and every updated parameter (from engine.state_dict(),
gathered to full tensors under their original names) with one process running the same model
eagerly on the same batches: relative error <= 1e-5.

    gpt      fxspeed.models.GPT (fused QKV as nn.Linear(d, 3d)) with Config(grad_clip) (eager
             clip_grad_norm_ on the full gradients); then: the solver chose Megatron's layout
             (attention and MLP column- then row-parallel, QKV split in 3 blocks), each sharded
             Parameter holds 1/T of its elements, plan.summary() lists the placements
    gpt2     Hugging Face GPT2LMHeadModel (Conv1D: fused QKV stored [d, 3d]); then: the step has
             exactly Megatron's collectives, 2 all-reduces per block in forward and 2 in backward
    llama    Hugging Face LlamaForCausalLM with GQA (4 query heads, 2 key/value heads) with grad_clip;
             then: the same collective count (at TP=4, fewer key/value heads than ranks: each
             replicated over 2 ranks, + one all-reduce per k/v gradient), the layout, and
             eval_step equals the eager loss of the trained model
    bert     Hugging Face BertForMaskedLM (post-norm, separate q/k/v with biases, tied decoder)
    t5       Hugging Face T5ForConditionalGeneration (encoder-decoder, relative position bias)
    gpt_dp   GPT at TP=2 x DP=WORLD_SIZE/2 (ZeRO-0) with grad_clip: each replica trains on its rows
             of the global batch, compared with one process on the whole batch
    gpt_dp_zero2, gpt_dp_zero3  the same with ZeRO-2 and ZeRO-3; ZeRO-3 then writes a checkpoint
             (gpt_dp_zero3_ckpt) and takes one more step
    gpt_sp, llama_sp  sequence parallelism (Config(sequence_parallel=True)) at TP=2: parity, and the
             all-gathers / reduce-scatters counted
    gpt_pp   GPT at TP=2 x PP=2 (x DP=WORLD_SIZE/4), two micro-batches, clipping; eval_step, checkpoint
    gpt_pp_zero1  the same with ZeRO-1 (3D with 8 ranks)
    eval_draws_pp  (4 ranks) eval_step at TP=2 x PP=2 of a model drawing in eval mode (F.dropout), tp
             ranks seeded by rank: every rank returns the loss of ranks seeded alike
    gpt_bf16 GPT under Config(precision="bf16"): losses and weights for the test to compare with one
             bf16 process (tests/test_tensor_parallel.py)
    gpt_dp_bf16  the same at TP=2 x DP=WORLD_SIZE/2 with ZeRO-1: master weights per tp slice
    gpt_dp_bf16_offload  that layout with clipping, masters + moments in the offload file vs in
             memory: bit for bit
    gpt_offload_tiers  TP=2 x DP=WORLD_SIZE/2, ZeRO-3 bf16, clipping, save/load: offload
             "optimizer", "parameters" and "all" bit for bit alike

    tiny_unsharded  a model too small to shard (2 x 8 wide): the solver keeps every weight whole and
             the engine warns that the tp ranks compute the same thing (it said nothing)
    tiny_unsharded_pp  the same under TP=2 x PP=2 (the pipeline's engine said nothing)
    subgroup_timeout  (4 ranks, last: it leaves a tp group timed out) the mesh's groups hold the
             layout's ranks; a rank alone in a tp all-reduce fails at the mesh's timeout

Each rank writes "ok" or what went wrong to DIR/{case}_rank{r}.txt and exits 0 (`--case all`:
every case in one launch; tests/workers/common.py run_cases, shared with correctness_worker).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.errors import ConfigError, FxspeedError
from fxspeed.mesh import stream_seed
from fxspeed.runtime.tensor_parallel import take_slice
from fxspeed.models import GPT, GPTConfig
from tests.workers.common import key_bias_masked, run_cases

STEPS = 5
D = 256  # wide enough that the cost model finds sharding attention worth its all-reduces (see the test)
# Adam's eps at 1e-6, not 1e-8: an element whose gradient is float noise (~1e-9 here) would take a
# step of +-lr in either direction (lr * g / (|g| + eps)); with 1e-6 it moves by at most lr/1000.
# Checked with SGD instead (tests/test_tensor_parallel.py docstring): parameters agree to 7e-7.
EPS = 1e-6
# The cases with clipping step with SGD + momentum: Adam's update barely depends on a gradient
# scale (it divides by the root mean square), so it would hide a wrong clip norm, while its
# near-zero gradients turn float noise into +-lr steps (a zero-initialized bias then differs by
# 2.6e-5 relative after 5 steps with every gradient equal to 1e-6). With SGD every parameter
# agrees to 7e-7.
CLIPPED = dict(lr=1e-2, optimizer="sgd", momentum=0.9, grad_clip=1.0)  # the gradient norm is ~8: clipped
V = 2048  # large enough that the vocabulary-parallel embedding, head and cross-entropy pay off
# Outside the blocks, with the vocabulary split (Megatron's count too): forward the embedding's
# partial sum, the logits' row max and row sum of exp, the picked log-probabilities (the loss);
# backward the log-softmax gradient's row sum and the head's input gradient.
VOCAB_PARALLEL_REDUCES = 6


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=2, n_head=4, n_embd=D))
    if name == "gpt_dropout":  # embedding, attention-probability and residual dropout
        return GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=2, n_head=4, n_embd=D, dropout=0.1))
    import transformers

    if name == "gpt2_dropout":  # Hugging Face's defaults: 0.1 on embeddings, attention and residuals
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=D, n_head=4, vocab_size=V, n_positions=16, use_cache=False))

    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=D, n_head=4, vocab_size=V, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=False))
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=D, num_attention_heads=4, intermediate_size=2 * D, vocab_size=V,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * D,
            vocab_size=V, max_position_embeddings=16, use_cache=False))
    if name == "gpt2_3heads":  # heads that do not split over 2 ranks
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=192, n_head=3, vocab_size=V, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=False))
    if name == "gpt2_3heads_dropout":  # the same with Hugging Face's dropouts: SDPA traces as its math form
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=192, n_head=3, vocab_size=V, n_positions=16, use_cache=False))
    if name == "llama_6_3heads":  # 6 query heads split over 2 ranks, 3 key/value heads do not
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=192, num_attention_heads=6, num_key_value_heads=3, intermediate_size=384,
            vocab_size=V, max_position_embeddings=16, use_cache=False))
    if name == "t5":  # encoder-decoder: relative position bias, tied shared embedding, cross-attention
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=V, d_model=D, d_kv=64, d_ff=2 * D, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    raise ValueError(name)


def batches(name: str, ignored: bool = True) -> list:
    """STEPS batches; `ignored`: 5 targets of the first row are the ignore index. Not with
    replicas: each averages over its own rows' targets (as DDP does), which equals the global
    mean only when every replica's rows count the same targets."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, V, (2, 16), generator=g)
        y = torch.randint(0, V, (2, 16), generator=g)
        if ignored:  # the mean divides by the targets counted over every tp rank's rows of the vocabulary
            y[0, :5] = -100
        out.append((x, y) if name in ("gpt", "gpt_dropout") else {"input_ids": x, "labels": y})
    return out


def _call(model: torch.nn.Module, b: object) -> torch.Tensor:
    out = model(*b) if isinstance(b, tuple) else model(**b)
    return out if torch.is_tensor(out) else out.loss


def _eager(model: torch.nn.Module, bs: list, config: fxspeed.Config, replicas: int = 1) -> list[float]:
    """Eager steps on the global batches `bs`. `replicas` > 1: each replica's rows drawn from its
    own stream, as the engine draws them (fxspeed.mesh.stream_seed(replica, 0), taken from the
    generator's state before the step; the generator moves by that one draw)."""
    if config.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=getattr(config, "momentum", 0.0),
                              weight_decay=config.weight_decay)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas, eps=config.eps,
                                weight_decay=config.weight_decay)
    losses = []
    for b in bs:
        if replicas == 1:
            loss = _call(model, b)
        else:
            before, seeds = torch.get_rng_state(), []
            for d in range(replicas):
                torch.set_rng_state(before)
                seeds.append(stream_seed(d, 0))
            after = torch.get_rng_state()
            loss = 0.0
            for d in range(replicas):
                torch.manual_seed(seeds[d])
                loss = loss + _call(model, _rows(b, d, replicas)) / replicas
            torch.set_rng_state(after)
        loss.backward()
        if config.grad_clip is not None:
            # The norm in float64: torch's fp32 CPU vector_norm of the 2048 x 256 embedding gradient
            # is 5.9e-5 below the exact value (measured), which clipping turns into a 1.3e-5 error of
            # every update; fxspeed under tp sums the slices' squares (exact to 1e-7 here).
            norm = torch.stack([p.grad.double().pow(2).sum() for p in model.parameters()]).sum().sqrt()
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), config.grad_clip, norm.float())
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _masked(name: str, t: torch.Tensor) -> torch.Tensor:
    """key_bias_masked, and BERT's separate key bias: its true gradient is exactly zero too."""
    return torch.zeros_like(t) if name.endswith("attention.self.key.bias") else key_bias_masked(name, t)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def parity(name: str, config: fxspeed.Config | None = None, check: Any = None, devices: Any = None) -> str:
    world = int(os.environ["WORLD_SIZE"])
    T = config.tensor if config is not None else world
    # lr 1e-4: Adam turns float noise on near-zero gradients into +-lr steps (with SGD the largest
    # relative error after 5 steps is 7e-7; at lr 1e-3 Adam's is 3e-5); see the test module.
    config = config or fxspeed.Config(tensor=T, lr=1e-4, eps=EPS)
    model = build(name)
    ref = copy.deepcopy(model)
    # Ignored targets only where one program sees the whole batch: replicas and micro-batches each
    # average over their own rows' targets (as DDP does).
    bs = batches(name, ignored=world == T and config.pipeline == 1)
    # Replicas (world > T x P) each take their rows of the global batch; the eager run takes all.
    tp_pp = T * config.pipeline
    replicas, replica = world // tp_pp, int(os.environ["RANK"]) // tp_pp
    mine = [_rows(b, replica, replicas) for b in bs]
    # Dropout: eager draws from the generator state every rank has now (build seeded it); the
    # engine gives the tp ranks their group's first rank's generator, so a tp rank moved apart
    # (seeded by rank, or drawing alone) still draws the masks one process would.
    rng = torch.get_rng_state()
    if "dropout" in name and int(os.environ["RANK"]) % T:
        torch.rand(int(os.environ["RANK"]) * 7)
    engine = fxspeed.compile(model, devices or world, config, example_inputs=mine[0])
    got = [engine.train_step(**b) if isinstance(b, dict) else engine.train_step(*b) for b in mine]
    torch.set_rng_state(rng)
    want = _eager(ref, bs, config)
    for i, (g, w) in enumerate(zip(got, want)):
        if abs(g - w) > 1e-5 * abs(w):
            return f"{name}: step {i} loss {g} != eager {w}"
    state = engine.state_dict()
    if os.environ.get("TP_DEBUG"):
        errs = sorted(((_rel(_masked(n, state[n]), _masked(n, p.detach())), n)
                       for n, p in ref.named_parameters()), reverse=True)
        print(errs[:6], got, want)
    for n, p in ref.named_parameters():
        if n not in state:
            return f"{name}: state_dict has no {n}"
        if tuple(state[n].shape) != tuple(p.shape):
            return f"{name}: state_dict {n} has shape {tuple(state[n].shape)}, the model {tuple(p.shape)}"
        err = _rel(_masked(n, state[n]), _masked(n, p.detach()))
        if err > 1e-5:
            return f"{name}: parameter {n} after {STEPS} steps: relative error {err:.2e}"
    return check(engine, model, ref, bs) if check is not None else "ok"


def _rows(b: Any, i: int, n: int) -> Any:
    """Replica i's rows (of n) of every tensor of batch `b`."""
    cut = lambda t: t[i * t.shape[0] // n:(i + 1) * t.shape[0] // n]  # noqa: E731
    return {k: cut(v) for k, v in b.items()} if isinstance(b, dict) else tuple(cut(t) for t in b)


def _collectives(engine: Any) -> dict[str, int]:
    c10d = torch.ops._c10d_functional
    gm = engine.graph()
    return {k: sum(1 for n in gm.graph.nodes if n.target == t)
            for k, t in (("all_reduce", c10d.all_reduce.default), ("all_gather", c10d.all_gather_into_tensor.default))}


def save_and_step(engine: Any, model: torch.nn.Module, ref: torch.nn.Module, bs: list, tag: str) -> str:
    """A checkpoint of full tensors (optimizer states gathered over tp, and over dp from ZeRO
    shards), then one more step on bs[0] (each replica its rows): the test loads {tag}_ckpt on
    one device, takes that step on the whole batch and compares with {tag}_after.pt. Then the
    checkpoint is loaded back into this engine and the step taken again: the same weights."""
    out = os.environ["WORKER_OUT"]
    engine.save(os.path.join(out, f"{tag}_ckpt"))
    # A state_dict kept for later (the best model so far) is a snapshot under tp: the norms and
    # biases, replicated over tp, were the live Parameters and moved on with the next step.
    kept = engine.state_dict()
    then = {n: t.clone() for n, t in kept.items()}
    per_replica = engine.config.tensor * engine.config.pipeline
    replicas = int(os.environ["WORLD_SIZE"]) // per_replica
    batch = _rows(bs[0], int(os.environ["RANK"]) // per_replica, replicas)
    engine.train_step(*batch)
    moved = [n for n, t in kept.items() if not torch.equal(t, then[n])]
    if moved:
        return f"engine.state_dict() kept before a step changed with it: {moved[:4]} ({len(moved)} of {len(kept)})"
    state = {n: t.clone() for n, t in engine.state_dict().items()}
    if int(os.environ["RANK"]) == 0:
        torch.save(state, os.path.join(out, f"{tag}_after.pt"))
    # The checkpoint loads back into this mesh too (full tensors -> this rank's slices and shards):
    # the same step from it gives the same weights.
    engine.load(os.path.join(out, f"{tag}_ckpt"))
    engine.train_step(*batch)
    for n, t in engine.state_dict().items():
        err = float((t - state[n]).norm() / state[n].norm().clamp_min(1e-12))
        if err > 1e-6:
            return f"{n} after loading the {tag} checkpoint into this mesh and stepping again: relative error {err:.2e}"
    return "ok"


def gpt() -> str:
    """With grad_clip (the global norm sums slices over tp); then the layout the solver chose."""
    T = int(os.environ["WORLD_SIZE"])

    def layout(engine: Any, model: torch.nn.Module, ref: torch.nn.Module, bs: list) -> str:
        placed = engine.plan.tp_placements
        if placed.get("wte.weight") != "S(0)":
            return f"the tied embedding/head is placed {placed.get('wte.weight')}, not by vocabulary rows S(0)"
        want = {"attn.qkv.weight": "S(0,blocks=3)", "attn.proj.weight": "S(1)", "mlp.fc.weight": "S(0)",
                "mlp.proj.weight": "S(1)"}
        for b in range(2):
            for suffix, p in want.items():
                n = f"blocks.{b}.{suffix}"
                if placed.get(n) != p:
                    return f"{n} placed {placed.get(n)}, Megatron's is {p} (placements: {placed})"
        full = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            if placed[n].startswith("S") and p.numel() * T != full[n].numel():
                return f"{n} holds {tuple(p.shape)} of {tuple(full[n].shape)} on this rank, not 1/{T}"
        if "tensor parallel placements" not in engine.plan.summary():
            return "plan.summary() does not show the placements"
        # an edit of a sliced weight inside gathered() goes into each rank's slice; so does undoing it
        name = "blocks.0.mlp.fc.weight"
        with engine.gathered(), torch.no_grad():
            before = dict(model.named_parameters())[name].clone()
            dict(model.named_parameters())[name].mul_(0.5)
        if not torch.equal(engine.state_dict()[name], before * 0.5):
            return f"{name} halved inside engine.gathered() is not halved in engine.state_dict()"
        with engine.gathered(), torch.no_grad():
            dict(model.named_parameters())[name].copy_(before)
        # weights loaded by hand outside gathered(): `p.data = whole` is cut to this rank's slice
        # (the step failed with a bare reshape error and left the ranks out of step for good); a
        # tensor of another shape is refused before the step, naming the parameter
        p = dict(model.named_parameters())[name]
        mine = p.data
        p.data = before * 0.25
        if not torch.equal(engine.state_dict()[name], before * 0.25) or p.shape == before.shape:
            return f"{name} assigned whole through .data is not taken as this rank's slice"
        p.data = before[:3].clone()
        try:
            engine.state_dict()
            return "a parameter given a tensor of another shape through .data was not refused"
        except FxspeedError as e:
            if name not in str(e) or "engine.gathered()" not in str(e):
                return f"unclear refusal of a re-shaped parameter: {e}"
        with torch.no_grad():
            mine.copy_(take_slice(before, 0, 1, dist.get_rank(), T))
        p.data = mine
        # the module holds slices: called directly it computed with half the weights, and its
        # state_dict() was a checkpoint of slices, silently; both refused (gathered() allows it)
        for what, call, hint in (("called", lambda: model(*bs[0]), "engine.gathered()"),
                                 ("state_dict()", model.state_dict, "engine.state_dict()")):
            try:
                call()
                return f"the module holding tp slices was {what} with no error"
            except FxspeedError as e:
                if "tensor-parallel" not in str(e) or hint not in str(e):
                    return f"unclear refusal of {what}: {e}"
        with engine.gathered():
            model(*bs[0])
        # tp ranks passing other rows (local_batch(batch) splits by the global rank): they
        # all-reduced partial results of different rows with no error; refused, state untouched
        other = tuple(torch.roll(t, dist.get_rank(), 0) for t in bs[0])
        try:
            engine.train_step(*other)
            return "tp ranks given different batches trained"
        except ConfigError as e:
            if "ranks disagree on the batch of train_step" not in str(e):
                return f"unexpected error for different batches: {e}"
        return save_and_step(engine, model, ref, bs, tag="gpt")

    return parity("gpt", fxspeed.Config(tensor=T, **CLIPPED), layout)


def gpt_dropout() -> str:
    """Dropout under tensor parallelism, eager's masks under the same seed (a tp rank's generator
    moved apart first); the attention probabilities' dropout runs on this rank's heads, no
    activation gathered for it."""
    def heads(engine: Any, *_: Any) -> str:
        counts = _collectives(engine)
        return "ok" if counts["all_gather"] == 0 else f"all-gathers around dropout: {counts}"

    return parity("gpt_dropout", check=heads)


class _HeldGeneratorMLP(torch.nn.Module):
    """An MLP whose output (replicated under tp: after the row-parallel all-reduce) is masked with
    numbers from a generator the module holds, seeded here by rank (a script seeding per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)
        self.gen = torch.Generator().manual_seed(100 + int(os.environ["RANK"]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(torch.relu(self.fc(x)))
        keep = torch.rand(h.shape, generator=self.gen) > 0.5
        return torch.nn.functional.mse_loss(h * keep, y)


def held_generator() -> str:
    """A torch.Generator the module holds, seeded by rank, at TP=2: the tp ranks draw from the
    first rank's state, as one process would (each drew from its own: the loss was the mean of two
    masks' losses and the replicated activations differed between the ranks, silently)."""
    torch.manual_seed(0)
    model = _HeldGeneratorMLP()
    ref = copy.deepcopy(model)
    ref.gen.manual_seed(100)  # rank 0's
    g = torch.Generator().manual_seed(1)
    bs = [(torch.randn(16, D, generator=g), torch.randn(16, D, generator=g)) for _ in range(3)]
    config = fxspeed.Config(tensor=2, optimizer="sgd", lr=0.1)
    engine = fxspeed.compile(model, 2, config, example_inputs=bs[0])
    if engine.plan.tp_placements.get("fc.weight") in (None, "R"):
        return f"the MLP is not sharded: {engine.plan.tp_placements}"
    got = [engine.train_step(*b) for b in bs]
    want = _eager(ref, bs, config)
    for i, (a, w) in enumerate(zip(got, want)):
        if abs(a - w) > 1e-5 * abs(w):
            return f"step {i} loss {a} != eager {w} with rank 0's generator"
    return "ok"


def gpt2_dropout() -> str:
    return parity("gpt2_dropout")


def gpt2() -> str:
    """Fused Conv1D QKV; Megatron's collectives: 2 all-reduces per block forward, 2 backward."""
    def count(engine: Any, *_: Any) -> str:
        got = _collectives(engine)
        want = {"all_reduce": 4 * 2 + VOCAB_PARALLEL_REDUCES, "all_gather": 0}
        return "ok" if got == want else f"collectives in the 2-block step: {got}, Megatron's are {want}"

    return parity("gpt2", check=count)


def llama() -> str:
    """GQA (4 query heads, 2 key/value heads) with clipping; then eval_step on the trained engine.
    At TP=2 Megatron's layout and collectives. At TP=4 (fewer key/value heads than ranks) the same
    with each key/value head replicated over the 2 ranks whose query heads read it: k and v split
    over the kv groups (S(0,rep=2): ranks 0-1 hold head 0, ranks 2-3 head 1), Megatron's 2
    all-reduces per block each way plus one per k/v gradient (the sum over the group, made in the
    step); the clip norm counts a shared slice once."""
    T = int(os.environ["WORLD_SIZE"])

    def evaluate(engine: Any, model: torch.nn.Module, ref: torch.nn.Module, bs: list) -> str:
        got = _collectives(engine)
        kv_grads = 2 * 2 if T == 4 else 0  # 2 blocks x (k, v)
        want = {"all_reduce": 8 + VOCAB_PARALLEL_REDUCES + kv_grads, "all_gather": 0}
        if T in (2, 4) and got != want:
            return f"collectives in the 2-block Llama step at TP={T}: {got}, Megatron's are {want}"
        placed = engine.plan.tp_placements
        kv = "S(0,rep=2)" if T == 4 else "S(0)"
        for suffix, p in (("q_proj", "S(0)"), ("k_proj", kv), ("v_proj", kv), ("o_proj", "S(1)")):
            n = f"model.layers.1.self_attn.{suffix}.weight"
            if T in (2, 4) and placed.get(n) != p:
                return f"{n} placed {placed.get(n)}, Megatron's is {p} (placements: {placed})"
        return _evaluates_like_eager(engine, model, ref, bs)

    return parity("llama", fxspeed.Config(tensor=T, **CLIPPED), check=evaluate)


def uneven_heads() -> str:
    """Heads that do not split over the tp ranks (GPT-2 with 3 heads, without and with Hugging
    Face's dropouts; Llama with 6 query heads and 3 key/value heads) are not refused: the engine
    warns (under attention dropout too, SDPA's math form: seen by its softmax), every tp rank
    computes whole what does not divide (GPT-2's attention; Llama's key/value heads), and the rest
    is still split (on a device whose slow compute makes every split pay): parity with one
    process, the MLP split, no attention weight split by heads."""
    import warnings

    T = int(os.environ["WORLD_SIZE"])
    slow = [dataclasses.replace(fxspeed.devices("cpu")[0], flops={"fp32": 1e8}, mem_bandwidth=1e7)] * T

    def split_mlp(weight: str, by_heads: str, mlp: str) -> Any:
        def check(engine: Any, *_: Any) -> str:
            placed = engine.plan.tp_placements
            if not str(placed.get(mlp, "")).startswith("S"):
                return f"{mlp} placed {placed.get(mlp)}: the MLP should still be split ({placed})"
            if str(placed.get(weight, "")).startswith(by_heads):  # its output dim: the heads
                return f"{weight} placed {placed.get(weight)}: split by heads that do not divide by {T}"
            return "ok"
        return check

    for name, heads, weight, by_heads, mlp in (
            ("gpt2_3heads", "3 query heads and 3 key/value heads", "transformer.h.1.attn.c_attn.weight", "S(1",
             "transformer.h.1.mlp.c_fc.weight"),
            ("llama_6_3heads", "6 query heads and 3 key/value heads", "model.layers.1.self_attn.k_proj.weight",
             "S(0", "model.layers.1.mlp.up_proj.weight"),
            # SDPA's math form (attention dropout) has no one op: its heads are read off its softmax
            # over keys times the values, as eager attention's
            ("gpt2_3heads_dropout", "3 query heads and 3 key/value heads", "transformer.h.1.attn.c_attn.weight", "S(1",
             "transformer.h.1.mlp.c_fc.weight")):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = parity(name, fxspeed.Config(tensor=T, lr=1e-4, eps=EPS), check=split_mlp(weight, by_heads, mlp),
                         devices=slow)
        if got != "ok":
            return got
        said = [str(w.message) for w in seen if heads and heads in str(w.message)]
        if heads and (len(said) != 1 or "it is not split by heads" not in said[0]):
            return f"{name}: expected one warning naming {heads}, got {[str(w.message) for w in seen]}"
    return "ok"


def _evaluates_like_eager(engine: Any, model: torch.nn.Module, ref: torch.nn.Module, bs: list) -> str:
    """eval_step on the trained engine (a second program, laid out by the first's placements)
    gives eager's eval loss."""
    loss = engine.eval_step(**bs[0])
    loss = float(getattr(loss, "loss", loss))
    ref.eval()
    with torch.no_grad():
        want_loss = float(_call(ref, bs[0]))
    return "ok" if abs(loss - want_loss) <= 1e-5 * abs(want_loss) else f"eval_step loss {loss} != eager {want_loss}"


def t5() -> str:
    """T5ForConditionalGeneration (encoder-decoder, relative attention bias, tied embeddings). At
    these sizes on the cpu model the solver splits the MLPs and keeps attention whole; the split
    by heads is checked in process (tests/test_tensor_parallel.py, slow-compute device). Then
    eval_step: its trace names the tied embedding shared.weight where the train step's named it
    encoder.embed_tokens.weight, and the eval program failed on the name it had no placement for."""
    return parity("t5", check=_evaluates_like_eager)


def bert() -> str:
    """BertForMaskedLM (post-norm, separate q/k/v with biases, tied decoder); then eval_step (the
    tied decoder's bias is named apart by the two traces too)."""
    return parity("bert", check=_evaluates_like_eager)


def gpt_dp() -> str:
    """TP=2 x DP=WORLD_SIZE/2 with ZeRO-0 and clipping."""
    return parity("gpt", fxspeed.Config(tensor=2, **CLIPPED))


def gpt2_dropout_dp() -> str:
    """TP=2 x DP=WORLD_SIZE/2 (ZeRO-1, clipping) with Hugging Face GPT-2's dropouts: a replica's
    tp ranks draw one process's masks (one tp rank's generator moved apart first), each replica
    from its own stream; equals eager's steps over the replicas' rows with those streams (both
    replicas drew the same masks before each drew its own)."""
    config = fxspeed.Config(tensor=2, zero=1, **CLIPPED)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    replicas, replica = world // 2, rank // 2
    model = build("gpt2_dropout")
    ref = copy.deepcopy(model)
    bs = batches("gpt2_dropout", ignored=False)[:2]  # (each step costs ~1 s on 4 ranks: two show the streams)
    rng = torch.get_rng_state()
    if rank % 2:
        torch.rand(rank * 7)
    engine = fxspeed.compile(model, world, config, example_inputs=_rows(bs[0], replica, replicas))
    got = [engine.train_step(**_rows(b, replica, replicas)) for b in bs]
    torch.set_rng_state(rng)
    want = _eager(ref, bs, config, replicas)
    for i, (g, w) in enumerate(zip(got, want)):
        if abs(g - w) > 1e-5 * abs(w):
            return f"step {i} loss {g} != eager {w} over the replicas' own streams"
    state = engine.state_dict()
    for n, p in ref.named_parameters():
        err = _rel(_masked(n, state[n]), _masked(n, p.detach()))
        if err > 1e-5:
            return f"parameter {n} after {len(bs)} steps: relative error {err:.2e}"
    return "ok"


def gpt_dp_zero2() -> str:
    """TP=2 x DP=WORLD_SIZE/2 with ZeRO-2 (flat shards of tp slices; the clip norm counts each
    element once over dp x tp)."""
    return parity("gpt", fxspeed.Config(tensor=2, zero=2, **CLIPPED))


def gpt_dp_zero3() -> str:
    """TP=2 x DP=WORLD_SIZE/2 with ZeRO-3 (tp slices sharded over dp, gathered in the step), then
    a checkpoint the test resumes on one device."""
    def then(engine: Any, model: torch.nn.Module, ref: torch.nn.Module, bs: list) -> str:
        placed = engine.plan.tp_placements  # the parameters are bucket shards in this program
        if len(placed) != len(list(model.parameters())) or "S(0)" not in placed.values():
            return f"plan.tp_placements under ZeRO-3 lists {len(placed)} parameters: {placed}"
        return save_and_step(engine, model, ref, bs, tag="gpt_dp_zero3")

    return parity("gpt", fxspeed.Config(tensor=2, zero=3, **CLIPPED), check=then)


def gpt_pp() -> str:
    """TP=2 x PP=2 (x DP=WORLD_SIZE/4), two micro-batches, clipping: each stage program runs its
    own tp collectives; the tied embedding/head lives on both ends of the pipeline, sliced the
    same way on each; then eval_step and a checkpoint the test resumes on one device."""
    def then(engine: Any, model: torch.nn.Module, ref: torch.nn.Module, bs: list) -> str:
        placed = engine.plan.tp_placements
        if placed.get("wte.weight") != "S(0)" or placed.get("head.weight") != "S(0)":
            return f"the tied embedding/head are placed {placed.get('wte.weight')} / {placed.get('head.weight')}"
        if "pipeline" not in engine.plan.summary() or "tensor parallel placements" not in engine.plan.summary():
            return "plan.summary() lacks the pipeline or the tp placements"
        loss = engine.eval_step(*bs[0])
        ref.eval()
        with torch.no_grad():
            want = float(ref(*bs[0]))
        ref.train()
        if abs(loss - want) > 1e-5 * abs(want):
            return f"eval_step loss {loss} != eager {want}"
        return save_and_step(engine, model, ref, bs, tag="gpt_pp")

    return parity("gpt", fxspeed.Config(tensor=2, pipeline=2, microbatches=_micro(), **CLIPPED), then)


class _EvalDrawsBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # F.dropout's training=True default: it draws in eval mode too (a dropout module would not)
        return h + torch.nn.functional.dropout(self.proj(torch.relu(self.fc(h))), 0.5)


class _EvalDrawsStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_EvalDrawsBlock(), _EvalDrawsBlock()])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return torch.nn.functional.mse_loss(x, y)


def eval_draws_pp() -> str:
    """eval_step at TP=2 x PP=2 of a model that draws in eval mode, on a replicated activation
    (after the row-parallel all-reduce), with the tp ranks' generators seeded by rank: the tp
    ranks share their first rank's generator and the positions take their own streams, as in the
    train step, so every rank returns the loss the ranks seeded alike return (each tp rank
    returned another loss: 2.3367 / 2.3874)."""
    torch.manual_seed(0)
    model = _EvalDrawsStack()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, D, generator=g), torch.randn(4, 8, D, generator=g)
    slow = [fxspeed.DeviceSpec("slow", 1e10, {"fp32": 1e6}, 1e6, 1e12, "cpu")] * 4  # the MLPs get sharded
    engine = fxspeed.compile(model, slow, fxspeed.Config(tensor=2, pipeline=2, microbatches=2,
                                                         split_points=("blocks.1",)), example_inputs=(x, y))
    if not str(engine.plan.tp_placements.get("blocks.0.fc.weight")).startswith("S"):
        return f"the MLP is not sharded: {engine.plan.tp_placements}"
    rank = int(os.environ["RANK"])
    losses = []
    for apart in (False, True):
        torch.manual_seed(99 + rank if apart and rank % 2 else 5)  # (tp rank 0 of each stage: 5)
        losses.append(engine.eval_step(x, y))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    return "ok" if len({v for ls in every for v in ls}) == 1 else f"eval losses per rank (alike, apart): {every}"


def _micro() -> int:
    """Micro-batches for TP=2 x PP=2: the 2 rows of each replica's batch (1 with 2 replicas)."""
    return max(1, 8 // int(os.environ["WORLD_SIZE"]))


def _sp_collectives(engine: Any) -> dict:
    """(kind, forward/backward, whether it moves a [tokens, hidden] activation) -> count."""
    from fxspeed.ir import FORWARD, info

    c10d = torch.ops._c10d_functional
    kinds = {c10d.all_reduce.default: "all_reduce", c10d.all_gather_into_tensor.default: "all_gather",
             c10d.reduce_scatter_tensor.default: "reduce_scatter"}
    tokens, got = 2 * 16, {}
    for n in engine.graph().graph.nodes:
        if n.target in kinds:
            big = n.meta["val"].numel() in (tokens * D, tokens * D // 2)
            key = (kinds[n.target], "forward" if info(n).role == FORWARD else "backward", big)
            got[key] = got.get(key, 0) + 1
    return got


def sequence_parallel(name: str, config: fxspeed.Config) -> str:
    """Sequence parallelism at TP=2: the residual stream split by tokens; then the collectives
    that move [tokens, hidden] activations are Megatron's sequence-parallel ones: in each block,
    forward and backward, 2 all-gathers (before the column-parallel matmuls) and 2 reduce-scatters
    (after the row-parallel ones), plus one of each outside the blocks (the embedding's partial sum
    reduce-scattered, the last norm's output gathered for the vocabulary-parallel head), and no
    activation all-reduced whole."""
    def count(engine: Any, *_: Any) -> str:
        got = _sp_collectives(engine)
        want = 2 * 2 + 1  # 2 blocks
        for role in ("forward", "backward"):
            for kind in ("all_gather", "reduce_scatter"):
                if got.get((kind, role, True), 0) != want:
                    return f"{role}: {got.get((kind, role, True), 0)} {kind}s of [tokens, hidden], want {want}: {got}"
            if got.get(("all_reduce", role, True)):
                return f"{role}: an activation is all-reduced whole under sequence parallelism: {got}"
        return "ok"

    return parity(name, config, count)


def gpt_sp() -> str:
    """fxspeed's GPT (LayerNorm, fused QKV, biases) with sequence parallelism and clipping."""
    return sequence_parallel("gpt", fxspeed.Config(tensor=2, sequence_parallel=True, **CLIPPED))


def gpt_dropout_sp() -> str:
    """Dropout under sequence parallelism: the residual dropouts run on this rank's tokens (the
    whole mask drawn), eager's masks. (Parity only: with dropout the GPT's attention is traced as
    bmm + softmax, not the fused op, and at these sizes the solver then prefers another layout
    than Megatron's.)"""
    return parity("gpt_dropout", fxspeed.Config(tensor=2, sequence_parallel=True, **CLIPPED))


def llama_sp() -> str:
    """Llama (RMSNorm as pointwise ops, GQA, no biases) with sequence parallelism."""
    return sequence_parallel("llama", fxspeed.Config(tensor=2, sequence_parallel=True, lr=1e-4, eps=EPS))


def gpt_pp_zero1() -> str:
    """TP=2 x PP=2 x DP=WORLD_SIZE/4 with ZeRO-1 (3D on 8 ranks: `fxspeed run -n 8 -m
    tests.workers.tensor_parallel_worker --case gpt_pp_zero1,gpt_pp_sp_zero1`; kept out of the
    suite for time)."""
    return parity("gpt", fxspeed.Config(tensor=2, pipeline=2, microbatches=_micro(), zero=1, **CLIPPED))


def gpt_pp_sp_zero1() -> str:
    """The same with sequence parallelism: stage messages are each tp rank's token shard."""
    return parity("gpt", fxspeed.Config(tensor=2, pipeline=2, microbatches=_micro(), zero=1, sequence_parallel=True,
                                        **CLIPPED))


BF16 = dict(lr=1e-4, eps=EPS, precision="bf16")


def gpt_bf16() -> str:
    """bf16 under TP=2 (bf16 matmuls, partial sums all-reduced in bf16, fp32 weights): writes the
    losses and the trained weights; the test compares them with one bf16 process."""
    T = int(os.environ["WORLD_SIZE"])
    model, bs = build("gpt"), batches("gpt")
    engine = fxspeed.compile(model, T, fxspeed.Config(tensor=T, **BF16), example_inputs=bs[0])
    losses = [engine.train_step(*b) for b in bs]
    state = engine.state_dict()
    if int(os.environ["RANK"]) == 0:
        torch.save({"losses": losses, "state": state}, os.path.join(os.environ["WORKER_OUT"], "gpt_bf16.pt"))
    return "ok"


def gpt_dp_bf16() -> str:
    """bf16 under TP=2 x DP=WORLD_SIZE/2 with ZeRO-1: the ZeRO paper's layout per tp slice (bf16
    working copies of this rank's slices read by the program, fp32 masters of its dp partition
    with the optimizer, bf16 gradients). Each replica trains on its rows; writes the losses and
    the trained weights for the test to compare with one bf16 process on the whole batch."""
    world = int(os.environ["WORLD_SIZE"])
    model, bs = build("gpt"), batches("gpt", ignored=False)
    replica = int(os.environ["RANK"]) // 2
    mine = [_rows(b, replica, world // 2) for b in bs]
    engine = fxspeed.compile(model, world, fxspeed.Config(tensor=2, zero=1, **BF16), example_inputs=mine[0])
    losses = [engine.train_step(*b) for b in mine]
    flat = engine._flat
    if not flat.master or {t.dtype for t in flat.work_shards} != {torch.bfloat16}:
        return f"no master weights under TP x DP: master={flat.master}, working {[t.dtype for t in flat.work_shards]}"
    if any(p.numel() for p in model.parameters()):
        return "the module still holds fp32 weights beside the masters"
    state = engine.state_dict()
    if int(os.environ["RANK"]) == 0:
        torch.save({"losses": losses, "state": state}, os.path.join(os.environ["WORKER_OUT"], "gpt_dp_bf16.pt"))
    return "ok"


def _trains_alike(configs: dict[str, dict], resume: bool) -> str:
    """Train build("gpt") 3 steps at TP=2 x DP=WORLD_SIZE/2, bf16 with clipping, once per entry of
    `configs` (Config fields beyond those), with a save/load before the third step if `resume`:
    "ok" if every run's losses and weights equal the first's bit for bit."""
    world = int(os.environ["WORLD_SIZE"])
    bs = batches("gpt", ignored=False)
    mine = [_rows(b, int(os.environ["RANK"]) // 2, world // 2) for b in bs[:3]]
    runs = []
    for i, (label, fields) in enumerate(configs.items()):
        cfg = fxspeed.Config(tensor=2, grad_clip=0.05, **BF16, **fields)
        engine = fxspeed.compile(build("gpt"), world, cfg, example_inputs=mine[0])
        losses = [engine.train_step(*b) for b in mine[:2]]
        if resume:
            ck = os.path.join(os.environ["WORKER_OUT"], f"alike_{i}")
            engine.save(ck)
            engine.load(ck)
        losses.append(engine.train_step(*mine[2]))
        runs.append((label, losses, engine.state_dict()))
        del engine
    first, l0, s0 = runs[0]
    for label, losses, state in runs[1:]:
        if losses != l0:
            return f"{label}: losses {losses} != {first}'s {l0}"
        bad = [k for k in s0 if not torch.equal(s0[k], state[k])]
        if bad:
            return f"{label}: weights differ from {first}'s: {bad[:3]}"
    return "ok"


def gpt_dp_bf16_offload() -> str:
    """ZeRO-1: the fp32 masters and Adam's moments in the offload file train bit for bit like them
    in memory (the clip coefficient goes to the optimizer, which applies it to its fp32 upcast, as
    the in-memory path does to its fp32 gradients)."""
    swap = os.environ["WORKER_OUT"]
    return _trains_alike({"in memory": dict(zero=1), "offloaded": dict(zero=1, offload="optimizer", nvme_path=swap)},
                         resume=False)


def gpt_offload_tiers() -> str:
    """ZeRO-3: the offload tiers "optimizer" (masters + moments in the file), "parameters" (the bf16
    working shards in files too, masters in memory) and "all" train bit for bit alike, and a
    save/load in the middle changes nothing."""
    swap = os.environ["WORKER_OUT"]
    return _trains_alike({f"offload={t!r}": dict(zero=3, offload=t, nvme_path=swap)
                          for t in ("optimizer", "parameters", "all")}, resume=True)


def tiny_unsharded(pipeline: int = 1) -> str:
    import logging

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.said: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.said.append(record.getMessage())

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    keep = Keep()
    logging.getLogger("fxspeed").addHandler(keep)
    try:
        engine = fxspeed.compile(model, 2 * pipeline, fxspeed.Config(tensor=2, pipeline=pipeline, microbatches=pipeline),
                                 example_inputs=(x,), loss_fn=lambda out, x: out.pow(2).mean())
        engine.train_step(x)
    finally:
        logging.getLogger("fxspeed").removeHandler(keep)
    said = [m for m in keep.said if "the planner sharded none of Sequential's parameters" in m]
    return "ok" if len(said) == 1 else f"warnings: {keep.said}"


def tiny_unsharded_pp() -> str:
    """The same under TP=2 x PP=2: the pipeline's engine said nothing (8 ranks of a 64-wide GPT at
    tensor=2 ran every weight whole, silently)."""
    return tiny_unsharded(pipeline=2)


def world_timeout() -> timedelta:
    """The world group's collective timeout (gloo's, as torch keeps it)."""
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


def subgroup_timeout() -> str:
    """The mesh's tp, dp and pp groups hold the ranks the layout names, and a rank alone in a tp
    collective fails at the mesh's timeout (Config.dist_timeout_s), not at torch's default for new
    groups: DeviceMesh made them with 30 min on gloo, so 8 ranks at dist_timeout_s=5 waited there
    for 30 min (here rank 1's all-reduce returned when rank 0 joined 6 s later). The world group,
    which fxspeed initialized at an earlier compile's 300 s, takes each later compile's timeout
    too (it kept the first's: a later engine at 2 s waited 300 s on world collectives), and a
    compile that changes it under a live engine warns."""
    import time
    import warnings

    from fxspeed.mesh import Mesh

    if not dist.is_initialized():  # (first in its launch: the world group keeps a long timeout)
        Mesh.join(int(os.environ["WORLD_SIZE"]), 300.0)
    rank = dist.get_rank()
    mesh = Mesh.join(dist.get_world_size(), 2.0, tp=2)
    if world_timeout() != timedelta(seconds=2):
        return f"the world group's timeout is {world_timeout()} after a Mesh at 2 s"
    # A later engine at 300 s: the world group takes it (the barrier below waits for rank 0's 6 s
    # sleep), and `mesh`, alive at 2 s, is warned about; its tp group keeps 2 s.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Mesh.join(dist.get_world_size(), 300.0)
    if world_timeout() != timedelta(seconds=300):
        return f"the world group's timeout is {world_timeout()} after a Mesh at 300 s"
    said = [str(w.message) for w in caught if "dist_timeout_s" in str(w.message)]
    if len(said) != 1 or "2.0" not in said[0]:
        return f"warnings at a timeout changed under a live engine: {said}"
    for dim in ("dp", "pp", "tp"):
        if sorted(dist.get_process_group_ranks(mesh.group(dim))) != mesh.ranks(dim):
            return f"the {dim} group holds {dist.get_process_group_ranks(mesh.group(dim))}, the layout {mesh.ranks(dim)}"
    if mesh.device_mesh.get_group("tp") is not mesh.group("tp"):
        return "device_mesh's tp group is not the mesh's"
    said, start = "ok", time.monotonic()
    if rank in (0, 1):
        if rank == 0:
            time.sleep(6.0)
        try:
            dist.all_reduce(torch.ones(1), group=mesh.group("tp"))
            if rank == 1:
                said = f"rank 1's all-reduce alone returned after {time.monotonic() - start:.1f}s, no timeout"
        except RuntimeError:  # gloo's timeout (rank 1); rank 0 arrives at a pair that gave up
            waited = time.monotonic() - start
            if rank == 1 and waited > 5.0:
                said = f"rank 1's all-reduce alone failed after {waited:.1f}s, the mesh's timeout is 2 s"
    dist.barrier()
    return said


CASES = {"gpt": gpt, "gpt_dropout": gpt_dropout, "gpt2_dropout_dp": gpt2_dropout_dp, "held_generator": held_generator, "gpt2_dropout": gpt2_dropout, "gpt_bf16": gpt_bf16, "gpt_dp_bf16_offload": gpt_dp_bf16_offload,
         "gpt_offload_tiers": gpt_offload_tiers, "gpt_dp_bf16": gpt_dp_bf16, "gpt2": gpt2, "llama": llama, "bert": bert, "gpt_dp": gpt_dp, "gpt_dp_zero2": gpt_dp_zero2,
         "gpt_dp_zero3": gpt_dp_zero3, "gpt_pp": gpt_pp, "eval_draws_pp": eval_draws_pp, "t5": t5, "gpt_sp": gpt_sp, "gpt_dropout_sp": gpt_dropout_sp, "llama_sp": llama_sp,
         "gpt_pp_zero1": gpt_pp_zero1, "gpt_pp_sp_zero1": gpt_pp_sp_zero1, "tiny_unsharded": tiny_unsharded,
         "tiny_unsharded_pp": tiny_unsharded_pp, "uneven_heads": uneven_heads,
         "subgroup_timeout": subgroup_timeout}


if __name__ == "__main__":
    run_cases(CASES)
