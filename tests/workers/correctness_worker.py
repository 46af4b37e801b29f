"""Run under `fxspeed run -n 2 -m tests.workers.correctness_worker --case CASE --out DIR`.

    zero3_module  under ZeRO-3 (and ZeRO-1 bf16: master weights) the user's module holds 0-size
                  Parameters: calling it, its state_dict() or load_state_dict() raises an
                  FxspeedError naming the engine's way out; inside `engine.gathered()` it gives
                  the eager output of the current weights; a write to its 0-size Parameters
                  outside gathered() (in place, nn.init, vector_to_parameters) is refused once,
                  then the steps go on from the engine's weights
    pipeline_batchnorm BatchNorm under pipeline=2 x 2 micro-batches: losses, weights and running
                  statistics equal eager's forwards over the two slices in turn
    pipeline_shared_block one block in four slots (ALBERT) under pipeline=2: its weights on both
                  stages, losses and state equal eager's
    repointed_zero12 ZeRO-1/2 fp32: Parameters re-pointed by `p.data = t` (vector_to_parameters)
                  train from the new values as eager does (the buckets kept the old ones)
    raced_write_zero12 ZeRO-1/2 fp32: the module (or a submodule) called right after train_step gives eager's
                  output (it waits for the step's gathers, as its state_dict() does, before the
                  user's own forward / state_dict pre-hooks run); an in-place write after engine.synchronize() trains as eager;
                  one while the step's gathers are in flight is refused at the next step (not by a
                  load_state_dict that replaces it); a deepcopy or pickle of the module is called as any module
    scripted_submodule ZeRO-1/2 fp32 with a torch.jit.script'ed submodule (no hooks allowed on it):
                  compiles, trains as eager, a direct call right after a step waits for the gathers
    nan_one_rank  Config(nan_check="skip"): a NaN in rank 1's local batch only skips the step on
                  both ranks (parameters unchanged everywhere, both count one skipped step)
    eval_global   eval_step on 2 ranks returns the global batch's mean loss on both (as
                  train_step does), not each rank's own
    token_mean    labels padded with -100 unevenly over the ranks (rank 1's all -100 at step 1):
                  the README's recipe for the exact global token mean (the local sum x replicas /
                  the global count, the count passed as a tensor in the batch) gives one process's
                  SGD steps on the global batch's mean, count changing between steps
    layout_dp     channels_last conv + transposed Parameter, ZeRO-1 and ZeRO-2 on 2 ranks: three
                  steps equal one process's eager fused AdamW on the global batch
    accum_once    Config.grad_accum=2/3 under ZeRO-0/1 (fp32; ZeRO-1 bf16 with master weights too):
                  only the step's last slice's program holds collectives, it reduces the sum of
                  every slice, and three steps equal one process's eager AdamW on the global
                  batch (the mean of the slices' means); under ZeRO-1 a slice's own flat buckets
                  are dead before the next slice runs (the engine sums its own copies)
    tie_second_name a weight tied under two names whose forward reaches it through the second only
                  (T5's shared / encoder.embed_tokens), ZeRO-3 and ZeRO-1 bf16: state_dict gives
                  the trained weight under both names (it came back 0-size under ZeRO-3), equal
                  to eager; save, load into a fresh engine and one more step equals three
                  uninterrupted steps
    deferred_init a GPT built on the meta device, ZeRO-2/3 fp32, ZeRO-1 bf16, tensor=2 and pipeline=2
                  on 2 ranks: each rank makes the values as its layout is built (under tensor=2 one
                  init group whole at a time, then its slice; under pipeline=2 its stages' only);
                  equals one process's AdamW on the global batch from fxspeed.materialize of the
                  same model
    no_decay_zero Config.no_weight_decay=("1d",) under ZeRO-0..3 with buckets so small that the
                  flat shards cut Parameters: equals one process's AdamW with the 1-D parameters
                  in a param group with weight_decay=0
    dropout_replicas GPT with dropout on 2 replicas (ZeRO-3), every rank seeded alike: each replica
                  draws from its own stream (fxspeed.mesh.stream_seed(replica, 0)); equals eager's
                  SGD over the two replicas' rows drawn so; a generator a module holds too
    dropout_stages pipeline=2, a dropout mask kept per stage: each stage draws from its own stream
                  (the second stage repeated the first's masks); masks, losses and weights equal
                  eager's with those masks; the ranks' generators stay in step (a batch sampled
                  from torch's generator on every rank is the same on both stages)

Each rank writes "ok" or what went wrong to DIR/{case}_rank{r}.txt and exits 0 (`--case all`:
every case in one launch; tests/workers/common.py run_cases, shared with tensor_parallel_worker).
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

import fxspeed
from fxspeed.data import local_batch
from fxspeed.errors import FxspeedError
from tests.test_training_correctness import ConvAndTransposed, Tiny
from tests.workers.common import run_cases


def zero3_module() -> str:
    for config in (fxspeed.Config(zero=3, lr=0.0), fxspeed.Config(zero=1, precision="bf16", lr=0.0)):
        torch.manual_seed(0)
        model = Tiny()
        ref = copy.deepcopy(model)
        a, b = torch.randn(4, 4), torch.randn(4, 4)
        engine = fxspeed.compile(model, 2, config, example_inputs=local_batch((a, b)))
        full = engine.state_dict()
        # the module's own state_dict would be 0-size tensors: torch.save of it an empty checkpoint
        for call, fix in ((lambda: model(a, b), "gathered"), (model.state_dict, "engine.save"),
                          (lambda: model.load_state_dict(full), "engine.load_state_dict")):
            try:
                call()
                return f"zero={config.zero} {config.precision}: the module with 0-size Parameters did not raise"
            except FxspeedError as e:
                if fix not in str(e):
                    return f"unhelpful error: {e}"
        with engine.gathered():
            got = model(a, b)
            if any(v.numel() == 0 for v in model.state_dict().values()):
                return "state_dict inside gathered() is 0-size"
        if not torch.allclose(got, ref(a, b), atol=1e-2 if config.precision == "bf16" else 1e-6):
            return f"gathered module gives {float(got)} != eager {float(ref(a, b))}"
        # a write to the 0-size Parameters outside gathered() changed nothing: said, not lost in silence
        before = engine.train_step(*local_batch((a, b)))
        for edit in (lambda: model.l.weight.mul_(0), lambda: torch.nn.init.zeros_(model.l.weight),
                     lambda: torch.nn.utils.vector_to_parameters(torch.zeros(20), model.parameters())):
            with torch.no_grad():
                edit()
            try:
                engine.train_step(*local_batch((a, b)))
                return f"zero={config.zero} {config.precision}: a write to the released module was ignored silently"
            except FxspeedError as e:
                if "outside `engine.gathered()`" not in str(e):
                    return f"unhelpful error: {e}"
            if engine.train_step(*local_batch((a, b))) != before:  # said once; the weights are the engine's
                return "the step after the refused write changed"
    return "ok"


def _tiny_sgd_pair(zero: int, pre_hook: Any = None) -> tuple:
    """Tiny under ZeRO-`zero` on 2 ranks with SGD, its eager twin and optimizer, and a batch;
    `pre_hook`: a forward and state_dict pre-hook the user put on `model.l` before compiling."""
    torch.manual_seed(0)
    model = Tiny()
    ref = copy.deepcopy(model)
    if pre_hook is not None:
        model.l.register_forward_pre_hook(pre_hook)
        model.l.register_state_dict_pre_hook(pre_hook)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    engine = fxspeed.compile(model, 2, fxspeed.Config(zero=zero, optimizer="sgd", lr=0.1),
                             example_inputs=local_batch((a, b)))
    return model, ref, (a, b), engine, torch.optim.SGD(ref.parameters(), lr=0.1)


def _step_both(engine: fxspeed.Engine, ref: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple,
               tag: str) -> list[str]:
    """One step of the engine on this rank's half of `batch` and of eager on all of it: the losses."""
    got = engine.train_step(*local_batch(batch))
    opt.zero_grad()
    want = ref(*batch)
    want.backward()
    opt.step()
    return [f"{tag}: {got} != eager {want.item()}"] if abs(got - want.item()) > 1e-6 else []


