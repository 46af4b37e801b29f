"""Optimizer offload (Config.offload="optimizer"): Adam's moments in files under nvme_path,
stepped chunk by chunk by torch's fused kernel (runtime/offloaded_optimizer.py, offload_io.py).
Parameter offload (offload="parameters"/"all", ZeRO-3): the working shards in files, read ahead of
their gathers (runtime/offloaded_parameters.py, passes/memory/offload_parameters.py).

Parity is bit for bit: the update is the same elementwise kernel over the same tensors."""

from __future__ import annotations

import copy
import re
import errno
import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxspeed
from fxspeed.config import ConfigWarning
from fxspeed.errors import ConfigError, FxspeedError
from fxspeed.planner.estimate import offload_chunk_bytes
from fxspeed.models import GPT, GPTConfig
from fxspeed.runtime.offloaded_optimizer import OffloadedAdam
from tests.multiprocess import check_swap_worker



def _odd_tensors() -> list[nn.Parameter]:
    """A contiguous matrix, a transposed one, a channels_last conv weight, a short vector and a
    long one: chunks of 4096 bytes cut the long ones into runs, keep the others whole."""
    torch.manual_seed(0)
    conv = torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last)
    return [nn.Parameter(torch.randn(40, 30)), nn.Parameter(torch.randn(30, 40).t()), nn.Parameter(conv),
            nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(1000))]


def _same_gradients(ours: list[nn.Parameter], ref: list[nn.Parameter], step: int) -> None:
    """Both lists get the same seeded gradients, each laid out like its parameter."""
    g = torch.Generator().manual_seed(step)
    for a, b in zip(ours, ref):
        grad = torch.randn(a.shape, generator=g)
        a.grad, b.grad = torch.empty_like(a).copy_(grad), torch.empty_like(b).copy_(grad)


@pytest.mark.parametrize("decoupled, chunk_bytes", [(True, 4096 * 3), (False, 4096 * 3), (True, 4096)])
def test_the_offloaded_optimizer_steps_bit_for_bit_like_torchs_fused_adam_over_several_chunks(
        tmp_path: Path, decoupled: bool, chunk_bytes: int) -> None:
    """With 4096-byte chunks (512 elements of two moments) the contiguous 1200- and 1000-element
    tensors are cut into runs across chunks; the transposed and channels_last ones stay whole."""
    ours, ref = _odd_tensors(), _odd_tensors()
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    opt = OffloadedAdam(ours, decoupled=decoupled, swap_root=tmp_path, name="t", chunk_bytes=chunk_bytes, **kw)
    torch_opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(ref, fused=True, **kw)
    assert opt.stats["chunks"] >= (3 if chunk_bytes > 4096 else 7)
    if chunk_bytes == 4096:
        assert max(len(pieces) for pieces in opt._where.values()) == 3  # 1200 = 512 + 512 + 176
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(ours, ref):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone().to(memory_format=torch.contiguous_format), grad.clone()
            b.grad = torch.empty_like(b).copy_(grad)  # torch's optimizer pairs elements in the param's layout
            a.grad = torch.empty_like(a).copy_(grad)
        opt.prefetch()
        opt.step()
        torch_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, ref)), f"step {step}"
    full = opt.full_state()
    for a, b in zip(ours, ref):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(full[a][key], torch_opt.state[b][key]), key
    # torch.optim's state_dict format, moments included, round-trips through a fresh optimizer
    again = OffloadedAdam(_odd_tensors(), decoupled=decoupled, swap_root=tmp_path, name="u", chunk_bytes=chunk_bytes,
                          **kw)
    again.load_state_dict(opt.state_dict())
    for a, b in zip(again.full_state().values(), full.values()):
        assert all(torch.equal(a[k], b[k]) for k in b)
    opt.close()
    again.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("order", ["file", "reverse"])
def test_stepping_a_few_tensors_at_a_time_in_any_order_equals_one_step_over_all(tmp_path: Path, order: str) -> None:
    """step(only=...) per group of tensors, as the program steps gradient buckets inside backward:
    in file order the read of the next chunk stays in flight between calls; in reverse order every
    read ahead lands in a slot the next call needs, and must be finished and dropped, not
    overwritten while in flight. Chunks begin at `chunk_starts`: none spans two groups."""
    ours, ref = _odd_tensors(), _odd_tensors()
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    groups = [[0, 1], [2, 3], [4]]
    opt = OffloadedAdam(ours, decoupled=True, swap_root=tmp_path, name="t", chunk_bytes=4096, chunk_starts=(0, 2, 4),
                        **kw)
    torch_opt = torch.optim.AdamW(ref, fused=True, **kw)
    owner = {id(t): i for i, g in enumerate(groups) for j in g for t in [ours[j]]}
    for c in opt._chunks:
        assert len({owner[id(pc.p)] for pc in c.pieces}) == 1  # no chunk spans two groups
    for step in range(3):
        _same_gradients(ours, ref, step)
        opt.prefetch()
        for group in (groups if order == "file" else groups[::-1]):
            opt.step(only=[ours[j] for j in group])
            for j in group:
                ours[j].grad = None
        torch_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, ref)), f"step {step}"
    full = opt.full_state()
    assert all(torch.equal(full[a][k], torch_opt.state[b][k]) for a, b in zip(ours, ref)
               for k in ("exp_avg", "exp_avg_sq", "step"))
    opt.close()


