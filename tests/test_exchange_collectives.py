"""Point-to-point reduce-scatter and all-gather (runtime/kernels/collectives.py), which ZeRO
uses on gloo: the same results as torch's collectives, bit for bit for fp32 and bf16 sums of
2 ranks (one add either way), within rounding for 3 (gloo's ring adds in another order)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.multiprocess import rank_env, run_ranks

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_scatter_and_gather_equal_torchs_reduce_scatter_and_all_gather(world: int, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "tests.workers.exchange_worker", "--out", str(tmp_path)]
    env = rank_env()
    proc = run_ranks(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in range(world):
        rec = torch.load(tmp_path / f"exchange_rank{rank}.pt")
        assert "pad the input to a multiple of the world size" in rec.pop("uneven_error")
        assert len(rec) == 3 * 2 * 3 + 6
        for case, (got, want) in rec.items():
            assert got.dtype == want.dtype and got.shape == want.shape, case
            if world == 2 or case.startswith("gather"):
                assert torch.equal(got, want), (rank, case)
            else:
                torch.testing.assert_close(got, want, msg=f"rank {rank} {case}")


def test_the_exchanges_have_fake_implementations_for_tracing() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxspeed.runtime.kernels.collectives import exchange_gather, exchange_gather_out, exchange_scatter

    with FakeTensorMode():
        x = torch.empty(12, dtype=torch.bfloat16)
        assert exchange_scatter(x, 3, "g").shape == (8,)
        assert exchange_gather(x, 3, "g").shape == (36,)
        out = torch.empty(36, dtype=torch.bfloat16)
        assert exchange_gather_out(x, 3, "g", out=out) is out


def test_on_gloo_zero3_reduce_scatters_and_gathers_by_exchange_and_the_gathers_share_workspaces() -> None:
    import fxspeed
    from fxspeed.compiler import PassOptions, compile_step
    from fxspeed.models import GPT, GPTConfig
    from fxspeed.passes.parallel.shard_parameters import GATHER_KEY
    from fxspeed.runtime.kernels.collectives import exchange_gather_out, exchange_scatter

    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=512, block_size=32, n_layer=4, n_head=2, n_embd=64))
    x, y = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    config = fxspeed.Config(zero=3)
    opts = PassOptions.single_device(config, world_size=2, rank=1, zero=3, group_name="unused", bucket_bytes=100_000,
                                     scatter_via_exchange=True, gather_via_exchange=True)
    gm = compile_step(m, (x, y), {}, config=config, loss_fn=None, options=opts).captured.gm
    nodes = list(gm.graph.nodes)
    gathers = [n for n in nodes if GATHER_KEY in n.meta]
    assert gathers and all(n.target is exchange_gather_out for n in gathers)  # written into reused workspaces
    scatters = [n for n in nodes if n.target is exchange_scatter]
    assert scatters and not any(getattr(n.target, "namespace", None) == "_c10d_functional" and "reduce" in str(n.target)
                                for n in nodes)
    for sc in scatters:
        # After the wait: the peer's chunk plus this rank's chunk of the flat bucket (rank 1's half).
        (wait,) = sc.users
        (add,) = wait.users
        s = sc.meta["val"].numel()
        assert add.target is torch.ops.aten.add_.Tensor and add.args[0] is wait
        assert add.args[1].args == (sc.args[0], 0, s, 2 * s)
