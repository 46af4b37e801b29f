"""The host tier of optimizer and parameter offload (runtime/host_tier.py): on a CUDA device
the optimizer states (and fp32 masters) live in pinned host memory and are stepped there, the
ZeRO-3 working shards live there and are copied to the device ahead of their gathers; with
offload_device="nvme" the files tier runs through the same staging.

Here the tier's logic runs on the CPU as a device apart from the host (FXSPEED_HOST_TIER_ON_CPU=1:
copies between CPU tensors instead of over PCIe); the pinned path itself runs in
tests/test_cuda.py on a GPU. Parity is bit for bit: the update is the same fused CPU Adam over
the same values, copied in and out exactly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxspeed
from fxspeed.errors import ConfigError
from fxspeed.planner.estimate import staging_held
from fxspeed.runtime.host_tier import ENV_ON_CPU, DeviceLink
from fxspeed.runtime.offloaded_optimizer import OffloadedAdam
from tests.multiprocess import check_swap_worker
from tests.test_offload import _gpt, _odd_tensors, _same_gradients, _same_states

KW = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


@pytest.fixture
def host_tier_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_ON_CPU, "1")


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_the_host_tier_steps_device_tensors_bit_for_bit_like_torchs_fused_adamw_bucket_by_bucket(
        tmp_path: Path, tier: str) -> None:
    """The optimizer's tensors are the device's: each chunk's weights and gradients are staged in
    host buffers, stepped there and copied back; the moments stay in host memory ("host") or in
    the swap file ("nvme"). Stepped a group of tensors at a time (as the program steps gradient
    buckets inside backward) and all at once."""
    ours, ref = _odd_tensors(), _odd_tensors()
    link = DeviceLink(torch.device("cpu"))
    opt = OffloadedAdam(ours, decoupled=True, swap_root=tmp_path if tier == "nvme" else None, name="t",
                        chunk_bytes=4096, chunk_starts=(0, 2, 4), link=link, **KW)
    torch_opt = torch.optim.AdamW(ref, fused=True, **KW)
    assert (opt.stats["resident_chunks"], opt.stats["chunks"] > 2) == ((7, False) if tier == "host" else (0, True))
    for step in range(4):
        _same_gradients(ours, ref, step)
        opt.prefetch()
        if step % 2:
            opt.step()
        else:
            for group in ([0, 1], [2, 3], [4]):
                opt.step(only=[ours[j] for j in group])
        torch_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, ref)), f"step {step}"
    n = sum(p.numel() for p in ours)
    # every step: the weights and gradients in, the weights out (4 bytes each)
    assert link.stats["to_host_bytes"] == 4 * 2 * 4 * n and link.stats["to_device_bytes"] == 4 * 4 * n
    full = opt.full_state()
    assert all(torch.equal(full[a][k], torch_opt.state[b][k]) for a, b in zip(ours, ref)
               for k in ("exp_avg", "exp_avg_sq", "step"))
    again = OffloadedAdam(_odd_tensors(), decoupled=True, swap_root=None, name="u", chunk_bytes=4096, link=link, **KW)
    again.load_state_dict(opt.state_dict())
    assert all(torch.equal(a[k], b[k]) for a, b in zip(again.full_state().values(), full.values()) for k in b)
    opt.close()
    assert list(tmp_path.iterdir()) == []


def _engine(model: nn.Module, batch: tuple, swap: Path | None = None, **cfg: object) -> fxspeed.Engine:
    base = dict(lr=1e-2, weight_decay=0.1, bucket_mb=0.004)
    if cfg.get("offload_device") == "nvme":
        cfg["nvme_path"] = str(swap)
    return fxspeed.compile(model, 1, fxspeed.Config(**base, **cfg), example_inputs=batch)


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_fp32_training_with_the_optimizer_on_the_host_equals_training_without_offload_bit_for_bit(
        tmp_path: Path, host_tier_on_cpu: None, where: str) -> None:
    """One replica in fp32 steps at the end of the step (no buckets to step inside backward:
    tests/workers/offload_host_worker.py does on two ranks), every tensor through the host."""
    model, (x, y) = _gpt()
    plain = _engine(copy.deepcopy(model), (x, y))
    off = _engine(model, (x, y), tmp_path, offload="optimizer", offload_device=where)
    assert off.optimizer.stats["host_tier"] and off.optimizer.stats["masters"] is False
    assert (off.optimizer.stats["chunks"] == 0) == (where == "cpu")
    for step in range(3):
        xs = torch.roll(x, step, 0)
        assert plain.train_step(xs, y) == off.train_step(xs, y)
    assert off._link.stats["to_device_bytes"] == 3 * 4 * sum(p.numel() for p in off.model.parameters())
    _same_states(plain, off)


def test_a_checkpoint_written_from_the_host_tier_loads_without_offload_and_back(
        tmp_path: Path, host_tier_on_cpu: None) -> None:
    model, (x, y) = _gpt()
    plain = _engine(copy.deepcopy(model), (x, y), grad_clip=0.5)
    off = _engine(copy.deepcopy(model), (x, y), offload="optimizer", offload_device="cpu", grad_clip=0.5)
    for e in (plain, off):
        e.train_step(x, y)
    off.save(tmp_path / "ck_off")
    plain.save(tmp_path / "ck_plain")
    fresh_plain = _engine(copy.deepcopy(model), (x, y), grad_clip=0.5)
    fresh_off = _engine(copy.deepcopy(model), (x, y), offload="optimizer", offload_device="cpu", grad_clip=0.5)
    fresh_plain.load(tmp_path / "ck_off")   # host tier -> in memory
    fresh_off.load(tmp_path / "ck_plain")   # in memory -> host tier (the weights are read from the device)
    _same_states(fresh_plain, fresh_off)
    _same_states(plain, fresh_off)
    assert fresh_plain.train_step(x, y) == fresh_off.train_step(x, y) == plain.train_step(x, y)


def test_under_bf16_zero_3_masters_moments_and_working_shards_on_the_host_train_like_the_files_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference is the CPU's files tier (masters, moments and working shards in files, no
    host tier; one process keeps bf16 working copies only with offload, so plain bf16 computes
    another program): the optimizer on the host, stepping each reduced bucket inside backward; the
    working shards on the host, copied to the device ahead of each gather; every tier in files
    through the host tier's staging. A checkpoint of the last resumes in the files tier."""
    model, (x, y) = _gpt()
    n = sum(p.numel() for p in model.parameters())
    monkeypatch.setenv(ENV_ON_CPU, "0")
    reference = _engine(copy.deepcopy(model), (x, y), tmp_path, offload="all", offload_device="nvme", zero=3,
                        precision="bf16")
    monkeypatch.setenv(ENV_ON_CPU, "1")
    engines = {name: _engine(copy.deepcopy(model), (x, y), tmp_path, offload=kind, offload_device=where, zero=3,
                             precision="bf16")
               for name, (kind, where) in {"optimizer": ("optimizer", "cpu"), "parameters": ("parameters", "cpu"),
                                           "all": ("all", "nvme")}.items()}
    assert reference._link is None and all(e._link is not None for e in engines.values())
    for step in range(3):
        xs = torch.roll(x, step, 0)
        want = reference.train_step(xs, y)
        assert {name: e.train_step(xs, y) for name, e in engines.items()} == dict.fromkeys(engines, want)
    for e in engines.values():
        _same_states(reference, e)
    # the optimizer tier steps each reduced bucket inside backward, on the host
    assert engines["optimizer"]._in_backward.calls == 3 * len(engines["optimizer"]._flat.buckets)
    opt = engines["optimizer"].optimizer
    assert opt.stats["masters"] and opt.stats["host_bytes"] >= 12 * n and opt.swap is None
    files = engines["parameters"]._flat.files
    assert files.host is not None and files.swap is None and files.stats["host_bytes"] >= 2 * n
    assert all(t.untyped_storage().nbytes() == 0 for t in engines["parameters"]._flat.work_shards)
    assert files.stats["fetches"] >= 3 * 2 * len(engines["parameters"]._flat.buckets)
    assert files.stats["waited_reads"] <= 1  # only the first step's first fetch had nothing ahead of it
    # a checkpoint of the host tier resumes in the files tier bit for bit
    engines["all"].save(tmp_path / "ck")
    monkeypatch.setenv(ENV_ON_CPU, "0")
    fresh = _engine(copy.deepcopy(model), (x, y), tmp_path, offload="all", offload_device="nvme", zero=3,
                    precision="bf16")
    fresh.load(tmp_path / "ck")
    _same_states(engines["all"], fresh)
    assert fresh.train_step(x, y) == engines["all"].train_step(x, y)