def repointed_zero12() -> str:
    """ZeRO-1/2 fp32: the module's Parameters are views into the flat buckets; torch's
    vector_to_parameters re-points them (`p.data = t`): the optimizer went on stepping the
    buckets and the Parameters kept the new values for good."""
    out = []
    for zero in (1, 2):
        model, ref, (a, b), engine, opt = _tiny_sgd_pair(zero)
        for step in range(4):
            if step == 1:
                for m in (model, ref):
                    torch.nn.utils.vector_to_parameters(torch.linspace(-0.5, 0.5, 20), m.parameters())
            out += _step_both(engine, ref, opt, (a, b), f"zero={zero} step {step}")
        out += state_errors(engine, ref, f"zero={zero} ")
    return "; ".join(out) or "ok"


class _ReadsWeights:
    """A forward (and state_dict) pre-hook of the user's that reads its module's weights (torch's weight_norm
    computes `weight` from them in one): it counts the calls made with the step's gathers in
    flight. A copy of it (deepcopy, pickle) belongs to no engine."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.mid_gather = 0

    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        if self.engine is not None and self.engine._flat.in_flight:
            self.mid_gather += 1

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def raced_write_zero12() -> str:
    """ZeRO-1/2 fp32: train_step returns while the updated weights are still being gathered into
    the buckets the module's Parameters view. Calling the module right after the step waits for
    them (it read a mix of old and new weights). A write in place after engine.synchronize() is
    seen, as eager's; one before it raced with the gathers (the other ranks' slices landed over
    it or not, the ranks then stepped from different weights, silently) and is refused at the
    next step, naming engine.synchronize()."""
    out = []
    for zero in (1, 2):
        # A hook of the user's that reads the submodule's weights (torch's weight_norm computes
        # `weight` in one) was registered before compile: it runs after the engine's wait, too.
        hook = _ReadsWeights()
        model, ref, (a, b), engine, opt = _tiny_sgd_pair(zero, hook)
        hook.engine = engine
        for step in range(2):
            out += _step_both(engine, ref, opt, (a, b), f"zero={zero} step {step}")
            with torch.no_grad():  # a direct call (a validation loss) right after the step
                direct, eager = model(a, b).item(), ref(a, b).item()
            if abs(direct - eager) > 1e-6:
                out.append(f"zero={zero} step {step}: the module called right after train_step gave {direct}, "
                           f"eager {eager}")
            if engine._flat.in_flight:  # (the mix above shows only when a gather lands late: a race)
                out.append(f"zero={zero} step {step}: the module was called with the step's gathers in flight")
            out += _step_both(engine, ref, opt, (a, b), f"zero={zero} step {step}.1")
            with torch.no_grad():  # a submodule called on its own right after the step waits too
                direct, eager = model.l(a), ref.l(a)
            if engine._flat.in_flight or not torch.allclose(direct, eager, atol=1e-6):
                out.append(f"zero={zero} step {step}: a submodule called right after train_step read the weights "
                           f"with the step's gathers in flight (max diff {float((direct - eager).abs().max()):.2e})")
            if hook.mid_gather:
                out.append(f"zero={zero} step {step}: a forward pre-hook the user registered before compile ran "
                           "before the engine's wait for the step's gathers (it read the weights mid-gather)")
                hook.mid_gather = 0
            out += _step_both(engine, ref, opt, (a, b), f"zero={zero} step {step}.2")
            model.l.state_dict()  # a submodule's state_dict() right after the step: the user's pre-hook too
            if hook.mid_gather:
                out.append(f"zero={zero} step {step}: a state_dict pre-hook the user registered before compile ran "
                           "before the engine's wait for the step's gathers")
                hook.mid_gather = 0
            out += _step_both(engine, ref, opt, (a, b), f"zero={zero} step {step}.3")
            saved = {k: v.clone() for k, v in model.state_dict().items()}  # torch.save(model.state_dict()) right after
            if engine._flat.in_flight:
                out.append(f"zero={zero} step {step}: the module's state_dict was read with the step's gathers in flight")
            if not torch.equal(saved["l.weight"], model.l.weight):
                out.append(f"zero={zero} step {step}: the module's state_dict read a weight mid-gather")
            engine.synchronize()
            with torch.no_grad():
                for m in (model, ref):
                    m.l.weight.clamp_(-0.2, 0.2)
        if len(engine._executors) != 1:  # the engine's own hooks, first on every module, are no part of the key
            out.append(f"zero={zero}: {len(engine._executors)} programs traced for one batch shape")
        out += state_errors(engine, ref, f"zero={zero} ")
        # a copy of the module (an EMA or eval copy, torch.save(model)) carries the engine's hooks,
        # as no-ops: it is called and saved like any module
        for how, dup in (("deepcopy", copy.deepcopy), ("pickle", lambda m: pickle.loads(pickle.dumps(m)))):
            try:
                dup(model)(a, b), dup(model).state_dict()
            except Exception as e:  # noqa: BLE001 (said as the case's result)
                out.append(f"zero={zero}: a {how} of the module failed when called: {type(e).__name__}: {e}")
        # a write racing the gathers, then a checkpoint loaded over it: the way back, not refused
        # (a snapshot: engine.state_dict() aliases the live weights, which the step and the write change)
        saved = {k: v.clone() for k, v in engine.state_dict().items()}
        engine.train_step(*local_batch((a, b)))
        with torch.no_grad():
            model.l.weight.mul_(0.5)
        try:
            engine.load_state_dict(saved)
            engine.synchronize()
            if not torch.equal(model.l.weight, saved["l.weight"]):
                out.append(f"zero={zero}: load_state_dict after a raced write did not restore l.weight")
        except FxspeedError as e:
            out.append(f"zero={zero}: load_state_dict after a raced write was refused: {e}")
        engine.train_step(*local_batch((a, b)))
        with torch.no_grad():
            model.l.weight.mul_(0.5)  # no synchronize: the gathers are in flight
        try:
            engine.train_step(*local_batch((a, b)))
            out.append(f"zero={zero}: a write racing the in-flight gathers trained on with no error")
        except FxspeedError as e:
            if "l.weight" not in str(e) or "engine.synchronize()" not in str(e):
                out.append(f"zero={zero}: unexpected error: {e}")
        # a dropped engine takes its wait hooks off the module (they stayed, as no-ops, on every submodule)
        engine.synchronize()
        hook.engine = None
        del engine, opt
        gc.collect()
        left = [f"{name or 'root'}" for name, m in model.named_modules()
                for h in (*m._forward_pre_hooks.values(), *m._state_dict_pre_hooks.values())
                if type(h).__name__ == "_WaitForGathers"]
        if left:
            out.append(f"zero={zero}: a dropped engine left its wait hooks on {left[:4]}")
    return "; ".join(out) or "ok"


def scripted_submodule() -> str:
    """ZeRO-1/2 fp32 with a torch.jit.script'ed submodule (torch refuses hooks on ScriptModules):
    compiles and trains as eager, and a direct call of the module right after a step waits for
    the step's gathers."""
    out = []
    for zero in (1, 2):
        torch.manual_seed(0)
        model = Tiny()
        ref = copy.deepcopy(model)  # eager's twin, unscripted (a deepcopy of a ScriptModule's weights is no leaf)
        model.l = torch.jit.script(model.l)
        a, b = torch.randn(4, 4), torch.randn(4, 4)
        try:
            engine = fxspeed.compile(model, 2, fxspeed.Config(zero=zero, optimizer="sgd", lr=0.1),
                                     example_inputs=local_batch((a, b)))
        except Exception as e:  # noqa: BLE001 (said as the case's result)
            out.append(f"zero={zero}: compile failed: {type(e).__name__}: {e}")
            continue
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(2):
            out += _step_both(engine, ref, opt, (a, b), f"zero={zero} step {step}")
            with torch.no_grad():
                direct, eager = model(a, b).item(), ref(a, b).item()
            if engine._flat.in_flight or abs(direct - eager) > 1e-6:
                out.append(f"zero={zero} step {step}: the module called right after train_step gave {direct}, "
                           f"eager {eager}")
    return "; ".join(out) or "ok"


