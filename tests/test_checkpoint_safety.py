"""Checkpoint safety (issue 12, items 10-12): loading never runs code from the files, corrupted
or truncated files are refused with an error naming the file, a checkpoint of another model is
refused before anything is touched, a save killed at any point leaves the previous checkpoint
loadable, and a collective called on one rank only fails fast with a clear error."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fxspeed
from fxspeed.errors import FxspeedError
from fxspeed import mesh
from fxspeed.runtime import checkpoint as ckpt
from fxspeed.runtime.checkpoint import CanonicalState, load_checkpoint, save_checkpoint
from tests.multiprocess import rank_env, run_ranks
from tests.workers.checkpoint_kill_worker import kill_state

ROOT = Path(__file__).resolve().parents[1]


class RunsCode:
    """Unpickling it runs a shell command that creates `path` (what an attacker would plant)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.path}",)


def state() -> CanonicalState:
    g = torch.Generator().manual_seed(0)
    model = {"a.weight": torch.randn(8, 4, generator=g), "a.bias": torch.randn(8, generator=g),
             "b.weight": torch.randn(2, 8, generator=g), "count": torch.tensor(5)}
    optimizer = {n: {"exp_avg": torch.randn(t.shape, generator=g), "step": torch.tensor(3.0)}
                 for n, t in model.items() if t.is_floating_point()}
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
                                              lambda s: 1.0 / (s + 1))
    extra = {"lr_scheduler": sched.state_dict(), "loss_scaler": {"scale": 65536.0, "clean_steps": 3, "skipped": 1},
             "stats": {"steps": 3, "compiles": 1, "skipped_steps": 0, "step_s": 0.25},
             "rng": [torch.get_rng_state(), torch.Generator().manual_seed(1).get_state()],
             "python_random": random.Random(3).getstate(), "mesh": {"dp": 2, "pp": 1, "tp": 1}, "zero": 3}
    return CanonicalState(model=model, optimizer=optimizer, extra=extra)


def saved(tmp_path: Path, name: str = "ck") -> Path:
    save_checkpoint(tmp_path / name, state())
    return tmp_path / name


def rewrite_marker(directory: Path, refresh: list[str] | None = None, version1: bool = False) -> None:
    """What an attacker (or a careless copy) can also do: make the marker agree with the files."""
    marker = json.loads((directory / "COMPLETE").read_text())
    if version1:
        marker["version"] = 1
        marker.pop("files", None)
    for f in refresh or []:
        if "files" in marker:
            marker["files"][f] = ckpt._digest(str(directory / f))
    (directory / "COMPLETE").write_text(json.dumps(marker))


def load_refused(directory: Path, ran: Path, pattern: str) -> None:
    """Loading `directory` raises FxspeedError matching `pattern`, and `ran` was not created."""
    try:
        load_checkpoint(directory)
        error = "no error"
    except FxspeedError as e:
        error = str(e)
    assert not ran.exists(), "loading the checkpoint ran the planted code"
    assert re.search(pattern, error), error


def assert_equal(got: CanonicalState, want: CanonicalState) -> None:
    assert set(got.model) == set(want.model) and set(got.optimizer) == set(want.optimizer)
    for n, t in want.model.items():
        assert got.model[n].dtype == t.dtype and torch.equal(got.model[n], t), n
    for n, slots in want.optimizer.items():
        for s, t in slots.items():
            assert torch.equal(got.optimizer[n][s], t), (n, s)


# --- A: loading runs no code ----------------------------------------------------------------------


def test_the_extra_state_fxspeed_stores_round_trips_through_a_weights_only_load(tmp_path: Path) -> None:
    want = state()
    got = load_checkpoint(saved(tmp_path))
    assert_equal(got, want)
    assert got.extra["lr_scheduler"] == want.extra["lr_scheduler"]
    assert got.extra["python_random"] == want.extra["python_random"]
    assert all(torch.equal(a, b) for a, b in zip(got.extra["rng"], want.extra["rng"]))
    assert {k: got.extra[k] for k in ("loss_scaler", "stats", "mesh", "zero")} == \
           {k: want.extra[k] for k in ("loss_scaler", "stats", "mesh", "zero")}


def test_saving_extra_state_a_safe_load_would_refuse_fails_before_writing(tmp_path: Path) -> None:
    bad = state()
    bad.extra["obj"] = RunsCode(tmp_path / "never")
    with pytest.raises(FxspeedError, match=r"holds objects a safe load refuses .*posix\.system|system"):
        save_checkpoint(tmp_path / "ck", bad)
    assert not (tmp_path / "ck").exists() and not (tmp_path / "never").exists()