def _gpt() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    x = torch.randint(0, 64, (4, 16))
    return model, (x, torch.roll(x, 1, 1))


def _pair(tmp_path: Path, memory_budget_gb: float | None = None,
          **cfg: object) -> tuple[fxspeed.Engine, fxspeed.Engine, tuple]:
    model, batch = _gpt()
    twin = copy.deepcopy(model)
    base = dict(lr=1e-2, weight_decay=0.1, grad_clip=0.5, bucket_mb=0.01, **cfg)
    plain = fxspeed.compile(model, 1, fxspeed.Config(**base), example_inputs=batch)
    off = fxspeed.compile(twin, 1, fxspeed.Config(**base, offload="optimizer", nvme_path=str(tmp_path),
                                                  memory_budget_gb=memory_budget_gb), example_inputs=batch)
    return plain, off, batch


def _same_states(a: fxspeed.Engine, b: fxspeed.Engine) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = a._canonical_optimizer_state(), b._canonical_optimizer_state()
    assert oa.keys() == ob.keys()
    assert all(torch.equal(oa[k][s], ob[k][s]) for k in oa for s in oa[k])


def test_training_with_the_optimizer_offloaded_equals_training_without_it_bit_for_bit(tmp_path: Path) -> None:
    plain, off, (x, y) = _pair(tmp_path)
    for step in range(4):
        xs = torch.roll(x, step, 0)
        assert plain.train_step(xs, y) == off.train_step(xs, y)
    assert off.optimizer.stats["chunks"] > 2
    _same_states(plain, off)
    files = list(tmp_path.glob("fxspeed-swap-*-rank0-*/states.bin"))
    assert len(files) == 1 and files[0].stat().st_size >= 8 * sum(p.numel() for p in off.model.parameters())
    swap_dir = files[0].parent
    del off
    gc.collect()
    assert not swap_dir.exists(), "the swap directory outlives its engine"


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.b(torch.relu(self.a(x))).squeeze(-1) - y) ** 2).mean()