def nan_one_rank() -> str:
    torch.manual_seed(0)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    engine = fxspeed.compile(Tiny(), 2, fxspeed.Config(lr=0.1, nan_check="skip", zero=1),
                             example_inputs=local_batch((a, b)))
    engine.train_step(*local_batch((a, b)))
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    la, lb = local_batch((a, b))
    if rank == 1:
        la = la * float("nan")
    engine.train_step(la, lb)
    after = engine.state_dict()
    if engine.stats["skipped_steps"] != 1:
        return f"skipped_steps={engine.stats['skipped_steps']}"
    if any(not torch.equal(after[k], before[k]) for k in before):
        return "parameters changed on a skipped step"
    return "ok"


def eval_global() -> str:
    torch.manual_seed(0)
    model = Tiny()
    ref = copy.deepcopy(model)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    engine = fxspeed.compile(model, 2, fxspeed.Config(lr=0.1), example_inputs=local_batch((a, b)))
    got = engine.eval_step(*local_batch((a, b)))
    want = float(ref(a, b))
    return "ok" if abs(got - want) <= 1e-6 * abs(want) else f"eval_step gave {got}, global mean is {want}"


def state_errors(engine: fxspeed.Engine, ref: torch.nn.Module, prefix: str = "") -> list[str]:
    """The engine's tensors whose largest difference from the eager reference's exceeds 1e-5 of
    the reference's largest value."""
    state, out = engine.state_dict(), []
    for name, p in ref.state_dict().items():
        err = float((state[name] - p).abs().max() / p.abs().max())
        if err > 1e-5:
            out.append(f"{prefix}{name}: relative error {err:.3g}")
    return out