@pytest.mark.slow
def test_optimizer_and_parameter_offload_on_the_host_tier_of_two_ranks_equal_no_offload(
        tmp_path: Path) -> None:
    check_swap_worker("tests.workers.offload_host_worker", tmp_path)


def test_host_offload_on_a_cpu_device_and_files_without_a_path_are_errors_that_name_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch = _gpt()
    monkeypatch.delenv(ENV_ON_CPU, raising=False)
    with pytest.raises(ConfigError, match="offload_device='cpu' on a CPU device moves nothing"):
        _engine(copy.deepcopy(model), batch, offload="optimizer", offload_device="cpu")
    monkeypatch.setenv(ENV_ON_CPU, "1")
    with pytest.raises(ConfigError, match="Config.nvme_path"):
        fxspeed.compile(copy.deepcopy(model), 1, fxspeed.Config(offload="optimizer", offload_device="nvme"),
                        example_inputs=batch)


def test_the_plan_of_a_cuda_device_shows_the_states_and_their_staging_in_host_memory_and_no_disk_time(
        tmp_path: Path) -> None:
    """Chunks of 20 KiB of moments (bucket_mb=0.01), so the staging slots are fewer bytes than the states."""
    model, _ = _gpt()
    ids = torch.zeros(2, 16, dtype=torch.long)
    gpus = fxspeed.devices("H100-80GB", 1)
    host = fxspeed.plan(model, gpus, fxspeed.Config(offload="optimizer", offload_device="cpu", bucket_mb=0.01),
                        example_inputs=(ids, ids))
    files = fxspeed.plan(model, gpus, fxspeed.Config(offload="optimizer", offload_device="nvme", bucket_mb=0.01,
                                                     nvme_path=str(tmp_path)), example_inputs=(ids, ids))
    auto = fxspeed.plan(model, gpus, fxspeed.Config(offload="optimizer", bucket_mb=0.01), example_inputs=(ids, ids))
    n = sum(p.numel() for p in model.parameters())
    # the chunks' staging slots are pinned host memory, not the GPU's: counted with the host's bytes
    staging = files.offloaded["host"]
    assert 0 < staging < 8 * n
    assert host.offloaded == auto.offloaded == {"host": 8 * n + staging}
    assert files.offloaded == {"disk": 8 * n, "host": staging}
    assert host.memory()["optimizer_states"] == files.memory()["optimizer_states"] == 0
    assert "off the device: host" in host.summary() and "disk" not in host.time
    staged = fxspeed.plan(model, 1, fxspeed.Config(offload="optimizer", nvme_path=str(tmp_path), bucket_mb=0.01),
                          example_inputs=(ids, ids))  # on the CPU the staging is the device's memory
    assert staged.memory()["optimizer_states"] == staging and "host" not in staged.offloaded