@pytest.mark.parametrize("version1", [False, True], ids=["checksummed", "version1-marker"])
def test_an_extra_pt_whose_unpickling_runs_code_is_refused_and_nothing_runs(tmp_path: Path, version1: bool) -> None:
    ck, ran = saved(tmp_path), tmp_path / "ran"
    torch.save({"lr_scheduler": RunsCode(ran)}, ck / "extra.pt")
    rewrite_marker(ck, refresh=[] if version1 else ["extra.pt"], version1=version1)
    load_refused(ck, ran, r"refusing to load .*extra\.pt.*could run code")


@pytest.mark.parametrize("version1", [False, True], ids=["checksummed", "version1-marker"])
def test_a_dcp_metadata_whose_unpickling_runs_code_is_refused_and_nothing_runs(tmp_path: Path, version1: bool) -> None:
    ck, ran = saved(tmp_path), tmp_path / "ran"
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(RunsCode(ran), f)
    rewrite_marker(ck, refresh=[] if version1 else [".metadata"], version1=version1)
    load_refused(ck, ran, r"refusing to load .*\.metadata.*global posix\.system.*could run code")
    with pytest.raises(FxspeedError, match=r"refusing to load .*\.metadata"):
        ckpt.validate_checkpoint(ck, state().model)
    assert not ran.exists(), "validating the checkpoint ran the planted code"


def test_planted_code_nested_inside_real_dcp_metadata_is_refused(tmp_path: Path) -> None:
    ck, ran = saved(tmp_path), tmp_path / "ran"
    with open(ck / ".metadata", "rb") as f:
        meta = pickle.load(f)  # the file fxspeed itself just wrote
    meta.storage_meta.modules = [RunsCode(ran)]  # a valid Metadata carrying a payload
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    rewrite_marker(ck, refresh=[".metadata"])
    load_refused(ck, ran, r"\.metadata.*posix\.system")


# --- B: corruption is detected and names the file ---------------------------------------------------


def test_flipped_bytes_in_a_tensor_file_are_refused_naming_the_file(tmp_path: Path) -> None:
    ck = saved(tmp_path)
    (data,) = [p for p in ck.iterdir() if p.suffix == ".distcp"]
    raw = bytearray(data.read_bytes())
    at = raw.find(state().model["a.weight"].numpy().tobytes())  # the tensor's own bytes: no parser notices
    assert at > 0
    raw[at + 17] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(FxspeedError, match=rf"is corrupted: .*{data.name}.*crc32"):
        load_checkpoint(ck)