class SecondNameTie(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Embedding(50, 16)
        self.enc = torch.nn.Embedding(50, 16)
        self.enc.weight = self.shared.weight  # the first name, `shared`, is never called
        self.head = torch.nn.Linear(16, 50)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(self.enc(x)).flatten(0, 1), y.flatten())


def tie_second_name() -> str:
    out = []
    for config in (fxspeed.Config(zero=3), fxspeed.Config(zero=1, precision="bf16")):
        torch.manual_seed(0)
        batches = [(torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8))) for _ in range(3)]
        model = SecondNameTie()
        ref = copy.deepcopy(model)
        opt = torch.optim.AdamW(ref.parameters(), lr=config.lr, weight_decay=0.0)
        engine = fxspeed.compile(model, 2, config, example_inputs=local_batch(batches[0]))
        for x, y in batches[:2]:
            engine.train_step(*local_batch((x, y)))
        if config.precision == "fp32":
            for x, y in batches[:2]:
                opt.zero_grad()
                ref(x, y).backward()
                opt.step()
            out += state_errors(engine, ref, f"zero={config.zero}: ")
        path = os.path.join(os.environ["WORKER_OUT"], f"tie_z{config.zero}")
        engine.save(path)
        want = engine.train_step(*local_batch(batches[2]))
        torch.manual_seed(1)
        fresh = fxspeed.compile(SecondNameTie(), 2, config, example_inputs=local_batch(batches[0]))
        fresh.load(path)
        got = fresh.train_step(*local_batch(batches[2]))
        if got != want:
            out.append(f"zero={config.zero} {config.precision}: resumed loss {got} != uninterrupted {want}")
        a, b = engine.state_dict(), fresh.state_dict()
        out += [f"zero={config.zero} {config.precision}: {n} differs after resuming" for n in a
                if not torch.equal(a[n], b[n])]
    return "; ".join(out) or "ok"


def layout_dp() -> str:
    out = []
    for zero in (1, 2):
        torch.manual_seed(0)
        model = ConvAndTransposed()
        ref = copy.deepcopy(model)
        x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
        lx = local_batch((x,))
        engine = fxspeed.compile(model, 2, fxspeed.Config(lr=0.1, zero=zero, bucket_mb=0.0001), example_inputs=lx)
        opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.0, fused=True)
        for _ in range(3):
            engine.train_step(*lx)
            opt.zero_grad()
            ref(x).backward()
            opt.step()
        out += state_errors(engine, ref, f"zero={zero} ")
    return "; ".join(out) or "ok"