def test_a_skipped_step_leaves_the_offloaded_states_as_they_were(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Regression()
    x, y = torch.randn(8, 16), torch.randn(8)
    base = dict(lr=1e-2, nan_check="skip", bucket_mb=0.002)
    plain = fxspeed.compile(copy.deepcopy(model), 1, fxspeed.Config(**base), example_inputs=(x, y))
    off = fxspeed.compile(model, 1, fxspeed.Config(**base, offload="optimizer", nvme_path=str(tmp_path)),
                          example_inputs=(x, y))
    assert off.optimizer.stats["chunks"] >= 2
    for e in (plain, off):
        e.train_step(x, y)
        e.train_step(x * float("nan"), y)  # skipped: the prefetched reads are used by the next step
        assert e.stats["skipped_steps"] == 1
        e.train_step(x, y)
    _same_states(plain, off)


def test_fp16_with_the_optimizer_offloaded_and_nan_check_trains_and_skips_only_bad_steps(tmp_path: Path) -> None:
    """The offloaded optimizer unscales fp16 gradients inside its step, so nan_check saw them still
    scaled: their 2-norm overflowed fp16 and every finite step was reported NaN and skipped."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)
    losses, skipped = {}, {}
    for check in ("off", "skip"):
        cfg = fxspeed.Config(lr=1e-2, precision="fp16", zero=1, nan_check=check, offload="optimizer",
                             nvme_path=str(tmp_path))
        e = fxspeed.compile(copy.deepcopy(model), 1, cfg, example_inputs=(x, y))
        losses[check] = [e.train_step(x, y) for _ in range(4)]
        skipped[check] = e.stats["skipped_steps"]
    # the first step may overflow at the initial loss scale (2**16): fp16's own skip, in both (on a
    # CPU with native fp16 arithmetic, AVX512-FP16, it does not; computed in fp32 from fp16 it does)
    assert skipped["off"] == skipped["skip"] <= 1, skipped
    assert losses["off"] == losses["skip"] and losses["skip"][0] != losses["skip"][-1]
    before = e.stats["skipped_steps"]
    e.train_step(x, torch.full_like(y, -100))  # no target: the mean of nothing is NaN
    assert e.stats["skipped_steps"] == before + 1


def test_a_checkpoint_written_with_offload_loads_without_it_and_back(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    plain, off, (x, y) = _pair(swap)
    for e in (plain, off):
        e.train_step(x, y)
    off.save(tmp_path / "ck_off")
    plain.save(tmp_path / "ck_plain")
    fresh_plain, fresh_off, _ = _pair(swap)
    fresh_plain.load(tmp_path / "ck_off")     # offloaded -> in memory
    fresh_off.load(tmp_path / "ck_plain")     # in memory -> offloaded
    _same_states(fresh_plain, fresh_off)
    _same_states(plain, fresh_off)
    assert fresh_plain.train_step(x, y) == fresh_off.train_step(x, y) == plain.train_step(x, y)


@pytest.mark.slow
def test_optimizer_offload_on_two_ranks_equals_no_offload_under_zero_1_and_3_and_a_pipeline(tmp_path: Path) -> None:
    check_swap_worker("tests.workers.offload_worker", tmp_path)


def _masters_pair(swap: Path, **cfg: object) -> tuple[fxspeed.Engine, fxspeed.Engine, tuple]:
    """Two one-process bf16 ZeRO-1 engines with the optimizer offloaded: every state (fp32 masters
    included) in the file, and the same optimizer with every chunk resident (a memory budget
    larger than the model): the file's round trip is the only difference."""
    model, batch = _gpt()
    base = {**dict(lr=1e-2, weight_decay=0.1, grad_clip=0.5, bucket_mb=0.004, zero=1, precision="bf16",
                   offload="optimizer", nvme_path=str(swap)), **cfg}
    on_disk = fxspeed.compile(model, 1, fxspeed.Config(**base), example_inputs=batch)
    resident = fxspeed.compile(copy.deepcopy(_gpt()[0]), 1, fxspeed.Config(**base, memory_budget_gb=100.0),
                               example_inputs=batch)
    return on_disk, resident, batch


def test_under_bf16_the_fp32_masters_go_to_the_file_with_the_moments_and_memory_keeps_bf16_copies(
        tmp_path: Path) -> None:
    on_disk, resident, (x, y) = _masters_pair(tmp_path)
    n = sum(p.numel() for p in _gpt()[0].parameters())  # (tied: the embedding counted once)
    assert on_disk.optimizer.stats["masters"] and on_disk.optimizer.stats["resident_chunks"] == 0
    assert on_disk.optimizer.stats["chunks"] > 2 and resident.optimizer.stats["chunks"] == 0
    flat = on_disk._flat
    # in memory: bf16 working buckets only; no fp32 weight anywhere, the module's Parameters empty
    assert {t.dtype for t in flat.work_shards} == {torch.bfloat16} and flat.shards is flat.work_shards
    assert all(p.numel() == 0 for p in on_disk.model.parameters())
    sizes = sorted(f.stat().st_size for f in tmp_path.glob("fxspeed-swap-*/states.bin"))
    assert sizes[0] == 0 and sizes[1] >= 12 * n  # (the resident twin's file is empty)
    for step in range(3):
        xs = torch.roll(x, step, 0)
        assert on_disk.train_step(xs, y) == resident.train_step(xs, y)
        for g in (on_disk, resident):
            assert all(t.grad is None for t in g._flat.work_shards)
    _same_states(on_disk, resident)
    # the plan: masters and moments on disk (12 bytes a parameter); in memory the staging the
    # optimizer allocates: three slots of one chunk (the bucket shards, larger than a chunk here,
    # are cut into chunk-sized runs) and one chunk of fp32 gradients. The plan counts full chunks;
    # the optimizer's largest holds whole tensors or runs of 64 elements, at most a chunk.
    assert on_disk.plan.offloaded["disk"] >= 12 * n
    opt = on_disk.optimizer
    assert max(len(pieces) for pieces in opt._where.values()) > 1
    staging = sum(s.nbytes for s in opt._slots) + opt._scratch.numel() * 4
    assert len(opt._slots) == 3 and staging <= on_disk.plan.model_states["optimizer_states"] <= 1.5 * staging
    assert on_disk.plan.model_states["parameters"] == 2 * n


def test_a_checkpoint_with_masters_in_the_file_resumes_bit_for_bit_and_loads_into_fp32_training(
        tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    on_disk, _, (x, y) = _masters_pair(swap)
    on_disk.train_step(x, y)
    on_disk.save(tmp_path / "ck")
    saved = {k: v.clone() for k, v in on_disk.state_dict().items()}
    assert all(v.dtype == torch.float32 for v in saved.values())  # the fp32 masters, not bf16 copies
    fresh, _, _ = _masters_pair(swap)
    fresh.load(tmp_path / "ck")
    _same_states(on_disk, fresh)
    assert fresh.train_step(x, y) == on_disk.train_step(x, y)
    model, batch = _gpt()
    fp32 = fxspeed.compile(model, 1, fxspeed.Config(lr=1e-2, bucket_mb=0.01), example_inputs=batch)
    fp32.load(tmp_path / "ck")
    assert all(torch.equal(fp32.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_optimizers_own_state_dict_round_trip_keeps_the_fp32_moments_under_low_precision_working_copies(
        tmp_path: Path, precision: str) -> None:
    """engine.optimizer.state_dict() -> train -> load_state_dict(both) -> the same steps again.
    torch's Optimizer.load_state_dict casts each moment to its parameter's dtype: the bf16/fp16
    working shards, so the moments came back rounded (fp16 flushed exp_avg_sq to 0 and the
    repeated step moved the weights by ~90)."""
    on_disk, _, (x, y) = _masters_pair(tmp_path, precision=precision)
    on_disk.train_step(x, y)
    weights = {k: v.clone() for k, v in on_disk.state_dict().items()}
    saved = copy.deepcopy(on_disk.optimizer.state_dict())
    moments = {k: v.clone() for k, v in saved["state"][0].items()}
    first = [on_disk.train_step(torch.roll(x, s, 0), y) for s in (1, 2)]
    after = {k: v.clone() for k, v in on_disk.state_dict().items()}
    on_disk.load_state_dict(weights)
    on_disk.optimizer.load_state_dict(saved)
    assert all(torch.equal(on_disk.optimizer.state_dict()["state"][0][k], v) for k, v in moments.items())
    assert [on_disk.train_step(torch.roll(x, s, 0), y) for s in (1, 2)] == first
    assert all(torch.equal(on_disk.state_dict()[k], v) for k, v in after.items())


def _three_tiers(swap: Path) -> tuple[dict[str, fxspeed.Engine], tuple]:
    """One-process bf16 ZeRO-3 engines over the same model: masters + moments in the file
    ("optimizer", the reference), the working shards in files too ("all"), and only the working
    shards in files with the masters and torch's fused Adam in memory ("parameters")."""
    model, batch = _gpt()
    base = dict(lr=1e-2, weight_decay=0.1, grad_clip=0.5, bucket_mb=0.004, zero=3, precision="bf16",
                nvme_path=str(swap))
    return {kind: fxspeed.compile(copy.deepcopy(model), 1, fxspeed.Config(**base, offload=kind), example_inputs=batch)
            for kind in ("optimizer", "all", "parameters")}, batch


def test_under_zero_3_the_working_shards_live_in_files_read_ahead_of_use_and_training_is_unchanged(
        tmp_path: Path) -> None:
    engines, (x, y) = _three_tiers(tmp_path)
    n = sum(p.numel() for p in _gpt()[0].parameters())
    for step in range(3):
        xs = torch.roll(x, step, 0)
        losses = {kind: e.train_step(xs, y) for kind, e in engines.items()}
        assert len(set(losses.values())) == 1, losses
    _same_states(engines["optimizer"], engines["all"])
    _same_states(engines["optimizer"], engines["parameters"])
    for kind in ("all", "parameters"):
        e = engines[kind]
        files = e._flat.files
        # no working shard in memory (reading one raises, or faults: never old values); the file
        # holds 2 bytes a parameter
        assert all(t.dtype == torch.bfloat16 and t.untyped_storage().nbytes() == 0 for t in e._flat.work_shards)
        with pytest.raises(RuntimeError, match="not allocated"):
            e._flat.work_shards[0].float()
        assert files.swap.nbytes >= 2 * n
        # the program reads every shard from the files (forward and backward: at least twice a
        # step); only the first step's first read had nothing ahead of it
        assert files.stats["fetches"] >= 3 * 2 * len(e._flat.buckets) and files.stats["waited_reads"] <= 1
        assert not [s for s in e.graph().graph.nodes if s.op == "placeholder" and "shard" in s.name]
        # the plan: working shards (2 B/param) on disk, a few buckets of them in memory
        assert e.plan.offloaded["disk"] >= 2 * n + (12 * n if kind == "all" else 0)
        assert e.plan.model_states["parameters"] < 2 * n
    assert engines["optimizer"].plan.model_states["parameters"] == 2 * n
    # Dropped right after a step (its writes in flight): every swap directory goes with its engine
    # (the last reference used to die on an I/O thread, whose finalizer could not join itself).
    del engines, e, files
    gc.collect()
    assert not list(tmp_path.iterdir()), "swap directories outlive their engines"


def test_a_checkpoint_with_the_working_shards_in_files_resumes_bit_for_bit_and_loads_without_offload(
        tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    engines, (x, y) = _three_tiers(swap)
    for e in engines.values():
        e.train_step(x, y)
    engines["all"].save(tmp_path / "ck")
    fresh, _ = _three_tiers(swap)
    fresh["parameters"].load(tmp_path / "ck")   # into the other tier: the working shards are rewritten
    fresh["optimizer"].load(tmp_path / "ck")
    _same_states(engines["all"], fresh["parameters"])
    want = engines["all"].train_step(x, y)
    assert fresh["parameters"].train_step(x, y) == fresh["optimizer"].train_step(x, y) == want


def test_parameter_offload_outside_zero_3_under_mixed_precision_is_refused_with_what_works() -> None:
    with pytest.raises(ConfigError, match="zero=3"):
        fxspeed.Config(offload="parameters", zero=1, precision="bf16").check_supported()
    with pytest.raises(ConfigError, match="precision='bf16'"):
        fxspeed.Config(offload="all", zero=3).check_supported()
    with pytest.warns(ConfigWarning, match="memory_budget_gb.*offload='all'"):
        fxspeed.Config(offload="parameters", zero=3, precision="bf16", memory_budget_gb=4.0)


def _compile(tmp_path: Path | None, **cfg: object) -> fxspeed.Engine:
    model, batch = _gpt()
    if tmp_path is not None:
        cfg.setdefault("nvme_path", str(tmp_path))
    cfg.setdefault("offload", "optimizer")
    return fxspeed.compile(model, 1, fxspeed.Config(**cfg), example_inputs=batch)


@pytest.mark.parametrize("cfg, words", [
    (dict(offload_device="cpu", nvme_path=None), ["offload_device='cpu' on a CPU device", "nvme"]),
    (dict(nvme_path=None), ["nvme_path"]),
    (dict(nvme_path="/no/such/dir"), ["/no/such/dir", "does not exist"]),
])
def test_offload_settings_that_cannot_work_on_this_device_are_errors_that_say_what_works(
        tmp_path: Path, cfg: dict, words: list[str]) -> None:
    with pytest.raises((ConfigError, FxspeedError)) as e:
        _compile(tmp_path if "nvme_path" not in cfg else None, **cfg)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_sgd_unknown_offload_devices_and_empty_budgets_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="sgd"):
        fxspeed.Config(offload="optimizer", optimizer="sgd")
    with pytest.raises(ConfigError, match="offload_device"):
        fxspeed.Config(offload="optimizer", offload_device="disk")
    with pytest.raises(ConfigError, match="memory_budget_gb"):
        fxspeed.Config(offload="optimizer", memory_budget_gb=0)
    with pytest.warns(ConfigWarning, match="nvme_path"):
        fxspeed.Config(nvme_path="/tmp")  # offload='none': it would do nothing


def test_a_disk_without_room_is_an_error_before_training_and_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    # a small model's states in a unit that shows them (they read "0.00 GB")
    with pytest.raises(FxspeedError, match=r"need \d+\.\d\d [kM]B more and that filesystem has \d+\.\d\d [kMG]B free"):
        _compile(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_path_where_no_directory_can_be_made_is_an_error_naming_the_config_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """os.access says yes to root everywhere (/proc, /sys): the swap directory's own creation
    failed with a raw FileNotFoundError / PermissionError."""
    import tempfile

    def refused(*a: object, **k: object) -> str:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    with pytest.raises(FxspeedError, match=r"Config.nvme_path=.*cannot create a swap directory there .*Operation not"):
        _compile(tmp_path)


def test_a_disk_read_failing_mid_step_leaves_a_model_that_refuses_to_train_until_a_checkpoint_is_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The offloaded optimizer steps chunk by chunk: an I/O error at the third read had stepped
    the first chunks, and the bare OSError let the next train_step train on that mix."""
    from fxspeed.runtime import offload_io

    swap = tmp_path / "swap"
    swap.mkdir()
    plain, off, (x, y) = _pair(swap)
    assert off.optimizer.stats["chunks"] >= 3
    off.train_step(x, y)
    off.save(tmp_path / "ck")
    reads, real = [0], offload_io.SwapFile.read

    def flaky(self: offload_io.SwapFile, *a: object, **k: object) -> object:
        reads[0] += 1
        if reads[0] == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, *a, **k)

    monkeypatch.setattr(offload_io.SwapFile, "read", flaky)
    with pytest.raises(FxspeedError, match="failed in the optimizer step .*Input/output error.*engine.load"):
        off.train_step(x, y)
    monkeypatch.setattr(offload_io.SwapFile, "read", real)
    with pytest.raises(FxspeedError, match="partly stepped"):
        off.train_step(x, y)
    off.load(tmp_path / "ck")
    plain.train_step(x, y)
    assert off.train_step(x, y) == plain.train_step(x, y)
    _same_states(plain, off)


def test_the_plan_shows_the_moments_on_disk_and_only_the_staging_slots_in_memory(tmp_path: Path) -> None:
    model, batch = _gpt()
    n = sum(p.numel() for p in model.parameters())
    small = dict(bucket_mb=0.01)  # chunks of 20 KiB of moments
    plain = fxspeed.plan(model, 1, fxspeed.Config(**small), example_inputs=batch)
    off = fxspeed.plan(model, 1, fxspeed.Config(**small, offload="optimizer", nvme_path=str(tmp_path)),
                       example_inputs=batch)
    assert off.offloaded == {"disk": 8 * n}
    assert plain.memory()["optimizer_states"] == 8 * n
    # the three staging slots: chunks of 20971 bytes of moments in whole elements, page-aligned
    assert off.memory()["optimizer_states"] == 3 * 24576
    assert "off the device: disk" in off.summary()


def test_a_shard_of_a_few_mib_is_staged_through_about_a_quarter_of_its_states_not_all_of_them(
        tmp_path: Path) -> None:
    """At the default bucket_mb a chunk was two buckets' worth (50 MiB of moments): on a rank whose
    states are smaller than three of them, the staging slots held all the states and offloading
    them saved nothing. Chunks are now at most a twelfth of the states (not under 1 MiB)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=256))
    x = torch.randint(0, 256, (2, 16))
    states = 8 * sum(p.numel() for p in model.parameters())  # Adam's two fp32 moments: 26 MB
    cfg = dict(lr=1e-2, weight_decay=0.1)
    off = fxspeed.compile(copy.deepcopy(model), 1, fxspeed.Config(**cfg, offload="optimizer", nvme_path=str(tmp_path)),
                          example_inputs=(x, x))
    assert off.plan.offloaded == {"disk": states}
    planned = off.plan.memory()["optimizer_states"]
    assert 0.2 * states <= planned <= 0.3 * states  # was all of them
    opt = off.optimizer
    staging = sum(t.nbytes for t in opt._slots)
    assert len(opt._slots) == 3 and staging <= planned <= 1.05 * staging
    # under a memory budget the engine offloads at least the bytes the plan chose, less than a chunk
    # more; a chunk is whole 64-element runs of 2 or 3 fp32 sections (a flat ZeRO shard of another
    # size was cut short, and one chunk more went: 2 ranks, ZeRO-1, 9.69 MB moved for 8.61 planned)
    chunk = offload_chunk_bytes(off.config, states=states)
    assert chunk < 2 * off.config.bucket_mb * 2**20 and chunk % (64 * 4 * 2) == chunk % (64 * 4 * 3) == 0
    plain_peak = fxspeed.plan(model, 1, fxspeed.Config(**cfg), example_inputs=(x, x)).peak_memory()
    budget = (plain_peak + off.plan.peak_memory()) / 2 / 1e9
    part = fxspeed.compile(copy.deepcopy(model), 1, fxspeed.Config(**cfg, offload="optimizer", nvme_path=str(tmp_path),
                                                                   memory_budget_gb=budget), example_inputs=(x, x))
    assert 0 < part.plan.offloaded["disk"] <= part.optimizer.stats["offloaded_bytes"] < part.plan.offloaded["disk"] + chunk
    plain = fxspeed.compile(model, 1, fxspeed.Config(**cfg), example_inputs=(x, x))
    for step in range(2):
        xs = torch.roll(x, step, 1)
        assert plain.train_step(xs, x) == off.train_step(xs, x)
    _same_states(plain, off)


def test_a_pipeline_plan_keeps_each_positions_moments_on_disk_and_its_staging_slots_in_memory(tmp_path: Path) -> None:
    model, batch = _gpt()
    small = dict(bucket_mb=0.01, pipeline=2, microbatches=2)
    plain = fxspeed.plan(model, 2, fxspeed.Config(**small), example_inputs=batch)
    off = fxspeed.plan(model, 2, fxspeed.Config(**small, offload="optimizer", nvme_path=str(tmp_path)),
                       example_inputs=batch)
    slots = 3 * 24576  # page-aligned chunks of 20971 bytes of moments
    for rk_plain, rk_off in zip(plain.pipeline["ranks"], off.pipeline["ranks"]):
        states = rk_plain["phase_memory"]["step"]["optimizer_states"]
        assert rk_off["offloaded"] == states > slots
        for phase in ("step", "optimizer"):
            assert rk_off["phase_memory"][phase]["optimizer_states"] == slots
    assert off.offloaded == {"disk": off.pipeline["ranks"][0]["offloaded"]}
    assert off.memory(0)["total"] == plain.memory(0)["total"] - off.offloaded["disk"] + slots
    # on a CUDA device the slots are pinned host memory, as without a pipeline: the positions'
    # device memory holds none of them (they were counted there)
    h100 = fxspeed.devices("H100-80GB", 2)
    cuda = fxspeed.plan(model, h100, fxspeed.Config(**small, offload="optimizer", offload_device="nvme",
                                                    nvme_path=str(tmp_path)), example_inputs=batch)
    for rk in cuda.pipeline["ranks"]:
        assert rk["phase_memory"]["step"]["optimizer_states"] == rk["phase_memory"]["optimizer"]["optimizer_states"] == 0
    assert cuda.offloaded == {"disk": cuda.pipeline["ranks"][0]["offloaded"], "host": slots}
    # a budget no position meets: each position's note once (not the micro-batch plan's), kept
    # through the plan's JSON, which is what the engine warns with
    tight = fxspeed.plan(model, 2, fxspeed.Config(**small, offload="optimizer", nvme_path=str(tmp_path),
                                                  memory_budget_gb=1e-6), example_inputs=batch)
    said = sorted({rk["offload_note"] for rk in tight.pipeline["ranks"]})
    assert tight.over_budget == said and all("cannot be met" in n for n in said)
    assert [n for n in tight.notes if "memory_budget_gb" in n] == said
    assert fxspeed.Plan.from_json(tight.to_json()).over_budget == said
    assert not off.over_budget


def test_with_a_memory_budget_the_planner_offloads_only_what_does_not_fit_and_the_engine_follows(tmp_path: Path) -> None:
    model, batch = _gpt()
    states = 8 * sum(p.numel() for p in model.parameters())
    cfg = dict(bucket_mb=0.01, lr=1e-2)
    full = fxspeed.plan(model, 1, fxspeed.Config(**cfg), example_inputs=batch).peak_memory()
    budget = (full - states / 2) / 1e9  # half the states must go
    plan = fxspeed.plan(model, 1, fxspeed.Config(**cfg, offload="optimizer", nvme_path=str(tmp_path),
                                                 memory_budget_gb=budget), example_inputs=batch)
    assert states / 2 <= plan.offloaded["disk"] < states
    assert plan.peak_memory() <= budget * 1e9
    plain, off, (x, y) = _pair(tmp_path, memory_budget_gb=budget)
    st = off.optimizer.stats
    assert st["chunks"] > 0 and st["resident_chunks"] > 0 and st["offloaded_bytes"] >= plan.offloaded["disk"]
    for step in range(3):
        assert plain.train_step(torch.roll(x, step, 0), y) == off.train_step(torch.roll(x, step, 0), y)
    _same_states(plain, off)
    tight = fxspeed.plan(model, 1, fxspeed.Config(**cfg, offload="optimizer", nvme_path=str(tmp_path),
                                                  memory_budget_gb=1e-6), example_inputs=batch)
    assert tight.offloaded["disk"] == states and any("even with every optimizer state offloaded" in n for n in tight.notes)
    # a budget the plan cannot meet: the summary says so (it said "fits", the device's limit), the
    # engine warns (it ran silently), and where the staging (3 chunks of 2 x bucket_mb, at the
    # default 25 all of this model's states) is what holds the peak up, the note names a bucket_mb
    # that lowers it
    assert f"within memory_budget_gb={budget:g}" in plan.summary()
    assert "OVER memory_budget_gb=1e-06" in tight.summary() and "bucket_mb=" not in tight.notes[-1]
    at = dict(lr=1e-2, offload="optimizer", nvme_path=str(tmp_path), memory_budget_gb=1e-6)
    default = fxspeed.plan(model, 1, fxspeed.Config(**at), example_inputs=batch)
    said = re.search(r"try Config\.bucket_mb=([0-9.e+-]+) \(now 25", default.notes[-1])
    assert said, default.notes[-1]
    smaller = fxspeed.plan(model, 1, fxspeed.Config(**at, bucket_mb=float(said.group(1))), example_inputs=batch)
    assert smaller.peak_memory() < default.peak_memory()
    with pytest.warns(ConfigWarning, match=r"memory_budget_gb=1e-06 cannot be met.*zero=3 over more ranks"):
        engine = fxspeed.compile(copy.deepcopy(model), 1, fxspeed.Config(**cfg, offload="optimizer", nvme_path=str(tmp_path),
                                                                         memory_budget_gb=1e-6), example_inputs=batch)
        engine.train_step(x, y)


def test_a_swap_directory_left_by_a_killed_process_is_removed_by_the_next_one(tmp_path: Path) -> None:
    import socket

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    stale = tmp_path / f"fxspeed-swap-{host}-pid{gone.stdout.strip()}-rank0-abc"
    alive = tmp_path / f"fxspeed-swap-{host}-pid{os.getpid()}-rank1-abc"   # a live process's: kept
    other = tmp_path / f"fxspeed-swap-otherhost-pid{gone.stdout.strip()}-rank0-abc"  # another host's: kept
    for d in (stale, alive, other):
        d.mkdir()
        (d / "states.bin").write_bytes(b"x")
    engine = _compile(tmp_path)
    assert not stale.exists() and alive.exists() and other.exists()
    del engine


def test_every_offload_tier_is_accepted_under_tensor_parallelism():
    # (their parity: the tensor-parallel launches' gpt_dp_bf16_offload and gpt_offload_tiers cases)
    fxspeed.Config(tensor=2, offload="optimizer", nvme_path="/tmp").check_supported()
    fxspeed.Config(tensor=2, zero=3, precision="bf16", offload="all", nvme_path="/tmp").check_supported()
    with pytest.raises(ConfigError, match="zero=3"):
        fxspeed.Config(tensor=2, zero=1, precision="bf16", offload="parameters", nvme_path="/tmp").check_supported()


def test_in_backward_the_plan_counts_the_working_shards_of_the_buckets_in_use_not_four_buckets_of_them(
        tmp_path: Path) -> None:
    """Parameter offload: a fetch's buffer dies with its gather and the next bucket's is read ahead;
    the two written back after the step are read again by forward (runtime/offloaded_parameters.py).
    The step's peak, late in backward, had counted four buckets' shards on top of those in use."""
    from fxspeed.planner.estimate import gradient_buckets, trace_costs
    from fxspeed.devices import normalize_devices

    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=256)
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.randint(0, 256, (2, 8))
    config = fxspeed.Config(zero=3, precision="bf16", optimizer="adam", offload="all", nvme_path=str(tmp_path),
                            bucket_mb=0.5)
    plan = fxspeed.plan(model, 2, config, example_inputs=(x, x))
    costs, _, _ = trace_costs(model, (x, x), {}, config=config, devices=normalize_devices(2))
    sizes = gradient_buckets(costs, config.bucket_mb * 2**20)
    assert len(sizes) >= 6
    shard = max(sizes) / 2
    # the bucket being computed and the one read ahead, halved by ZeRO-3 (before: 4 x shard)
    assert plan.phase_memory["step"]["parameters"] <= 2 * shard + 1
    # after the step the shards go back through the files: two writes in flight and one filling
    assert plan.phase_memory["optimizer"]["parameters"] >= 3 * shard


@pytest.mark.parametrize("cfg", [dict(offload="optimizer"), dict(offload="optimizer", precision="bf16", zero=1),
                                 dict(offload="parameters", precision="bf16", zero=3)])
def test_a_model_given_as_bf16_parameters_is_refused_under_offload_with_the_fp32_recipe(
        tmp_path: Path, cfg: dict) -> None:
    """The offloaded optimizer steps fp32 tensors (or bf16 working copies of fp32 masters it made),
    parameter offload moves working copies of fp32 masters: bf16 Parameters reached them as they
    were and failed with an internal "please report this" (or "ZeRO-3 without master weights")."""
    model, batch = _gpt()
    with pytest.raises(ConfigError, match=r"wte.weight \(bfloat16\).*model.float\(\).*precision='bf16'"):
        fxspeed.compile(model.to(torch.bfloat16), 1, fxspeed.Config(**cfg, nvme_path=str(tmp_path)),
                        example_inputs=batch)
    assert list(tmp_path.iterdir()) == []


def test_the_offloaded_optimizers_state_dict_loads_into_torchs_fused_adamw_and_trains_on_bit_for_bit(
        tmp_path: Path) -> None:
    """engine.optimizer_state_dict() of a one-process fp32 engine loads into the same layout with or
    without offload. The offloaded optimizer's groups lacked torch's flags: loaded into an
    in-memory engine, AdamW set fused=None (its foreach kernel) and rounded differently (1.9e-5
    apart after 3 steps); amsgrad/maximize from a torch checkpoint were ignored silently."""
    plain, off, (x, y) = _pair(tmp_path)
    off.train_step(x, y)
    saved = off.optimizer_state_dict()["optimizer"]
    assert {k: v for k, v in saved["param_groups"][0].items() if k != "params"} == \
        {k: v for k, v in plain.optimizer.state_dict()["param_groups"][0].items() if k != "params"}
    plain.load_state_dict(off.state_dict())  # (plain has not stepped: it takes off's place)
    plain.optimizer.load_state_dict(saved)
    assert plain.optimizer.param_groups[0]["fused"] is True
    for step in range(1, 3):
        xs = torch.roll(x, step, 0)
        assert plain.train_step(xs, y) == off.train_step(xs, y)
    _same_states(plain, off)
    saved["param_groups"][0]["amsgrad"] = True
    with pytest.raises(FxspeedError, match="amsgrad"):
        off.optimizer.load_state_dict(saved)
    # the moments are not in optimizer.state (the step counters are): reading one says where they are
    p = off.optimizer.param_groups[0]["params"][0]
    with pytest.raises(KeyError, match=r"exp_avg.*offload file.*state_dict\(\)"):
        off.optimizer.state[p]["exp_avg"]


def test_a_relative_nvme_path_is_resolved_at_compile_and_its_swap_directory_removed_after_a_chdir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.11's mkdtemp keeps a relative directory relative: after the user's os.chdir the
    engine removed 'swap/fxspeed-swap-...' under the new cwd, and left its file behind."""
    (tmp_path / "swap").mkdir()
    monkeypatch.chdir(tmp_path)
    engine = _compile(None, nvme_path="swap")
    monkeypatch.chdir(tmp_path.parent)
    engine.train_step(*_gpt()[1])
    del engine
    gc.collect()
    assert list((tmp_path / "swap").iterdir()) == []
