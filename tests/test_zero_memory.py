"""ZeRO memory, measured from outside fxspeed: the kernel's peak RSS of each rank.

Each rank of a torch.distributed.run launch builds a GPT with >= 100M parameters, reads its
RSS, resets the kernel's peak counter, compiles and trains 2 Adam steps, and reports the
peak growth (tests/workers/memory_worker.py). Ratios are taken against zero=0 in the same
launch. glibc is told to return freed tensors to the OS (MALLOC_MMAP_THRESHOLD_), otherwise
its heap would keep every old peak resident and RSS would not show frees.

The plan is checked per rank: the measured peak is the growth plus the parameters the
model already held at the baseline (the plan's peak counts them, sharded under ZeRO-3).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.multiprocess import launch_worker



# 105M parameters in 6 blocks 1152 wide rather than the preset's 14 of 768: tracing costs per
# block. 2 x 8 tokens: activations are a few MB next to GBs of model states at any of these
# sizes, and a bf16 matmul on a CPU without AVX512-BF16 runs about 10x slower than fp32 (the
# bf16 cases were 37 s a step at 2 x 64 tokens, three quarters of the module's time; a 2-rank
# bf16 ZeRO-1 launch took 59 CPU-s at 2 x 16 tokens, 42 at 2 x 8, with the same plan error).
SHAPE = ("--layers", "6", "--width", "1152", "--seq", "8")


def measure(world: int, zero: str, out: Path, *extra: str) -> dict[tuple, dict]:
    launch_worker("tests.workers.memory_worker", world, out, "--zero", zero, *extra,
                  env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    recs = [json.loads(p.read_text()) for p in out.glob(f"mem_w{world}_*.json")]
    # fp32 runs keyed (zero, rank), others (precision, zero, rank); tensor-parallel ones ("tp2", ...) before that
    def key(r: dict) -> tuple:
        k = (r["zero"], r["rank"]) if r["precision"] == "fp32" else (r["precision"], r["zero"], r["rank"])
        k = ("end", *k) if r.get("end") else k
        return k if r["tensor"] == 1 else (f"tp{r['tensor']}", *k)
    return {key(r): r for r in recs}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict]:
    """One 2-rank launch for both 2-rank tests (a launch and its warm-up cost more than a
    configuration): every ZeRO stage in fp32, ZeRO-1 in bf16, ZeRO-1/2 in fp32 and bf16 with the
    optimizer stepped after the program (the ZeRO paper's accounting), and tensor parallelism 2.

    (Measured plan-vs-RSS errors at 2 x 64 tokens, docs/decisions/plan-gradient-buckets.md: within
    8% here for every configuration; the 4-rank test's ZeRO-3 within 7% at the preset's shape and
    at 10 x 896.)"""
    return measure(2, "0,1,2,3,bf16:1,end:1,end:2,end:bf16:1,end:bf16:2,tp2:0",
                   tmp_path_factory.mktemp("zero_memory_2_ranks"), *SHAPE)


def check_plan(rec: dict) -> float:
    measured = rec["growth_bytes"] + rec["param_bytes"]
    err = abs(rec["plan_peak_bytes"] - measured) / measured
    assert err <= 0.15, (f"zero={rec['zero']} {rec['precision']} rank={rec['rank']}: plan {rec['plan_peak_bytes']:,} vs "
                         f"measured {measured:,}")
    return err


@pytest.mark.slow
def test_each_zero_stage_cuts_peak_rss_on_two_ranks_as_the_zero_paper_says_and_bf16_master_weights_cut_more(
        two_ranks: dict[tuple, dict]) -> None:
    recs = two_ranks
    for rank in (0, 1):
        base = recs[(0, rank)]["growth_bytes"]
        ratio = {z: recs[(z, rank)]["growth_bytes"] / base for z in (1, 2, 3)}
        assert recs[(0, rank)]["param_bytes"] >= 4 * 100e6
        assert ratio[1] <= 0.75, ratio
        assert ratio[2] <= 0.65, ratio
        assert ratio[3] <= 0.55, ratio
        for z in range(4):
            check_plan(recs[(z, rank)])
        # The ZeRO paper's layout (bf16 working weights and gradients, fp32 master in the partition):
        # 2 + 2 + 12/N bytes per parameter instead of 4 + 4 + 8/N (ZeRO-1: 10 vs 12 at N=2),
        # 2 + 14/N instead of 4 + 12/N (ZeRO-2: 9 vs 10). The paper holds every gradient until the
        # step: so do these runs ("end"). Stepped per bucket inside backward (the default) the
        # gradients die in backward and both precisions hold about 4 + 8/N = 2 + 12/N bytes.
        total = lambda rec: rec["growth_bytes"] + rec["param_bytes"]  # noqa: E731
        check_plan(recs[("bf16", 1, rank)])
        for z, paper in ((1, 10 / 12), (2, 9 / 10)):
            check_plan(recs[("end", "bf16", z, rank)])
            check_plan(recs[("end", z, rank)])
            assert total(recs[("end", "bf16", z, rank)]) <= (paper + 0.05) * total(recs[("end", z, rank)]), z
            # stepping inside backward never costs memory
            if z == 1:
                assert total(recs[(z, rank)]) <= 1.02 * total(recs[("end", z, rank)])


@pytest.mark.slow
def test_zero3_on_four_ranks_needs_at_most_a_third_of_data_parallel_memory_in_bf16(tmp_path: Path) -> None:
    """bf16 ZeRO-3 (working shards, gradients and fp32 masters all in the partition) against fp32
    data parallelism. fp32 ZeRO-3 ran here too until the suite needed the time (a third of this
    launch); its ratio (<= 0.55 at N=2) and plan are checked in the 2-rank launch."""
    recs = measure(4, "0,bf16:3", tmp_path, *SHAPE)
    for rank in range(4):
        assert recs[("bf16", 3, rank)]["growth_bytes"] <= 0.35 * recs[(0, rank)]["growth_bytes"]
        check_plan(recs[(0, rank)])
        check_plan(recs[("bf16", 3, rank)])


@pytest.mark.slow
def test_a_tensor_parallel_plan_counts_each_ranks_slices_and_is_within_15_percent_of_its_peak_rss(
        two_ranks: dict[tuple, dict]) -> None:
    for rank in range(2):
        rec = two_ranks[("tp2", 0, rank)]
        assert rec["tensor"] == 2 and rec["param_bytes"] >= 4 * 100e6
        # The plan is tp rank 0's program: about half the model's weights, gradients and states
        # (16 bytes per parameter under fp32 Adam), not the whole model's.
        assert rec["plan_peak_bytes"] < 0.6 * 4 * rec["param_bytes"]
        check_plan(rec)