def accum_once() -> str:
    from tests.test_weight_decay import NormedMLP, _batch

    out = []
    for zero, k, precision in ((0, 2, "fp32"), (1, 3, "fp32"), (0, 3, "fp32"), (1, 2, "bf16")):
        torch.manual_seed(0)
        model = NormedMLP()
        ref = copy.deepcopy(model)
        x, y = torch.cat([_batch()[0]] * 3), torch.cat([_batch()[1]] * 3)  # 24 rows: 12 per rank, k slices
        x = x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
        lb = local_batch((x, y))
        engine = fxspeed.compile(model, 2, fxspeed.Config(lr=0.05, zero=zero, grad_accum=k, precision=precision,
                                                          bucket_mb=0.002), example_inputs=lb)
        opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.0)
        # A slice's own flat buckets are dead once the step has summed them (the engine keeps its
        # copies): alive through the next slice's run they were a second copy of the accumulated
        # gradients at the step's peak.
        held: list[int] = []
        mine: list[StorageWeakRef] = []
        run = engine._run_stepping

        def watched(ex, batch, run=run, held=held, mine=mine):
            held.append(sum(not r.expired() for r in mine))
            mine.clear()
            res = run(ex, batch)
            mine.extend(StorageWeakRef(t.untyped_storage()) for t in res.grad_buckets.values())
            return res

        engine._run_stepping = watched
        for _ in range(3):
            engine.train_step(*lb)
            opt.zero_grad()
            # the engine's loss: the mean over ranks and slices of each slice's mean
            sum(ref(xs, ys) for xs, ys in zip(x.chunk(2 * k), y.chunk(2 * k))).div(2 * k).backward()
            opt.step()
        kinds = {key[3]: sum("reduce" in str(n.target) for n in ex.program.gm.graph.nodes)
                 for key, ex in engine._executors.items() if key[0] and key[3] != "whole"}
        if zero == 1 and any(held[i] for i in range(len(held)) if i % k):  # (ZeRO-0's are persistent buffers)
            out.append(f"zero={zero} k={k}: a slice's own gradient buckets still alive while the next slice runs "
                       f"(per run: {held})")
        if kinds.get("local", -1) != 0 or kinds.get("last", 0) == 0:
            out.append(f"zero={zero} k={k}: collectives per program role {kinds}")
        if precision == "fp32":
            out += state_errors(engine, ref, f"zero={zero} k={k} ")
            continue
        # bf16 working copies: eager fp32 is no reference, and Adam's first steps turn rounding
        # into lr-sized moves; the reduced gradients of one step reducing every slice are
        grads = []
        for local in (True, False):
            torch.manual_seed(0)
            e = fxspeed.compile(NormedMLP(), 2, fxspeed.Config(lr=0.05, zero=zero, grad_accum=k, precision=precision,
                                                               bucket_mb=0.002), example_inputs=lb)
            e._accumulates_locally = lambda local=local: local
            seen: dict[int, torch.Tensor] = {}
            e._flat.set_grads = lambda b, seen=seen: seen.update({i: t.float().clone() for i, t in b.items()})
            e.train_step(*lb)
            grads.append(seen)
        err = max(float((grads[0][i] - g).abs().max() / g.abs().max()) for i, g in grads[1].items())
        if err > 1e-2:
            out.append(f"zero={zero} k={k} bf16: reduced gradients off by {err:.3g} from reducing every slice")
    return "; ".join(out) or "ok"


def no_decay_zero() -> str:
    from tests.test_weight_decay import NormedMLP, _batch, _eager

    out = []
    for zero in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = NormedMLP()
        ref = copy.deepcopy(model)
        lb = local_batch(_batch())
        engine = fxspeed.compile(model, 2, fxspeed.Config(lr=0.05, weight_decay=0.1, no_weight_decay=("1d",), zero=zero,
                                                          bucket_mb=0.002), example_inputs=lb)
        for _ in range(3):
            engine.train_step(*lb)
        _eager(ref, "adamw", {"up.bias", "norm.weight", "norm.bias", "down.bias"}, 3)
        out += state_errors(engine, ref, f"zero={zero} ")
    return "; ".join(out) or "ok"


class TokenLM(torch.nn.Module):
    """An HF-style LM whose loss is the sum over valid tokens / `n_items` (HF's num_items_in_batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, n_items: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.emb(ids)).flatten(0, 1)
        if n_items is None:  # eager, one process: the mean over the valid tokens
            return torch.nn.functional.cross_entropy(logits, labels.flatten(), ignore_index=-100)
        total = torch.nn.functional.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum")
        return total / n_items


def token_mean() -> str:
    torch.manual_seed(0)
    rank = int(os.environ["RANK"])
    model = TokenLM()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 16, (4, 6))
    steps = []
    for step in range(3):
        labels = torch.randint(0, 16, (4, 6))
        labels[:, : 2 + step] = -100  # fewer valid tokens each step
        if step == 1:
            labels[2:] = -100  # rank 1's rows: nothing to learn from (its own mean would be NaN)
        steps.append(labels)
    # the replicas' gradients are averaged (as DDP's): scale the local sum by their number
    local = lambda labels: (ids[2 * rank:2 * rank + 2], labels[2 * rank:2 * rank + 2],  # noqa: E731
                            (labels != -100).sum().double().float() / 2)
    engine = fxspeed.compile(model, 2, fxspeed.Config(optimizer="sgd", lr=0.5), example_inputs=local(steps[0]))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    out = []
    for step, labels in enumerate(steps):
        got = engine.train_step(*local(labels))
        opt.zero_grad()
        loss = ref(ids, labels)
        loss.backward()
        opt.step()
        want = loss.item()
        if abs(got - want) > 1e-5 * abs(want):
            out.append(f"step {step}: loss {got} != the global mean {want}")
    out += state_errors(engine, ref)
    return "; ".join(out) or "ok"


class _NormedBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.norms = torch.nn.ModuleList(torch.nn.BatchNorm1d(8) for _ in range(4))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for lin, norm in zip(self.lins, self.norms):
            x = x + torch.relu(norm(lin(x)))
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()


def _two_stages(model_class: type, y_shape: tuple[int, ...]) -> tuple:
    """(engine: pipeline=2 x 2 micro-batches with SGD, its eager copy, the copy's SGD, a batch)."""
    torch.manual_seed(0)
    model = model_class()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(8, 8, generator=g), torch.randn(*y_shape, generator=g))
    engine = fxspeed.compile(model, 2, fxspeed.Config(pipeline=2, microbatches=2, optimizer="sgd", lr=0.1),
                             example_inputs=batch)
    return engine, ref, torch.optim.SGD(ref.parameters(), lr=0.1), batch