def test_a_pipeline_plan_of_a_cuda_device_keeps_the_offloaded_states_in_host_memory(tmp_path: Path) -> None:
    model, _ = _gpt()
    ids = torch.zeros(2, 16, dtype=torch.long)
    cfg = dict(pipeline=2, microbatches=2, offload="optimizer")
    gpus = fxspeed.plan(model, fxspeed.devices("H100-80GB", 2), fxspeed.Config(**cfg), example_inputs=(ids, ids))
    files = fxspeed.plan(model, fxspeed.devices("H100-80GB", 2),
                         fxspeed.Config(**cfg, offload_device="nvme", nvme_path=str(tmp_path)), example_inputs=(ids, ids))
    moved = gpus.pipeline["ranks"][0]["offloaded"]
    # the staging slots are pinned host memory too, as the plan without a pipeline says
    staging = staging_held(fxspeed.Config(**cfg), moved, moved)
    assert moved > 0 and gpus.offloaded == {"host": moved + staging}
    assert files.offloaded == {"disk": moved, "host": staging}
    for rk in gpus.pipeline["ranks"]:
        assert rk["phase_memory"]["step"]["optimizer_states"] == 0


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_partial_offload_keeps_the_remaining_chunks_on_the_device_and_steps_them_there_bit_for_bit(
        tmp_path: Path, tier: str) -> None:
    """With `offload_bytes` (the plan's choice under Config.memory_budget_gb) only the first chunks
    leave the device (pinned host memory, or the file); the others keep their states beside their
    tensors and are stepped there without staging, so the device holds what the plan counted."""
    ours, ref = _odd_tensors(), _odd_tensors()
    link = DeviceLink(torch.device("cpu"))
    opt = OffloadedAdam(ours, decoupled=True, swap_root=tmp_path if tier == "nvme" else None, name="p",
                        chunk_bytes=4096, chunk_starts=(0, 2, 4), link=link, offload_bytes=6000, **KW)
    torch_opt = torch.optim.AdamW(ref, fused=True, **KW)
    st = opt.stats
    off_device = st["host_bytes"] if tier == "host" else st["offloaded_bytes"]
    assert 6000 <= off_device < 6000 + 4096 and st["device_bytes"] > 0
    assert off_device + st["device_bytes"] == 8 * sum(p.numel() for p in ours)
    for step in range(3):
        _same_gradients(ours, ref, step)
        if step % 2:
            opt.step()
        else:
            for group in ([0, 1], [2, 3], [4]):
                opt.step(only=[ours[j] for j in group])
        torch_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, ref)), f"step {step}"
    # only the offloaded chunks' tensors travel: fewer bytes than the whole-host test's 8 per element
    assert 0 < link.stats["to_host_bytes"] < 3 * 8 * sum(p.numel() for p in ours)
    full = opt.full_state()
    assert all(torch.equal(full[a][k], torch_opt.state[b][k]) for a, b in zip(ours, ref)
               for k in ("exp_avg", "exp_avg_sq", "step"))
    opt.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_with_a_memory_budget_the_host_tier_offloads_what_the_plan_chose_and_trains_like_no_budget(
        tmp_path: Path, host_tier_on_cpu: None, precision: str) -> None:
    """The plan offloads half the states to fit the budget; the engine puts that much in host
    memory and keeps the rest on the device. Same losses and states as offloading everything
    (bf16: masters stepped on the device and on the host alike)."""
    model, (x, y) = _gpt()
    cfg = dict(lr=1e-2, weight_decay=0.1, bucket_mb=0.004, precision=precision)
    full = fxspeed.plan(model, 1, fxspeed.Config(**cfg), example_inputs=(x, y)).peak_memory()
    everything = _engine(copy.deepcopy(model), (x, y), offload="optimizer", offload_device="cpu", precision=precision)
    states = everything.plan.offloaded_optimizer
    budget = (full - states / 2) / 1e9
    part = _engine(copy.deepcopy(model), (x, y), offload="optimizer", offload_device="cpu", precision=precision,
                   memory_budget_gb=budget)
    planned = part.plan.offloaded_optimizer
    st = part.optimizer.stats
    assert states / 2 <= planned < states and planned <= st["host_bytes"] < states
    assert st["host_bytes"] + st["device_bytes"] == states
    for step in range(3):
        xs = torch.roll(x, step, 0)
        assert everything.train_step(xs, y) == part.train_step(xs, y)
    _same_states(everything, part)