@pytest.mark.parametrize("name", [".metadata", "extra.pt", "__0_0.distcp"])
@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_an_empty_or_truncated_file_is_refused_naming_it(tmp_path: Path, name: str, how: str) -> None:
    ck = saved(tmp_path)
    raw = (ck / name).read_bytes()
    (ck / name).write_bytes(b"" if how == "empty" else raw[: len(raw) // 2])
    with pytest.raises(FxspeedError, match=rf"corrupted: .*{name}.* bytes"):
        load_checkpoint(ck)


@pytest.mark.parametrize("name", [".metadata", "extra.pt"])
def test_without_checksums_an_empty_or_garbage_file_still_names_it(tmp_path: Path, name: str) -> None:
    for i, content in enumerate((b"", b"\x80\x04garbage")):
        ck = saved(tmp_path, f"ck{i}")
        rewrite_marker(ck, version1=True)  # a version-1 checkpoint: no checksums to compare
        (ck / name).write_bytes(content)
        with pytest.raises(FxspeedError, match=rf"cannot read .*{name}"):
            load_checkpoint(ck)


def test_a_corrupted_marker_names_it(tmp_path: Path) -> None:
    ck = saved(tmp_path)
    (ck / "COMPLETE").write_bytes(b"{\x00garbage")
    with pytest.raises(FxspeedError, match="unreadable COMPLETE marker.*corrupted"):
        load_checkpoint(ck)


# --- C: a checkpoint of another model is refused before anything is read ------------------------


def test_a_checkpoint_of_another_model_is_refused_listing_every_mismatch(tmp_path: Path) -> None:
    ck = saved(tmp_path)
    expect = {"a.weight": (8, 5), "a.bias": torch.zeros(8), "c.weight": (2, 8), "c.bias": (2,), "count": ()}
    msg = r"(?s)does not match the model \(2 in the model.*1 in the checkpoint.*1 with another shape"
    with pytest.raises(FxspeedError, match=msg) as info:
        ckpt.validate_checkpoint(ck, expect)
    text = str(info.value)
    assert "c.bias, c.weight" in text and "b.weight" in text and "a.weight [8, 4] in the checkpoint, [8, 5]" in text
    with pytest.raises(FxspeedError, match=msg):
        load_checkpoint(ck, expect=expect)
    ckpt.validate_checkpoint(ck, state().model)  # the model it came from passes
    assert_equal(load_checkpoint(ck, expect=state().model), state())
    with pytest.raises(FxspeedError, match=r"another dtype \(1\).*count torch.int64 in the checkpoint, torch.int32"):
        ckpt.validate_checkpoint(ck, {**state().model, "count": torch.tensor(1, dtype=torch.int32)}, check_dtypes=True)


def test_a_long_mismatch_list_is_cut_to_the_first_few_and_counted(tmp_path: Path) -> None:
    wide = CanonicalState(model={f"h.{i}.weight": torch.zeros(4, 4) for i in range(12)})
    save_checkpoint(tmp_path / "ck", wide)
    with pytest.raises(FxspeedError, match=r"with another shape \(12\): .*\.\.\. 7 more"):
        ckpt.validate_checkpoint(tmp_path / "ck", {f"h.{i}.weight": (4, 8) for i in range(12)})


class MLP(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width if i else 8, width) for i in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return torch.nn.functional.mse_loss(self.head(x).squeeze(-1), y)


def _mlp_engine(width: int, depth: int, seed: int) -> fxspeed.Engine:
    torch.manual_seed(seed)
    x, y = torch.randn(4, 8), torch.randn(4)
    engine = fxspeed.compile(MLP(width, depth), 1, fxspeed.Config(lr=1e-2), example_inputs=(x, y))
    engine.train_step(x, y)
    return engine


@pytest.mark.parametrize("width,depth", [(16, 2), (8, 3), (8, 1)], ids=["wider", "deeper", "shallower"])
def test_engine_load_of_another_models_checkpoint_changes_no_parameter_and_lists_the_mismatches(
        tmp_path: Path, width: int, depth: int) -> None:
    """Needs Engine.load to pass `expect=` to load_checkpoint (see the report of this change)."""
    _mlp_engine(8, 2, seed=0).save(tmp_path / "ck")
    other = _mlp_engine(width, depth, seed=1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    opt_before = {k: v.clone() for k, v in other.optimizer.state_dict()["state"].get(0, {}).items()}
    with pytest.raises(FxspeedError, match="does not match the model") as info:
        other.load(tmp_path / "ck")
    text = str(info.value)
    if width != 8:
        assert "layers.0.weight [8, 8] in the checkpoint, [16, 8] in the model" in text, text
    elif depth == 3:
        assert "missing from the checkpoint (2): layers.2.bias, layers.2.weight" in text, text
    else:
        assert "not in the model (2): layers.1.bias, layers.1.weight" in text, text
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was changed by a load that failed"
    for k, v in other.optimizer.state_dict()["state"].get(0, {}).items():
        assert torch.equal(v, opt_before[k]), f"optimizer state {k} was changed by a load that failed"


# --- D: a save killed mid-way leaves the previous checkpoint --------------------------------------


def _save_and_kill(tmp_path: Path, at: str, *extra: str) -> int:
    """Save kill_state(1) to tmp_path/ck, then run a process saving kill_state(2) there and SIGKILL
    it at `at`; returns its exit code (-SIGKILL, or 0 when it never reached `at`)."""
    target, ready = tmp_path / "ck", tmp_path / "ready"
    save_checkpoint(target, kill_state(1))
    env = rank_env()
    proc = subprocess.Popen([sys.executable, "-m", "tests.workers.checkpoint_kill_worker", "--ckpt", str(target),
                             "--ready", str(ready), "--at", at, *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            assert proc.returncode == 0, err[-3000:]
            return 0
        assert time.monotonic() < deadline, "the saving process never reached the kill point"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return proc.returncode


@pytest.mark.parametrize("at", ["tensors", "marker", "swap", "aside"])
def test_a_save_killed_mid_way_leaves_a_checkpoint_that_loads_whole(tmp_path: Path, at: str) -> None:
    target = tmp_path / "ck"
    rc = _save_and_kill(tmp_path, at)
    # Killed before the swap: the previous checkpoint; after it: the new one, complete. Never a
    # mix, and never nothing: on Linux the old directory is never moved aside ("aside" is not reached).
    want = kill_state(1) if at in ("tensors", "marker") else kill_state(2)
    assert (rc == 0) == (at == "aside"), rc
    got = load_checkpoint(target)
    assert_equal(got, want)
    assert got.extra == want.extra
    if at in ("tensors", "marker"):
        assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name], "the killed save left its temporary directory"
    save_checkpoint(target, kill_state(3))  # the next save clears the leftovers
    assert_equal(load_checkpoint(target), kill_state(3))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "ready") == ["ck"]


def test_without_an_atomic_swap_a_save_killed_between_its_renames_names_the_intact_previous_checkpoint(
        tmp_path: Path) -> None:
    target = tmp_path / "ck"
    _save_and_kill(tmp_path, "aside", "--no-exchange")
    with pytest.raises(FxspeedError, match=r"the previous checkpoint is intact at .*ck\.old-.*rename it to"):
        load_checkpoint(target)
    (old,) = [p for p in tmp_path.iterdir() if ".old-" in p.name]
    save_checkpoint(tmp_path / "ck", kill_state(3))  # a later save does not delete the only intact copy
    assert old.exists()
    assert_equal(load_checkpoint(old), kill_state(1))


# --- E: a collective called on one rank only --------------------------------------------------------


def test_expect_all_ranks_costs_nothing_without_a_process_group() -> None:
    t0 = time.perf_counter()
    for _ in range(1000):
        mesh.expect_all_ranks("engine.state_dict()")
    assert time.perf_counter() - t0 < 0.05


def _run(*args: str, timeout: int = 240) -> None:
    cmd = [sys.executable, "-m", "fxspeed", "run", "-n", "2", "-m", "tests.workers.expect_all_ranks_worker", *args]
    env = rank_env()
    proc = run_ranks(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_a_collective_called_on_one_rank_only_fails_fast_naming_the_method_and_both_ranks_calling_pass(
        tmp_path: Path) -> None:
    _run("--out", str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        # Our 100 keys by name (the store's key count also moves with the launcher's own keys: it
        # read +1 once on a loaded machine, so it is recorded but not asserted)
        assert r["keys_left"] == [], "every call's store keys are deleted"
        assert r["both_50_calls_s"] < 5, r
        assert r["after"] == "ok" and r["again"] == "ok"
    assert r0["alone"].startswith("FxspeedError: engine.state_dict() is collective: every rank must call it "
                                  "(rank 0 waited 2s; 1 of 2 ranks arrived). Call it on every rank"), r0["alone"]
    assert 1.9 <= r0["alone_s"] < 5, r0


@pytest.mark.slow
def test_engine_state_dict_on_one_rank_or_save_and_load_with_other_arguments_fail_fast_and_the_engine_goes_on(
        tmp_path: Path) -> None:
    """Engine.state_dict, load_state_dict and gathered meet every rank first (fxspeed.mesh.expect_all_ranks,
    half of dist_timeout_s)."""
    _run("--out", str(tmp_path), "--engine", timeout=400)
    r0 = json.loads((tmp_path / "engine_rank0.json").read_text())
    assert r0["alone"].startswith("FxspeedError: engine.state_dict() is collective: every rank must call it"), r0
    assert r0["alone_s"] < 14, r0  # the engine's dist_timeout_s is 16: a hang would take that long
    assert r0["load_alone"].startswith("FxspeedError: engine.load_state_dict() is collective"), r0
    # it hung both ranks for dist_timeout_s, then "Timed out waiting 16000ms for send operation"
    assert r0["gathered_alone"].startswith("FxspeedError: engine.gathered() is collective"), r0
    assert r0["gathered_alone_s"] < 14, r0
    for r in (0, 1):  # a caught error leaves the ranks in step: state_dict on both, then a step
        rec = json.loads((tmp_path / f"engine_rank{r}.json").read_text())
        assert rec["again"] is True and rec["after"] == "ok", rec
        # different arguments on the ranks (a save reported done with rank 1's part stranded; a
        # load leaving replicas apart or, under ZeRO-3, a mix of both states): refused everywhere
        assert rec["save_apart"].startswith("ConfigError: ranks disagree on the directory of engine.save()"), rec
        assert "ck_rank1 on rank 1" in rec["save_apart"], rec
        assert rec["load_state_apart"].startswith(
            "ConfigError: ranks disagree on the state given to engine.load_state_dict()"), rec
        assert not [n for n in rec["nothing_written"] if n.startswith("ck_rank")], rec


def test_a_save_that_fails_writing_is_an_fxspeed_error_that_removes_its_partial_files_and_keeps_the_old_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP reports a failed write (a full disk) as CheckpointException, a BaseException: it went
    past a training loop's `except Exception` and killed the run, leaving the partial files on
    the full disk."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    engine = _mlp_engine(8, 2, seed=0)
    engine.save(tmp_path / "ck")
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    real = ckpt.dcp.save

    def full_disk(state, storage_writer, **kw):  # writes a part, then fails as DCP does
        real({k: v for i, (k, v) in enumerate(state.items()) if i == 0}, storage_writer=storage_writer, **kw)
        raise CheckpointException("save", {0: _wrap_exception(OSError(28, "No space left on device"))})

    monkeypatch.setattr(ckpt.dcp, "save", full_disk)
    x, y = torch.randn(4, 8), torch.randn(4)
    engine.train_step(x, y)
    try:
        engine.save(tmp_path / "ck")
    except Exception as e:  # what a training loop catches
        assert isinstance(e, FxspeedError) and "No space left" in str(e) and "untouched" in str(e)
    else:
        raise AssertionError("the save did not fail")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no ck.tmp-* left
    monkeypatch.setattr(ckpt.dcp, "save", real)
    engine.load(tmp_path / "ck")
    assert all(torch.equal(engine.state_dict()[k], v) for k, v in before.items())


def test_a_save_to_a_filesystem_without_room_for_it_is_refused_before_writing_and_says_how_much_is_free(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk mid-write ended in torch's "unexpected pos 704 vs 598", naming neither the disk
    nor its free space."""
    engine = _mlp_engine(8, 2, seed=0)
    engine.save(tmp_path / "ck")
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    monkeypatch.setattr(ckpt, "_free_bytes", lambda directory: 1000)
    with pytest.raises(FxspeedError, match=r"it needs about 1\.0 MiB and the filesystem holding it has 0\.0 MiB free "
                                           r"\(seen by rank 0\); the checkpoint already there is untouched"):
        engine.save(tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no ck.tmp-* left
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    with pytest.raises(FxspeedError, match="nothing was written"):
        engine.save(tmp_path / "new")
    assert not (tmp_path / "new").exists()


class BNNet(torch.nn.Sequential):
    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.nn.functional.mse_loss(super().forward(x), y)


def _bn_engine(config: fxspeed.Config) -> tuple[fxspeed.Engine, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    batch = (torch.randn(8, 6), torch.randn(8, 2))
    return fxspeed.compile(BNNet(), 1, config, example_inputs=batch), batch


@pytest.mark.parametrize("zero", [0, 1])
def test_loading_a_checkpoint_saved_before_the_first_step_brings_the_optimizer_back_to_fresh_states(
        tmp_path: Path, zero: int) -> None:
    """The same batches after the load give the same losses as the first time (the moments and
    step counts of the steps taken since the save are dropped, not kept)."""
    engine, batch = _bn_engine(fxspeed.Config(lr=0.05, zero=zero))
    engine.save(tmp_path / "ck")
    first = [engine.train_step(*batch) for _ in range(3)]
    engine.load(tmp_path / "ck")
    assert [engine.train_step(*batch) for _ in range(3)] == first


@pytest.mark.parametrize("saved, loaded", [(dict(optimizer="sgd", momentum=0.9), dict(optimizer="adamw")),
                                           (dict(optimizer="adamw"), dict(optimizer="sgd", momentum=0.9))])
def test_a_checkpoint_of_another_optimizer_is_refused_before_anything_is_loaded(tmp_path: Path, saved: dict,
                                                                                  loaded: dict) -> None:
    engine, batch = _bn_engine(fxspeed.Config(lr=0.05, **saved))
    engine.train_step(*batch)
    engine.save(tmp_path / "ck")
    other, _ = _bn_engine(fxspeed.Config(lr=0.05, **loaded))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(fxspeed.ConfigError, match=r"optimizer states \(.*\) and this engine's Config.optimizer=.*nothing was loaded"):
        other.load(tmp_path / "ck")
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    other.train_step(*batch)  # and it trains on


def test_load_state_dict_is_strict_about_buffers_and_unknown_keys_as_torch_is_and_strict_false_loads_the_rest() -> None:
    engine, batch = _bn_engine(fxspeed.Config(lr=0.05))
    engine.train_step(*batch)
    fresh = BNNet().state_dict()
    partial = {k: v for k, v in fresh.items() if not k.startswith("1.running")} | {"typo.weight": torch.zeros(1)}
    # (BatchNorm has its own _load_from_state_dict: the module's load_state_dict says it, as torch's)
    with pytest.raises(fxspeed.ConfigError, match=r"(?s)nothing was loaded.*Missing key.*\"1\.running_mean\".*"
                                                  r"Unexpected key.*\"typo\.weight\""):
        engine.load_state_dict(partial)
    engine.load_state_dict(partial, strict=False)
    state = engine.state_dict()
    assert torch.equal(state["0.weight"], fresh["0.weight"]) and not torch.equal(state["1.running_mean"], fresh["1.running_mean"])