def _eager_two_micro_batches(ref: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One eager step over the batch's two halves in turn (a pipeline's 2 micro-batches): the loss."""
    want = 0.0
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        loss = ref(xm, ym) / 2
        loss.backward()
        want += loss.item()
    opt.step()
    opt.zero_grad()
    return want


def pipeline_batchnorm() -> str:
    """BatchNorm under pipeline=2 x 2 micro-batches (was refused: "pipeline parallelism does not
    support buffer updates yet"): each stage writes its running statistics after every micro-
    batch's forward, as eager's forwards over the two slices in turn; losses, weights and
    statistics equal eager's (state_dict takes each statistic from the stage that wrote it)."""
    engine, ref, opt, (x, y) = _two_stages(_NormedBlocks, (8,))
    out = []
    for step in range(3):
        got = engine.train_step(x, y)
        want = _eager_two_micro_batches(ref, opt, x, y)
        if abs(got - want) > 1e-5 * abs(want):
            out.append(f"step {step}: {got} != eager {want}")
    state = engine.state_dict()
    for name, v in ref.state_dict().items():
        if not torch.allclose(state[name].float(), v.float(), atol=1e-5):
            out.append(f"{name} differs from eager's")
    try:  # BatchNorm loads through its own _load_from_state_dict; the other stage's statistics too
        engine.load_state_dict(state)
    except FxspeedError as e:
        out.append(f"the engine's own state does not load back: {e}")
    return "; ".join(out) or "ok"


class _OneBlockFourSlots(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        block = torch.nn.Linear(8, 8)
        self.inp = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList([block] * 4)  # ALBERT: one block's weights in every slot
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(self.head(x), y)


def pipeline_shared_block() -> str:
    """One block in four slots under pipeline=2: its weights are read on both stages (held by
    each, their gradients summed). Losses and state equal eager's."""
    engine, ref, opt, (x, y) = _two_stages(_OneBlockFourSlots, (8, 2))
    out = []
    for step in range(3):
        got = engine.train_step(x, y)
        want = ref(x, y)
        want.backward()
        opt.step()
        opt.zero_grad()
        if abs(got - want.item()) > 1e-5 * abs(want.item()):
            out.append(f"step {step}: {got} != eager {want.item()}")
    return "; ".join(out + state_errors(engine, ref)) or "ok"


class _PeakMade:
    """While inside: the most bytes the model's Parameters held at once right after deferred
    init made a group (the group still whole), and the ids of every tensor it made."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.peak, self.made = model, 0, set()

    def __enter__(self) -> "_PeakMade":
        from fxspeed.runtime.deferred_init import DeferredInit

        self._original = original = DeferredInit._make

        def make(deferred: DeferredInit, group: int) -> Any:
            if group in deferred._pending:
                self.made |= set(deferred._members[group])  # (tensor ids)
            out = original(deferred, group)
            held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.model.parameters()
                    if not p.is_meta}
            self.peak = max(self.peak, sum(held.values()))
            return out

        DeferredInit._make = make
        return self

    def __exit__(self, *exc: object) -> None:
        from fxspeed.runtime.deferred_init import DeferredInit

        DeferredInit._make = self._original


DEFERRED_LAYOUTS: tuple[dict, ...] = (dict(zero=2), dict(zero=3), dict(zero=1, precision="bf16"), dict(tensor=2),
                                     dict(pipeline=2, microbatches=2))


def deferred_init(layouts: tuple[dict, ...] = DEFERRED_LAYOUTS) -> str:
    """A GPT built under fxspeed.parameters_on_meta, compiled on 2 ranks (ZeRO-2 fp32, ZeRO-3 fp32,
    ZeRO-1 bf16 with master weights, tensor=2, pipeline=2): each rank makes the buckets' values as
    its layout is built; three steps equal one process's AdamW on the global batch from
    `fxspeed.materialize` of the same meta model (the values are the same on every rank and in
    every layout). Under tensor=2 each init group is made whole and cut to this rank's slice at
    once, so the rank never holds the whole model (it made every Parameter whole first, then
    sliced: its peak was the whole model); under pipeline=2 a rank makes only its stages' weights
    (it made every stage's, then freed the others')."""
    from fxspeed.models import GPT, GPTConfig

    out = []
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=8, dropout=0.0)
    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    # slow compute: the planner finds sharding this small GPT cheaper than keeping it whole
    slow = fxspeed.DeviceSpec("slow-compute", 1e9, {"fp32": 1e8}, 1e9, 1e12, "cpu")
    world = int(os.environ["WORLD_SIZE"])
    for kw in layouts:
        with fxspeed.parameters_on_meta():
            meta = GPT(cfg)
        ref = fxspeed.materialize(copy.deepcopy(meta), seed=7)
        whole = sum(p.numel() * 4 for p in ref.parameters())
        # no replicas under tensor=2 / pipeline=2: every rank passes the global batch
        batch = (x, x) if "tensor" in kw or "pipeline" in kw else local_batch((x, x))
        with _PeakMade(meta) as seen:
            engine = fxspeed.compile(meta, [slow] * world if "tensor" in kw else world,
                                     fxspeed.Config(lr=1e-2, eps=1e-3, seed=7, bucket_mb=0.01, **kw),
                                     example_inputs=batch)
        if "tensor" in kw:
            if not engine._tp:
                out.append(f"{kw}: the planner sliced no Parameter (the test's layout)")
            if seen.peak > 0.75 * whole:
                out.append(f"{kw}: laying out the meta model held {seen.peak} bytes at once; the model is {whole}")
        if "pipeline" in kw:
            made_elsewhere = sorted(engine._canonical[pid] for pid in engine._freed_shapes if pid in seen.made)
            if not engine._freed_shapes or made_elsewhere:
                out.append(f"{kw}: made other stages' weights {made_elsewhere[:4]} (freed {len(engine._freed_shapes)})")
            if seen.peak > 0.75 * whole:
                out.append(f"{kw}: laying out the meta model held {seen.peak} bytes at once; the model is {whole}")
        if os.environ.get("DEFERRED_DEBUG"):
            print(kw, "peak", seen.peak, "whole", whole, flush=True)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3, weight_decay=engine.config.weight_decay)
        tol = 1e-5 if engine.config.precision == "fp32" else 2e-2
        for step in range(3):
            got = engine.train_step(*batch)
            opt.zero_grad()
            want = ref(x, x)
            want.backward()
            opt.step()
            if abs(got - want.item()) > tol * abs(want.item()):
                out.append(f"{kw} step {step}: {got} != eager {want.item()}")
        if engine.config.precision == "fp32":
            out += state_errors(engine, ref, prefix=f"{kw} ")
    return "; ".join(out) or "ok"


def _dropout_model(name: str) -> torch.nn.Module:
    """fxspeed's GPT with dropout 0.1 (embeddings, attention probabilities, MLP), or GPT-2 with
    Hugging Face's default dropouts (0.1 on embeddings, attention and residuals)."""
    torch.manual_seed(0)
    if name == "gpt":
        from fxspeed.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                n_positions=16, use_cache=False))


