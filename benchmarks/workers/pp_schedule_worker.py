"""One rank of benchmarks/bench_pipeline_schedules.py (run under torch.distributed.run).

Trains the benchmark GPT with fxspeed pipeline parallelism (one schedule, every rank the same
batch) and writes, for this rank, per timed step: the step time, the time spent in compute
actions (F/B/I/W), the idle fraction (1 - compute / step), the measured seconds per
micro-batch of each stage, and what the simulator predicts for this rank's idle fraction
from (a) the stage times measured in that step and (b) the planner's predicted stage times.
Peak RSS growth: VmHWM - VmRSS after a reset (/proc/self/clear_refs) taken once the first
step allocated the optimizer state, so it covers activations in flight, gradients and
temporaries of the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dp_worker import reset_peak, status_kb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", required=True)
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--offload-activations", default=None, metavar="DIR",
                    help="Config(offload='activations', nvme_path=DIR): OFFLOAD/RELOAD actions move saved activations")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")

    import fxspeed
    from fxspeed.models import GPT, GPTConfig
    from fxspeed.planner.simulator import simulate

    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=a.seq, n_layer=a.layers, n_head=a.heads, n_embd=a.width))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (a.batch, a.seq), generator=g), torch.randint(0, 256, (a.batch, a.seq), generator=g))
               for _ in range(a.warmup + a.steps)]
    extra = dict(offload="activations", nvme_path=a.offload_activations) if a.offload_activations else {}
    cfg = fxspeed.Config(pipeline=world, microbatches=a.microbatches, schedule=a.schedule, optimizer="adamw", lr=1e-4,
                         pipeline_chunks=a.chunks, **extra)
    engine = fxspeed.compile(model, world, cfg, example_inputs=batches[0])
    p2p = engine.measure_p2p_latency()
    rank = dist.get_rank()
    losses, steps = [], []
    baseline_kb = 0
    for i, b in enumerate(batches):
        if i == 1:
            reset_peak()
            baseline_kb = status_kb("VmRSS")
        t0 = time.perf_counter()
        losses.append(engine.train_step(*b))
        wall = time.perf_counter() - t0
        measured = engine.measured_costs()  # collective: every rank calls it every step
        if i < a.warmup:
            continue
        sim = simulate(engine.schedule, measured)
        pos = engine.position
        steps.append({"wall_s": wall, "step_s": engine.stats["step_s"], "compute_s": engine.stats["compute_s"],
                      "idle_fraction": engine.stats["idle_fraction"],
                      "sim_idle_fraction": sim.own_idle_fraction(pos),
                      "sim_pipeline_idle_fraction": sim.idle[pos] / sim.step_time if sim.step_time else 0.0,
                      "sim_step_s": sim.step_time,
                      "stage_s": {str(s): {"F": c.forward, "I": c.backward_input, "W": c.backward_weight}
                                  for s, c in enumerate(measured.stages)}})
    peak_kb = status_kb("VmHWM") - baseline_kb
    med = lambda k: statistics.median(s[k] for s in steps)  # noqa: E731
    plan = engine.plan.pipeline
    out = {"rank": rank, "position": engine.position, "stages": engine.stages, "schedule": engine.schedule.name,
           "losses": losses, "steps": steps, "median": {k: med(k) for k in ("wall_s", "step_s", "compute_s",
                                                                                "idle_fraction", "sim_idle_fraction")},
           "planner_idle_fraction": plan["own_idle_fraction"][engine.position], "planner_bubble": plan["bubble"],
           "plan_stages": plan["stages"], "peak_growth_bytes": peak_kb * 1024,
           "n_params": sum(p.numel() for p in model.parameters()), "p2p_latency_s": p2p}
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
