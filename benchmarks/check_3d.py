"""3D parallelism (tensor x pipeline x data) on 8 ranks against eager PyTorch in one process.

    OMP_NUM_THREADS=1 python -m fxspeed run -n 8 benchmarks/check_3d.py --out /tmp/c3d          # every case, ~12 min on 2 cores
    OMP_NUM_THREADS=1 python -m fxspeed run -n 8 benchmarks/check_3d.py --cases gpt_z1,llama_z3
    OMP_NUM_THREADS=1 python -m fxspeed run -n 8 benchmarks/check_3d.py --cases misuse_batch
    OMP_NUM_THREADS=1 python -m fxspeed run -n 8 benchmarks/check_3d.py --cases misuse_one_rank_state_dict
        (misuse_one_rank_{state_dict,save,eval,train}: one launch each, a timed-out group stays broken)

Every case compiles a small model with Config(tensor=2, pipeline=2, microbatches=2, ...) over 8 gloo
ranks (2 replicas of a 2-stage pipeline of 2 tp ranks; rank = (replica * 2 + position) * 2 + tp
rank, checked against the process groups), each replica stepping on its half of a global batch of
8 rows, and compares every step's loss and each parameter's update (engine.state_dict(), on every
rank) with one eager process stepping on the whole batch: fp32 tight (losses 1e-5 relative,
updates 1e-4 of eager's), bf16 loose (eager under autocast; losses 2e-2, updates 0.15). Models:
fxspeed's GPT and a Hugging Face Llama (GQA), 4 layers x 256, vocabulary 2048 (CHECK_WIDTH,
CHECK_VOCAB: at 64 / 128 the cost model slices nothing and tp is not exercised; the line says
how many parameters were sliced). Per case (CASES): Config overrides; "meta" (built under
parameters_on_meta, the reference fxspeed.materialize'd); "resume" (save after the steps, 2 more,
engine.load, the 2 again: the same losses and weights, and eager's); "fresh" (a new engine loads
the checkpoint instead); "eval" (eval_step against eager's). Each rank prints one line per case,
"ok (...)" or what went wrong; CHECK_SUMMARY=1: rank 0 prints each plan.summary().
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback
from typing import Any

import torch

import fxspeed
from fxspeed.models import GPT, GPTConfig

# vocabulary, width, sequence, global batch rows. At width 64 / vocabulary 128 the cost model keeps
# every weight whole (the tp ranks compute the same thing, nothing tp-specific is checked): 256 / 2048
# is where it slices attention, MLP and the vocabulary (as tests/workers/tensor_parallel_worker.py).
V, D = int(os.environ.get("CHECK_VOCAB", 2048)), int(os.environ.get("CHECK_WIDTH", 256))
S, B = 16, 8
STEPS = 3
ADAM = dict(lr=1e-3, eps=1e-6)
SGD_CLIP = dict(lr=1e-2, optimizer="sgd", momentum=0.9, grad_clip=0.5)  # the gradient norm is > 0.5

CASES: dict[str, dict[str, Any]] = {
    "gpt_z0": dict(model="gpt", cfg=dict(zero=0, **ADAM), eval=True),
    "gpt_z1": dict(model="gpt", cfg=dict(zero=1, **ADAM)),
    "gpt_z2": dict(model="gpt", cfg=dict(zero=2, **ADAM)),
    "gpt_z3": dict(model="gpt", cfg=dict(zero=3, **ADAM)),
    "gpt_z1_clip": dict(model="gpt", cfg=dict(zero=1, **SGD_CLIP)),
    "gpt_z2_clip": dict(model="gpt", cfg=dict(zero=2, **SGD_CLIP)),
    "gpt_z3_clip": dict(model="gpt", cfg=dict(zero=3, **SGD_CLIP)),
    "gpt_z0_clip": dict(model="gpt", cfg=dict(zero=0, **SGD_CLIP)),
    "gpt_gpipe": dict(model="gpt", cfg=dict(zero=1, schedule="gpipe", **ADAM)),
    "gpt_interleaved": dict(model="gpt", cfg=dict(zero=1, schedule="interleaved", **ADAM)),
    "gpt_zb": dict(model="gpt", cfg=dict(zero=1, schedule="zb", **ADAM)),
    "gpt_sp": dict(model="gpt", cfg=dict(zero=1, sequence_parallel=True, **SGD_CLIP)),
    "gpt_micro4": dict(model="gpt", cfg=dict(zero=2, microbatches=4, **ADAM)),
    "gpt_bf16_z0": dict(model="gpt", cfg=dict(zero=0, precision="bf16", **ADAM)),
    "gpt_bf16_z1": dict(model="gpt", cfg=dict(zero=1, precision="bf16", **ADAM)),
    "gpt_bf16_z2": dict(model="gpt", cfg=dict(zero=2, precision="bf16", **ADAM)),
    "gpt_bf16_z3": dict(model="gpt", cfg=dict(zero=3, precision="bf16", **ADAM)),
    "gpt_resume_z1": dict(model="gpt", cfg=dict(zero=1, **SGD_CLIP), resume=True, eval=True),
    "gpt_resume_z3": dict(model="gpt", cfg=dict(zero=3, **ADAM), resume=True),
    "gpt_meta_z1": dict(model="gpt", cfg=dict(zero=1, seed=3, **ADAM), meta=True),
    "gpt_meta_z3": dict(model="gpt", cfg=dict(zero=3, seed=3, **ADAM), meta=True),
    "gpt_bf16_z1_clip": dict(model="gpt", cfg=dict(zero=1, precision="bf16", **SGD_CLIP)),
    "gpt_bf16_z3_clip": dict(model="gpt", cfg=dict(zero=3, precision="bf16", **SGD_CLIP)),
    "gpt_interleaved_z3_sp": dict(model="gpt", cfg=dict(zero=3, schedule="interleaved", sequence_parallel=True,
                                                         **SGD_CLIP)),
    "gpt_zb_z2_bf16": dict(model="gpt", cfg=dict(zero=2, schedule="zb", precision="bf16", **ADAM)),
    "gpt_fresh_resume_z2": dict(model="gpt", cfg=dict(zero=2, **SGD_CLIP), resume=True, fresh=True),
    "llama_interleaved_z1": dict(model="llama", cfg=dict(zero=1, schedule="interleaved", **SGD_CLIP)),
    "gpt_grad_accum": dict(model="gpt", cfg=dict(zero=1, grad_accum=2, **ADAM), expect_error=True),
    "llama_z1": dict(model="llama", cfg=dict(zero=1, **SGD_CLIP), eval=True),
    "llama_z3": dict(model="llama", cfg=dict(zero=3, **ADAM)),
    "llama_sp": dict(model="llama", cfg=dict(zero=2, sequence_parallel=True, **ADAM)),
    "llama_bf16_z1": dict(model="llama", cfg=dict(zero=1, precision="bf16", **ADAM)),
    "llama_meta_z2": dict(model="llama", cfg=dict(zero=2, seed=5, **ADAM), meta=True, resume=True),
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=V, block_size=S, n_layer=4, n_head=4, n_embd=D))
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * D,
        vocab_size=V, max_position_embeddings=S, use_cache=False))


def batches(name: str, n: int) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, V, (B, S), generator=g)
        y = torch.randint(0, V, (B, S), generator=g)
        out.append((x, y) if name == "gpt" else {"input_ids": x, "labels": y})
    return out


def rows(b: Any, i: int, n: int) -> Any:
    cut = lambda t: t[i * t.shape[0] // n:(i + 1) * t.shape[0] // n]  # noqa: E731
    return {k: cut(v) for k, v in b.items()} if isinstance(b, dict) else tuple(cut(t) for t in b)


def call(f: Any, b: Any) -> Any:
    return f(**b) if isinstance(b, dict) else f(*b)


def loss_of(out: Any) -> torch.Tensor:
    return out if torch.is_tensor(out) else out.loss


def eager(ref: torch.nn.Module, bs: list, cfg: fxspeed.Config) -> list[float]:
    """Eager steps on the global batches; a second call goes on with the first's optimizer (kept on ref)."""
    opt = getattr(ref, "_check_opt", None)
    if opt is not None:
        pass
    elif cfg.optimizer == "sgd":
        opt = torch.optim.SGD(ref.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay)
    ref._check_opt = opt
    losses = []
    for b in bs:
        if cfg.precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(call(ref, b))
        else:
            loss = loss_of(call(ref, b))
        loss.backward()
        if cfg.grad_clip is not None:
            norm = torch.stack([p.grad.double().pow(2).sum() for p in ref.parameters()]).sum().sqrt()
            torch.nn.utils.clip_grads_with_norm_(ref.parameters(), cfg.grad_clip, norm.float())
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def key_bias_masked(name: str, t: torch.Tensor) -> torch.Tensor:
    """The key third of a fused QKV bias zeroed: its true gradient is exactly zero (softmax ignores
    a per-row shift), so Adam turns its float noise into +-lr steps that differ between equal programs."""
    if name.endswith("qkv.bias"):
        t = t.clone()
        t[t.numel() // 3:2 * t.numel() // 3] = 0
    return t


def compare(state: dict, ref: torch.nn.Module, start: dict, tol: float) -> str | None:
    """Each parameter's update (state - start) against eager's, relative to eager's update."""
    worst = (0.0, "")
    for n, p in ref.named_parameters():
        if n not in state:
            return f"state_dict has no {n} (keys: {sorted(state)[:5]}...)"
        if tuple(state[n].shape) != tuple(p.shape):
            return f"state_dict {n} has shape {tuple(state[n].shape)}, the model {tuple(p.shape)}"
        want = key_bias_masked(n, p.detach() - start[n])
        got = key_bias_masked(n, state[n].float() - start[n])
        err = float((got - want).norm() / want.norm().clamp_min(1e-12))
        if n.endswith("k_proj.bias") or want.norm() < 1e-9:  # no true gradient
            continue
        worst = max(worst, (err, n))
    if worst[0] > tol:
        return f"parameter {worst[1]}'s update differs from eager's by {worst[0]:.2e} (relative)"
    compare.worst = worst
    return None


def check_mesh(engine: Any) -> str | None:
    """The groups are what the layout (dp, pp, tp) = divmod chain of the rank says: tp ranks
    adjacent, a pipeline's positions tp apart, replicas pp * tp apart."""
    import torch.distributed as dist

    rank, mesh = int(os.environ["RANK"]), engine.mesh
    T, P = mesh.tp, mesh.pp
    d, rest = divmod(rank, P * T)
    p, t = divmod(rest, T)
    want = {"tp": [d * P * T + p * T + i for i in range(T)], "pp": [d * P * T + i * T + t for i in range(P)],
            "dp": [i * P * T + p * T + t for i in range(mesh.dp)]}
    for dim, ranks in want.items():
        got = dist.get_process_group_ranks(mesh.group(dim))
        if sorted(got) != ranks or mesh.ranks(dim) != ranks:
            return f"mesh {dim} group of rank {rank}: process group {got}, mesh.ranks {mesh.ranks(dim)}, want {ranks}"
    if engine.position != p or engine.dp_rank != d:
        return f"engine.position {engine.position} / dp_rank {engine.dp_rank}, want {p} / {d}"
    return None


def run_case(name: str, spec: dict) -> str:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    kw = dict(tensor=2, pipeline=2, microbatches=2, dist_timeout_s=60.0)
    kw.update(spec["cfg"])
    cfg = fxspeed.Config(**kw)
    if spec.get("meta"):
        with fxspeed.parameters_on_meta():
            model = build(spec["model"])
        ref = fxspeed.materialize(copy.deepcopy(model), seed=cfg.seed)
    else:
        model = build(spec["model"])
        ref = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    n_steps = STEPS + (2 if spec.get("resume") else 0)
    bs = batches(spec["model"], n_steps)
    replicas = world // (cfg.tensor * cfg.pipeline)
    t0 = time.time()
    try:
        engine = fxspeed.compile(model, world, cfg, example_inputs=rows(bs[0], 0, replicas))
    except fxspeed.errors.FxspeedError as e:
        if spec.get("expect_error"):
            return f"ok (refused: {str(e)[:200]})"
        raise
    if spec.get("expect_error"):
        return "compiled, but an error was expected"
    if engine.dp_size != replicas:
        return f"engine.dp_size {engine.dp_size} != {replicas}"
    bad = check_mesh(engine)
    if bad:
        return bad
    mine = [rows(b, engine.dp_rank, engine.dp_size) for b in bs]
    compile_s = time.time() - t0
    got = [call(engine.train_step, b) for b in mine[:STEPS]]
    want = eager(ref, bs[:STEPS], cfg)
    low = cfg.precision != "fp32"
    ltol, ptol = (2e-2, 0.15) if low else (1e-5, 1e-4)
    for i, (g, w) in enumerate(zip(got, want)):
        if abs(g - w) > ltol * abs(w):
            return f"step {i} loss {g} != eager {w} (all: {got} vs {want})"
    state = engine.state_dict()
    bad = compare(state, ref, start, ptol)
    if bad:
        return bad + f" (losses {got} vs {want})"
    notes = [f"compile {compile_s:.1f}s", f"losses {[round(x, 5) for x in got]}",
             f"worst update {compare.worst[0]:.1e} {compare.worst[1]}"]
    placed = engine.plan.tp_placements
    notes.append(f"tp-sliced {sum(1 for v in placed.values() if v.startswith('S'))}/{len(placed)}")
    if spec.get("eval"):
        loss = call(engine.eval_step, mine[0])
        ref.eval()
        with torch.no_grad():
            w = float(loss_of(call(ref, bs[0])).detach())
        ref.train()
        if abs(loss - w) > ltol * abs(w):
            return f"eval_step loss {loss} != eager {w}"
        notes.append("eval ok")
    if spec.get("resume"):
        out = os.environ.get("CHECK_OUT", "/tmp/check_3d")
        ckpt = os.path.join(out, f"{name}_ckpt")
        engine.save(ckpt)
        then = [call(engine.train_step, b) for b in mine[STEPS:]]
        after = {n: t.clone() for n, t in engine.state_dict().items()}
        engine.load(ckpt)
        again = [call(engine.train_step, b) for b in mine[STEPS:]]
        if then != again:
            return f"after engine.load the losses {again} != the uninterrupted run's {then}"
        for n, t in engine.state_dict().items():
            if not torch.equal(t, after[n]):
                return f"after engine.load and the same steps {n} differs by {float((t - after[n]).abs().max()):.2e}"
        if spec.get("fresh"):  # a new engine (a restarted job) loads the checkpoint and takes the same steps
            model2 = build(spec["model"])
            engine2 = fxspeed.compile(model2, world, cfg, example_inputs=mine[0])
            engine2.load(ckpt)
            fresh = [call(engine2.train_step, b) for b in mine[STEPS:]]
            if fresh != then:
                return f"a fresh engine loading the checkpoint: losses {fresh} != the uninterrupted run's {then}"
            for n, t in engine2.state_dict().items():
                if not torch.equal(t, after[n]):
                    return f"a fresh engine after engine.load and the same steps: {n} differs by {float((t - after[n]).abs().max()):.2e}"
            notes.append("fresh resume ok")
        want2 = eager(ref, bs[STEPS:], cfg)  # the eager run goes on too
        for g, w in zip(then, want2):
            if abs(g - w) > ltol * abs(w):
                return f"after the checkpoint: loss {g} != eager {w}"
        notes.append("resume ok")
    if rank == 0 and os.environ.get("CHECK_SUMMARY"):
        print(engine.plan.summary(), flush=True)
    return "ok (" + ", ".join(notes) + ")"


def misuse_batch() -> str:
    """Rank 1 (tp rank 1 of replica 0) passes other rows than rank 0: an error on every rank."""
    rank = int(os.environ["RANK"])
    model = build("gpt")
    bs = batches("gpt", 2)
    cfg = fxspeed.Config(tensor=2, pipeline=2, microbatches=2, zero=1, dist_timeout_s=20.0)
    engine = fxspeed.compile(model, 8, cfg, example_inputs=rows(bs[0], 0, 2))
    b = rows(bs[0], engine.dp_rank, 2)
    if rank == 1:
        b = rows(bs[1], engine.dp_rank, 2)
    t0 = time.time()
    try:
        engine.train_step(*b)
    except fxspeed.errors.FxspeedError as e:
        return f"ok: {type(e).__name__} after {time.time() - t0:.1f}s: {str(e)[:300]}"
    return "no error: ranks of one replica trained on different batches"


def misuse_one_rank(what: str) -> str:
    """Rank 5 alone calls `what`; the others go on to train_step: each errors within the timeout."""
    rank = int(os.environ["RANK"])
    model = build("gpt")
    bs = batches("gpt", 2)
    cfg = fxspeed.Config(tensor=2, pipeline=2, microbatches=2, zero=1, dist_timeout_s=15.0)
    engine = fxspeed.compile(model, 8, cfg, example_inputs=rows(bs[0], 0, 2))
    b = rows(bs[0], engine.dp_rank, 2)
    t0 = time.time()
    try:
        if rank == 5:
            if what == "state_dict":
                engine.state_dict()
            elif what == "save":
                engine.save(os.path.join(os.environ.get("CHECK_OUT", "/tmp/check_3d"), "one_rank_ckpt"))
            elif what == "eval":
                engine.eval_step(*b)
            else:
                engine.train_step(*b)
        else:
            if what == "train":
                return "skipped (only rank 5 calls)"
            engine.train_step(*b)
    except Exception as e:  # noqa: BLE001 - any error is what we look for; its text is the report
        return f"error after {time.time() - t0:.1f}s: {type(e).__name__}: {str(e)[:300]}"
    return f"no error after {time.time() - t0:.1f}s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default="/tmp/check_3d")
    a = ap.parse_args()
    os.environ["CHECK_OUT"] = a.out
    os.makedirs(a.out, exist_ok=True)
    rank = int(os.environ["RANK"])
    for name in a.cases.split(","):
        t0 = time.time()
        try:
            if name == "misuse_batch":
                res = misuse_batch()
            elif name.startswith("misuse_one_rank_"):
                res = misuse_one_rank(name[len("misuse_one_rank_"):])
            else:
                res = run_case(name, CASES[name])
        except Exception as e:  # noqa: BLE001
            res = f"FAILED {type(e).__name__}: {str(e)[:600]}"
            if os.environ.get("CHECK_TRACE"):
                traceback.print_exc()
        line = f"[rank {rank}] {name}: {res} [{time.time() - t0:.1f}s]"
        print(line, flush=True)
        with open(os.path.join(a.out, f"{name}_rank{rank}.txt"), "w") as f:
            f.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