def dropout_replicas() -> str:
    """Dropout under data parallelism (GPT, ZeRO-3; GPT-2's dropouts at TP=2 x DP=2 in
    tensor_parallel_worker's gpt2_dropout_dp): replica d draws its masks from
    its own stream (torch's generator seeded with fxspeed.mesh.stream_seed(d, 0), drawn from the
    state every rank holds): three steps equal eager's over the two replicas' rows drawn so, and
    the user's generator moves by that one draw per step. Every rank is seeded alike (as
    scripts are, for equal initial weights): both replicas drew the same masks for their
    different rows."""
    from fxspeed.mesh import stream_seed

    out = []
    for name, zero in (("gpt", 3),):
        model = _dropout_model(name)
        ref = copy.deepcopy(model)
        g = torch.Generator().manual_seed(2)
        batches = []
        for _ in range(3):
            x, y = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
            batches.append((x, y) if name == "gpt" else {"input_ids": x, "labels": y})
        # SGD: Adam turns float noise on the key bias's exactly-zero gradient into +-lr steps
        engine = fxspeed.compile(model, 2, fxspeed.Config(zero=zero, optimizer="sgd", lr=0.1, bucket_mb=0.01),
                                 example_inputs=local_batch(batches[0]))
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step, b in enumerate(batches):
            before = torch.get_rng_state()
            lb = local_batch(b)
            got = engine.train_step(**lb) if name == "gpt2" else engine.train_step(*lb)
            after = torch.get_rng_state()
            seeds = []
            for d in range(2):
                torch.set_rng_state(before)
                seeds.append(stream_seed(d, 0))
            if not torch.equal(torch.get_rng_state(), after):
                out.append(f"{name} step {step}: the user's generator moved by more than one draw")
            want = 0.0
            for d in range(2):
                torch.manual_seed(seeds[d])
                rows = local_batch(b, d, 2)
                loss = (ref(**rows).loss if name == "gpt2" else ref(*rows)) / 2
                loss.backward()
                want += loss.item()
            opt.step()
            opt.zero_grad()
            torch.set_rng_state(after)
            if abs(got - want) > 1e-5 * abs(want):
                out.append(f"{name} zero={zero} step {step}: {got} != eager {want} over the replicas' own streams")
        out += state_errors(engine, ref, f"{name} zero={zero} ")
    out += _held_generator_replicas()
    return "; ".join(out) or "ok"


class _HeldGenerator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(7)  # alike on every rank

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.nn.functional.mse_loss(h * (torch.rand(h.shape, generator=self.gen) > 0.5), y)


def _held_generator_replicas() -> list[str]:
    """A generator the module holds, seeded alike, on 2 replicas given the same rows: each replica
    draws from its own stream of it (stream_seed(d, 0, gen)); both drew the same numbers."""
    from fxspeed.mesh import stream_seed

    torch.manual_seed(0)
    model = _HeldGenerator()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    engine = fxspeed.compile(model, 2, fxspeed.Config(optimizer="sgd", lr=0.1), example_inputs=(x, y))
    opt, out = torch.optim.SGD(ref.parameters(), lr=0.1), []
    for step in range(2):
        before = ref.gen.get_state()
        got = engine.train_step(x, y)
        want = 0.0
        for d in range(2):
            ref.gen.set_state(before)
            ref.gen.manual_seed(stream_seed(d, 0, ref.gen))
            loss = ref(x, y) / 2
            loss.backward()
            want += loss.item()
        opt.step()
        opt.zero_grad()
        ref.gen.set_state(before)
        stream_seed(0, 0, ref.gen)  # the module's generator moves by that one draw per step
        if abs(got - want) > 1e-5 * abs(want):
            out.append(f"held generator step {step}: {got} != eager {want} over the replicas' own streams")
    return out + state_errors(engine, ref, "held generator ")


class _MaskedBlock(torch.nn.Module):
    """A block that keeps its last dropout mask in a buffer (the step writes it), or multiplies
    by `given` masks (the eager reference), one per call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("mask", torch.zeros(4, 16))
        self.given: list | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.given.pop(0) if self.given else torch.nn.functional.dropout(torch.ones_like(x), 0.5, self.training)
        self.mask = m
        return torch.tanh(self.lin(x)) * m


class _MaskedStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_MaskedBlock() for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return torch.nn.functional.mse_loss(x, y)


class _UnevenDraws(torch.nn.Module):
    """Two dropouts on the first stage (a), none on the second (b)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(torch.nn.functional.dropout(self.a(x), 0.1), 0.1)
        return torch.nn.functional.mse_loss(self.b(h), y)


def dropout_stages() -> str:
    """Dropout under pipeline=2 (2 micro-batches, one block a stage, ranks seeded alike): stage s
    draws its masks from its own stream (fxspeed.mesh.stream_seed(0, s)), micro-batch after
    micro-batch; both stages drew the same masks (block 1 repeated block 0's). The masks each
    stage kept, the losses and the weights equal eager's with those masks (backward reuses the
    forward's masks)."""
    from fxspeed.mesh import stream_seed

    torch.manual_seed(0)
    model = _MaskedStack()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    engine = fxspeed.compile(model, 2, fxspeed.Config(pipeline=2, microbatches=2, split_points=("blocks.1",),
                                                      optimizer="sgd", lr=0.1), example_inputs=(x, y))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out = []
    for step in range(2):
        before = torch.get_rng_state()
        got = engine.train_step(x, y)
        after = torch.get_rng_state()
        masks = []
        for s in range(2):
            torch.set_rng_state(before)
            torch.manual_seed(stream_seed(0, s))
            masks.append([torch.nn.functional.dropout(torch.ones(4, 16), 0.5) for _ in range(2)])
        torch.set_rng_state(after)
        if torch.equal(masks[0][1], masks[1][1]):
            out.append("the reference streams of the two stages drew the same masks")
        kept = engine.state_dict()
        for s in range(2):
            if not torch.equal(kept[f"blocks.{s}.mask"], masks[s][1]):
                same = torch.equal(kept[f"blocks.{s}.mask"], kept[f"blocks.{1 - s}.mask"])
                out.append(f"step {step}: stage {s}'s last mask is not its stream's"
                           + (" (it equals the other stage's)" if same else ""))
        for s in range(2):
            ref.blocks[s].given = list(masks[s])
        want = _eager_two_micro_batches(ref, opt, x, y)
        if abs(got - want) > 1e-5 * abs(want):
            out.append(f"step {step}: {got} != eager {want} with the stages' masks")
    state = engine.state_dict()
    for name, p in ref.named_parameters():
        if not torch.allclose(state[name], p, atol=1e-5):
            out.append(f"{name} differs from eager's")
    # Stages drawing different counts (GPT: the embeddings' dropout on the first only) left the
    # ranks' generators apart, so a script sampling each batch from torch's generator on every
    # rank passed different batches to the two stages: "ranks disagree on the batch" at step 1
    torch.manual_seed(0)
    model = _UnevenDraws()
    def batch() -> tuple:
        return torch.randn(8, 16), torch.randn(8, 16)
    engine = fxspeed.compile(model, 2, fxspeed.Config(pipeline=2, microbatches=2, split_points=("b",)),
                             example_inputs=batch())
    try:
        for _ in range(2):
            engine.train_step(*batch())
    except FxspeedError as e:
        out.append(f"batches drawn from torch's generator on each rank after a pipeline step with dropout: {e}")
    # eval_step too: F.dropout draws in eval mode (training=True by default), on the first stage
    # only; eval ran without the stages' own streams, so the ranks' generators came apart there
    try:
        for _ in range(2):
            engine.eval_step(*batch())
    except FxspeedError as e:
        out.append(f"batches drawn from torch's generator on each rank after a pipeline eval_step that draws: {e}")
    # a generator put on a module after compile: the stages draw from the ones they traced, and
    # cannot be traced again (found once per program, as the train step's are: runtime/engine.py)
    model.a.gen = torch.Generator()
    try:
        engine.train_step(*batch())
        out.append("a generator put on a module after the pipeline was compiled was not refused")
    except FxspeedError as e:
        if "changed after the pipeline was compiled" not in str(e):
            out.append(f"unclear refusal of a generator put on a module after compile: {e}")
    return "; ".join(out) or "ok"


CASES = {"zero3_module": zero3_module, "deferred_init": deferred_init, "pipeline_batchnorm": pipeline_batchnorm,
         "pipeline_shared_block": pipeline_shared_block, "repointed_zero12": repointed_zero12, "raced_write_zero12": raced_write_zero12, "token_mean": token_mean, "nan_one_rank": nan_one_rank, "eval_global": eval_global, "layout_dp": layout_dp,
         "no_decay_zero": no_decay_zero, "accum_once": accum_once, "tie_second_name": tie_second_name,
         "scripted_submodule": scripted_submodule, "dropout_replicas": dropout_replicas,
         "dropout_stages": dropout_stages}


if __name__ == "__main__":
    run_cases(CASES)  # tests/workers/common.py: every case of one launch in turn, a file per case and rank
