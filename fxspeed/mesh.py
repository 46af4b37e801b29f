"""The device mesh: every process group fxspeed uses comes from here.

Ranks form a named pp x dp x tp mesh. Global rank g sits at

    g = (d * pp + p) * tp + t          d: data-parallel replica, p: pipeline position, t: tensor rank

so tensor-parallel ranks are adjacent (they talk most: one node), a pipeline's positions come
next, and replicas are outermost. With pp = tp = 1 every rank is a replica, as plain data
parallelism expects. The groups are torch DeviceMesh dimensions ("dp", "pp", "tp"); groups over
other rank sets (a weight tied across pipeline positions; a second group over the same ranks
for collectives that must not queue behind others) are made by `Mesh.new_group`, which is
collective over all ranks and must be called in the same order everywhere.

Under `torchrun` (or `fxspeed run`), compile() joins the group from the environment (NCCL on
CUDA, gloo on CPU), or uses the default group when the script already initialized one.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import hashlib
import os
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from fxspeed.errors import ConfigError, FxspeedError, warn_user
from fxspeed.ir.batch import batch_digest


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    group: Any = None
    group_name: str = ""

    @property
    def active(self) -> bool:
        return self.world > 1


def join(n_devices: int, timeout_s: float) -> DistContext:
    """Return the process group for `n_devices` ranks, initializing it from the environment."""
    if n_devices == 1 and not dist.is_initialized():
        return DistContext()
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            raise ConfigError(
                f"devices={n_devices} needs {n_devices} processes: launch with `fxspeed run -n {n_devices} script.py` "
                f"or `torchrun --nproc-per-node {n_devices} script.py` (or call torch.distributed.init_process_group first)"
            )
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("FXSPEED_BACKEND") != "gloo" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        _world_timeout_s[:] = [timeout_s]
        # The group is ours: end it at exit as a script would (NCCL warns about a group left
        # undestroyed, and its communicators were torn down in no order)
        atexit.register(_destroy_at_exit)
        sys.excepthook = _note_failure(sys.excepthook)
        sys.exit = _noting_exit(sys.exit)
        dist.destroy_process_group = _noting_destroy(dist.destroy_process_group)
    elif _world_timeout_s and _world_timeout_s[0] != timeout_s:
        _retime_world(timeout_s)
    world = dist.get_world_size()
    if world != n_devices:
        raise ConfigError(f"devices={n_devices} but the process group has {world} ranks; pass devices={world} "
                          f"or launch {n_devices} processes")
    group = dist.group.WORLD
    return DistContext(dist.get_rank(), world, group, group.group_name)


_failed: list[BaseException] = []  # an uncaught exception ends this process (sys.excepthook)

# The world group's timeout, in seconds, while it is the group `join` initialized (empty when the
# script initialized it: that group keeps the script's timeout, fxspeed leaves it alone).
_world_timeout_s: list[float] = []
# The active meshes alive in this process (engines hold theirs), for _retime_world's warning.
_meshes: "weakref.WeakSet[Mesh]" = weakref.WeakSet()


def _retime_world(timeout_s: float) -> None:
    """A later compile's Config.dist_timeout_s governs the world group too. That compile's
    dp/pp/tp groups are new, made at its timeout, but the world group (a dimension spanning every
    rank, the rank-agreement checks) is the one the first compile initialized, and it kept the
    first's: an engine compiled later at 2 s waited 300 s on world collectives. The group is
    shared, so an engine still alive at another timeout is warned about: its world collectives
    change too."""
    from torch.distributed import distributed_c10d

    old = _world_timeout_s[0]
    # Private, but the one way to retime a live group: present in torch 2.13 and in 2.4-era source
    # alike (the same body); a torch without it gets the warning below, and the old timeout.
    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    try:
        if set_timeout is None:
            raise AttributeError("torch.distributed.distributed_c10d._set_pg_timeout is gone")
        set_timeout(timedelta(seconds=timeout_s), dist.group.WORLD)
    except (AttributeError, TypeError, RuntimeError, ValueError) as e:
        warn_user(f"fxspeed: Config.dist_timeout_s={timeout_s} does not apply to the world process group, which an "
                  f"earlier compile initialized with dist_timeout_s={old} ({type(e).__name__}: {e}); collectives over "
                  "every rank keep that timeout. Pass the same Config.dist_timeout_s to every engine of a process, or "
                  "initialize the group yourself (torch.distributed.init_process_group(timeout=...)) before compiling")
        return
    _world_timeout_s[:] = [timeout_s]
    others = sorted({m.timeout_s for m in _meshes if m.timeout_s not in (None, timeout_s)})
    if others:
        gc.collect()  # an engine dropped but not yet collected (a reference cycle) is not alive
        others = sorted({m.timeout_s for m in _meshes if m.timeout_s not in (None, timeout_s)})
    if others:
        warn_user(f"fxspeed: Config.dist_timeout_s={timeout_s} now governs the world process group, which every engine "
                  f"in this process shares: an engine compiled earlier with dist_timeout_s="
                  f"{' or '.join(map(str, others))} is still alive, and its collectives over every rank (plain data "
                  f"parallelism's gradient reductions, the rank-agreement checks) now time out at {timeout_s} s (its "
                  "own tp/pp/dp groups keep theirs). Pass the same Config.dist_timeout_s to every engine of a process, "
                  "or drop the earlier engine first")


def _noting_exit(exit_fn: Any) -> Any:
    """sys.exit with a failure code is a failure too (sys.excepthook never sees SystemExit): a
    rank leaving a step that way waited at the exit barrier, then in destroy_process_group, until
    its peers' collective timed out (dist_timeout_s, 300 s by default), instead of ending them."""
    def noted(code: Any = None) -> None:
        if code not in (None, 0):
            if not _failed:
                note_failure_for_peers(f"its script called sys.exit({code!r})")
            _failed.append(SystemExit(code))
        exit_fn(code)
    return noted


def _note_failure(hook: Any) -> Any:
    def noted(kind: type, value: BaseException, tb: Any) -> None:
        if not _failed:  # a step's failure already said what failed, where the peers read it
            note_failure_for_peers(f"its script raised {kind.__name__}: {str(value).strip()[:300]}")
        _failed.append(value)
        hook(kind, value, tb)
    return noted


EXITED_KEY = "fxspeed/exited/"  # + rank: this rank's script ended without an error (read by peers' errors)
FAILED_KEY = "fxspeed/failed/"  # + rank: what failed mid-step there (read by peers' errors)


IN_TURN = "\x01"  # leads a FAILED_KEY value: that rank's step failed because a peer's had (a collective)


def note_failure_for_peers(what: str, in_turn: bool = False) -> None:
    """A step failed on this rank while its peers were in (or will run) the step's collectives:
    the ranks are out of step for good. Say what failed where the peers' errors can read it, and
    skip the exit meeting, so that this process ends as soon as its script does and a peer
    waiting in a collective fails then (its connection closes), naming this failure, instead of
    at dist_timeout_s. (Not sooner: gloo's abort, shutdown and destroy all leave the connections
    open while the process lives, measured with torch 2.13, so a script that catches the error
    and goes on keeps its peers waiting until it ends.)"""
    if not dist.is_available() or not dist.is_initialized():
        return
    _tell_peers(FAILED_KEY, (IN_TURN if in_turn else "") + what[:400])
    _failed.append(RuntimeError(what))  # no exit meeting: the peers are not coming


def _tell_peers(key: str, value: str) -> None:
    """`key` + this rank = `value` in the default store, for the peers' exit meeting and errors."""
    from torch.distributed import distributed_c10d

    try:
        distributed_c10d._get_default_store().set(f"{key}{dist.get_rank()}", value.encode())
    except Exception:  # noqa: BLE001 - the store's host (rank 0) may be gone already
        pass


def _announce_exit() -> None:
    """This rank is done with the process group (its script ended, or it destroys the group):
    EXITED_KEY in the store, for the exit meeting and for peers' errors. Not after a failure
    (FAILED_KEY says that)."""
    if _failed or not dist.is_initialized():
        return
    _tell_peers(EXITED_KEY, "1")


def _noting_destroy(destroy_fn: Any) -> Any:
    """dist.destroy_process_group called by the script (before its end) announces this rank's
    exit too, so the peers' exit meetings do not wait for it."""
    @functools.wraps(destroy_fn)
    def noted(group: Any = None) -> None:
        if group is None or group is dist.group.WORLD:
            _announce_exit()
            _world_timeout_s.clear()  # a group the script initializes next is the script's
        destroy_fn(group)
    return noted


def _meet_at_exit(timeout_s: float = 10.0) -> None:
    """Wait until every other rank has announced its exit or its failure, at most `timeout_s`.

    Ranks that tore gloo down while a peer was still running aborted one launch in about six
    ("terminate called without an active exception", after the results were out: 4 of 24
    two-rank launches, 0 of 24 twice with a barrier here), so ranks meet first, and give up
    after a while where a peer has gone or is still in a step (its own error is the one to
    read). The meeting is in the store, not a collective: a gloo barrier paired with a peer's
    step collective (a rank whose loader ran one batch longer, or sys.exit(0) on one rank), and
    both waited to dist_timeout_s. Gone from here, this rank's sockets close and the peer's
    collective fails at once, naming this rank's exit."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    pending = set(range(dist.get_world_size())) - {dist.get_rank()}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        pending = {r for r in pending if not (store.check([f"{EXITED_KEY}{r}"]) or store.check([f"{FAILED_KEY}{r}"]))}
        if pending:
            time.sleep(0.02)


def _destroy_at_exit() -> None:
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo" and not _failed:
            _announce_exit()
            _meet_at_exit()
        # A rank leaving on a failure does not wait: its peers' collectives fail when it is gone.
    except Exception:  # at exit, after a failure or a peer that is not coming: nothing left to save
        pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def comm_device(group: Any) -> torch.device:
    """Where a small control tensor for `group` must live: NCCL takes CUDA tensors only."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fingerprint(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def check_agreement(ctx: DistContext, what: str, value: str, fix: str,
                    parts: Callable[[], dict[str, str]] | None = None) -> None:
    """Raise on every rank when ranks disagree on `value` (a fingerprint of `what`). `parts`: the
    named pieces the fingerprint was taken of (computed only here, on the slow path), so the
    error says which of them differ, not only that something does."""
    if not ctx.active:
        return
    try:
        named = parts() if parts is not None else {}
    except Exception:  # noqa: BLE001 - a diagnostic: without it the error still names the ranks
        named = {}
    values: list[Any] = [None] * ctx.world
    dist.all_gather_object(values, (value, named), group=ctx.group)
    differ = [r for r, (v, _) in enumerate(values) if v != values[0][0]]
    if differ:
        raise ConfigError(f"ranks disagree on {what}: rank(s) {differ} differ from rank 0"
                          f"{_differing_parts(values[0][1], values[differ[0]][1], differ[0])}. {fix}")


def _differing_parts(first: dict[str, str], other: dict[str, str], rank: int) -> str:
    diffs = [f"{k} is {other.get(k, '(absent)')} on rank {rank} and {first.get(k, '(absent)')} on rank 0"
             for k in sorted(set(first) | set(other)) if first.get(k) != other.get(k)]
    more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
    return f" ({'; '.join(diffs[:3])}{more})" if diffs else ""


def same_everywhere(ctx: DistContext, value: str) -> bool:
    """Whether every rank holds this `value` (a fingerprint): one 2-element all-reduce; the same
    answer on every rank."""
    h = int(value[:15], 16)
    t = torch.tensor([h, -h], dtype=torch.int64, device=comm_device(ctx.group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return int(t[0]) == h and -int(t[1]) == h


def check_same_everywhere(ctx: DistContext, what: str, value: str, fix: str,
                          parts: Callable[[], dict[str, str]] | None = None) -> None:
    """Cheap per-step agreement (one 2-element all-reduce): raise on every rank when ranks
    hold different `value`s, before they diverge into mismatched collectives."""
    if not ctx.active:
        return
    if not same_everywhere(ctx, value):  # same result on every rank: all take this path
        check_agreement(ctx, what, value, fix, parts)  # names the ranks and the parts that differ


def start_alike(ctx: DistContext, model: Any) -> bool:
    """Give every rank rank 0's parameters and buffers when they differ (ranks that built the
    model without a common seed), as DDP and DeepSpeed do when they wrap a model. Otherwise the
    replicas trained from different weights (ZeRO-0 forever apart, ZeRO-3 and tensor parallelism a
    mix of the ranks' inits) with no error. A content digest first (exact int64 sums of the bits,
    one small all-reduce), so ranks built alike pay no broadcast. Returns whether it copied."""
    seen: set[int] = set()
    tensors = [t for t in (*model.parameters(), *model.buffers())
               if id(t) not in seen and not seen.add(id(t)) and t.device.type != "meta"]
    if not ctx.active or same_everywhere(ctx, fingerprint(batch_digest(tuple(tensors), {}))):
        return False
    broadcast_into(tensors, src=0, group=ctx.group, receive=ctx.rank != 0)
    return True


def broadcast_into(tensors: list[torch.Tensor], src: int, group: Any, receive: bool,
                   chunk_bytes: int = 64 << 20) -> None:
    """Broadcast `tensors` from global rank `src`, writing them in place on the receiving ranks:
    flat chunks of one dtype and device (bools travel as bytes: gloo has no bool), at most
    `chunk_bytes` each beyond a single larger tensor, so a whole model is not copied at once."""
    kinds: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    chunks: list[list[torch.Tensor]] = []
    for ts in kinds.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in ts:
            nbytes = t.numel() * t.element_size()
            if chunk and size + nbytes > chunk_bytes:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(t)
            size += nbytes
        chunks.append(chunk)
    with torch.no_grad():
        for ts in chunks:
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            dist.broadcast(flat.view(torch.uint8) if flat.dtype == torch.bool else flat, src=src, group=group)
            if receive:
                for t, part in zip(ts, flat.split([t.numel() for t in ts])):
                    t.copy_(part.view_as(t))


def check_same_model(ctx: DistContext, model: Any, config: Any, devices: Sequence[Any] = ()) -> None:
    """Every rank must build the same model (parameter and buffer names, shapes, dtypes, which
    parameters train), Config and devices. Buffers too: start_alike broadcasts parameters and
    buffers as flat chunks, and a buffer one rank lacks shifted the others' values with no error
    (gloo takes a shorter message); requires_grad too: a weight frozen on one rank only aborted
    gloo at the first step. Devices (DeviceSpecs) too: the planner's choices (tensor-parallel
    placements, stage splits) follow their rates, and ranks choosing differently would run
    mismatched programs; a rate measured on each rank (`fxspeed.measured_cpu()`) differs."""
    shapes = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    # Rates only: the memory of "auto" devices is each host's own (a 40 GB and an 80 GB GPU, hosts
    # with other RAM), which ranks have always been allowed to differ in.
    specs = [{k: v for k, v in d.to_dict().items() if k != "memory"} if hasattr(d, "to_dict") else repr(d)
             for d in devices]
    pieces = {"the model": fingerprint(type(model).__name__, shapes, buffers), "the Config": fingerprint(config.to_dict()),
              "the devices": fingerprint(specs)}
    check_agreement(ctx, "the model, config and devices", fingerprint(*pieces.values()),
                    "every rank must build the same model (same parameter and buffer names, shapes, dtypes and "
                    "requires_grad), Config and devices (a DeviceSpec measured on each rank, such as "
                    "fxspeed.measured_cpu()'s, differs: measure on one rank and give every rank that one)",
                    parts=lambda: _model_parts(model, shapes, buffers, config, specs))


def _model_parts(model: Any, shapes: list, buffers: list, config: Any, specs: list) -> dict[str, str]:
    """What check_same_model compared, named piece by piece for its error: each Config key, each
    parameter and buffer (shape, dtype, trained or frozen), the model's class, each device."""
    parts = {"the model's class": type(model).__name__, "the number of parameters": str(len(shapes)),
             "the number of buffers": str(len(buffers))}
    parts.update({f"Config.{k}": repr(v) for k, v in config.to_dict().items()})
    parts.update({f"parameter {n}": f"{list(s)} {d}{'' if rg else ' frozen'}" for n, s, d, rg in shapes})
    parts.update({f"buffer {n}": f"{list(s)} {d}" for n, s, d in buffers})
    for i, s in enumerate(specs):
        parts.update({f"device {i} {k}": repr(v) for k, v in s.items()} if isinstance(s, dict) else {f"device {i}": s})
    return parts


# Per process: how many times each (group, name) check ran, so every call has its own store key.
_arrivals: dict[tuple[str, str], int] = {}  # (group, name) -> calls this process completed


def expect_all_ranks(name: str, timeout_s: float = 10.0, group: Any = None, fix: str | None = None) -> None:
    """Fail fast, with a clear FxspeedError, when a collective method is called on some ranks only
    (e.g. `if rank == 0: engine.state_dict()`), instead of hanging until the process group's
    timeout and a raw backend error. Call it first thing in the method, on every rank of `group`
    (default: all ranks), with the method's name, e.g. "engine.state_dict()".

    Every rank adds 1 to a key of the default c10d store unique to this call (name, group and
    this process's count of such calls) and waits until all ranks of the group have added theirs;
    the last rank to leave deletes the key. No process group or one rank: returns at once.
    Three store round trips per call; works for any backend (gloo, NCCL). A rank that waits more
    than `timeout_s` raises, so a rank legitimately busy for that long before calling (its own
    eval, I/O) makes this raise too: pass a timeout above the skew your ranks can have.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    world = dist.get_world_size(group)
    if world <= 1:
        return
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    gname = group.group_name if group is not None else "world"
    n = _arrivals.get((gname, name), 0) + 1
    key = f"fxspeed/expect_all_ranks/{gname}/{name}/{n}"
    done = key + "/all"
    start = time.monotonic()
    arrived = store.add(key, 1)
    if arrived == world:
        store.set(done, b"1")
    elif arrived < world:
        try:
            store.wait([done], timedelta(seconds=max(timeout_s, 0.001)))
        except Exception as e:  # noqa: BLE001 - DistStoreError / RuntimeError("Wait timeout") by version
            # Withdraw this arrival (atomically), so that a caught error leaves the ranks in step: the
            # next call here is call n again, and a rank arriving late for call n waits for us instead
            # of counting a stale arrival and running the collective alone. If the others all arrived
            # before the withdrawal, they have passed: arrive again and go on with them.
            arrived = store.add(key, -1) + 1
            if arrived >= world:  # everyone arrived just as the wait gave up
                store.add(key, 1)
            else:
                waited = time.monotonic() - start
                hint = fix or ("Call it on every rank and save on rank 0 only: `state = engine.state_dict()` "
                               "on every rank, then `if rank == 0: torch.save(state, path)`")
                raise FxspeedError(
                    f"{name} is collective: every rank must call it (rank {dist.get_rank()} waited {waited:.0f}s; "
                    f"{arrived} of {world} ranks arrived). {hint}") from e
    _arrivals[(gname, name)] = n
    # Leave: the last of the 2 * world increments means every rank is past its wait; clean up.
    if store.add(key, 1) == 2 * world:
        for k in (key, done):
            try:
                store.delete_key(k)
            except Exception:  # noqa: BLE001 - a store without delete_key: the key stays (small)
                pass


def peers_gone() -> tuple[list[tuple[int, str, bool]], list[int]]:
    """What the other ranks said as they left, read without waiting, for the error of a
    collective that failed because they are gone: (rank, what failed there, whether it failed
    in turn: its own collective failed because of another rank) from FAILED_KEY, and the ranks
    whose script ended without an error (EXITED_KEY). Empty where the store cannot be read."""
    if not dist.is_available() or not dist.is_initialized():
        return [], []
    from torch.distributed import distributed_c10d

    try:
        store = distributed_c10d._get_default_store()
        others = [r for r in range(dist.get_world_size()) if r != dist.get_rank()]
        said = [(r, store.get(f"{FAILED_KEY}{r}").decode()) for r in others if store.check([f"{FAILED_KEY}{r}"])]
        failed = [(r, what.removeprefix(IN_TURN), what.startswith(IN_TURN)) for r, what in said]
        return failed, [r for r in others if store.check([f"{EXITED_KEY}{r}"])]
    except Exception:  # noqa: BLE001 - a diagnostic for an error message; the store may be gone too
        return [], []


DIMS = ("dp", "pp", "tp")


class Mesh:
    """A pp x dp x tp arrangement of the job's ranks and the process groups along each dimension.

    >>> mesh = Mesh.join(4, pp=2)            # 2 pipelines of 2 positions; dp = 4 / (2 * 1) = 2
    >>> mesh.coords(3)                       # {"dp": 1, "pp": 1, "tp": 0}
    >>> mesh.group("dp"), mesh.ranks("pp")   # this rank's replica group; its pipeline's ranks
    """

    def __init__(self, ctx: DistContext, pp: int = 1, tp: int = 1, timeout_s: float | None = None):
        """`timeout_s`: how long a collective on the groups made here (dp, pp, tp and new_group's)
        may wait (Config.dist_timeout_s); None: torch's default for new groups (30 min on gloo).
        (The world group's timeout is `join`'s: the latest compile's.)"""
        world = ctx.world
        if pp < 1 or tp < 1 or world % (pp * tp):
            raise ConfigError(f"devices={world} is not a multiple of Config.pipeline x Config.tensor = {pp} x {tp} = "
                              f"{pp * tp}; use devices = {pp * tp} x (data-parallel replicas), e.g. "
                              f"{max(pp * tp, world - world % (pp * tp))} or {(world // (pp * tp) + 1) * pp * tp}")
        self.ctx = ctx
        self.pp, self.tp, self.dp = pp, tp, world // (pp * tp)
        self.rank, self.world = ctx.rank, world
        self.timeout_s = timeout_s
        self._timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        self._device_mesh = None
        self._groups: dict[str, Any] = {}
        if ctx.active:
            self._make_groups()
            _meshes.add(self)

    @classmethod
    def join(cls, n_devices: int, timeout_s: float = 300.0, *, pp: int = 1, tp: int = 1) -> "Mesh":
        """Join (or initialize) the process group for `n_devices` ranks and lay them out."""
        return cls(join(n_devices, timeout_s), pp=pp, tp=tp, timeout_s=timeout_s)

    # --- layout --------------------------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    @property
    def active(self) -> bool:
        return self.ctx.active

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """The (dp, pp, tp) coordinates of `rank` (default: this rank)."""
        g = self.rank if rank is None else rank
        rest, t = divmod(g, self.tp)
        d, p = divmod(rest, self.pp)
        return {"dp": d, "pp": p, "tp": t}

    def rank_at(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def ranks(self, dim: str, rank: int | None = None) -> list[int]:
        """Global ranks of `rank`'s group along `dim` (all coordinates equal but `dim`'s), in order."""
        c = self.coords(rank)
        size = self.shape[_check_dim(dim)]
        return [self.rank_at(**{**c, dim: i}) for i in range(size)]

    def group(self, dim: str) -> Any:
        """This rank's process group along `dim` ("dp", "pp", "tp" or "world"); None on one process."""
        if not self.active:
            return None
        if dim == "world":
            return self.ctx.group
        return self._groups[_check_dim(dim)]

    def group_name(self, dim: str) -> str:
        g = self.group(dim)
        return g.group_name if g is not None else ""

    def new_group(self, ranks: list[int]) -> Any:
        """A new group over `ranks` (collective: every rank calls it, in the same order)."""
        if not self.active:
            return None
        return dist.new_group(sorted(ranks), backend=dist.get_backend(self.ctx.group), timeout=self._timeout)

    def new_group_along(self, dim: str) -> Any:
        """A new group of this rank's `dim` slice, with the mesh's timeout: the mesh's own group
        along `dim`, or a second one (for collectives that must not queue behind the first's).
        Collective over the world: every rank makes one group per slice, in the same order (torch
        requires it), and keeps its own; with one slice it is new_group."""
        if not self.active:
            return None
        mine, _ = dist.new_subgroups_by_enumeration(self._slices(dim), timeout=self._timeout,
                                                    backend=dist.get_backend(self.ctx.group))
        return mine

    def describe(self) -> str:
        """The rank layout as a table, one line per rank (shown in plan.summary())."""
        lines = [f"mesh dp={self.dp} x pp={self.pp} x tp={self.tp} over {self.world} rank(s); "
                 "rank = (dp_index * pp + pp_index) * tp + tp_index"]
        for g in range(self.world):
            c = self.coords(g)
            lines.append(f"  rank {g}: dp {c['dp']}, pp {c['pp']}, tp {c['tp']}")
        return "\n".join(lines)

    def _slices(self, dim: str) -> list[list[int]]:
        """Every `dim` slice of the mesh once, in order (the same list on every rank, as torch's
        collective group creation requires)."""
        return [list(r) for r in sorted({tuple(self.ranks(dim, g)) for g in range(self.world)})]

    def _make_groups(self) -> None:
        # The groups are made here, with Config.dist_timeout_s: DeviceMesh makes its own with torch's
        # default for new groups (30 min on gloo), so a rank missing from a tp, pp or dp collective
        # (8 ranks, dist_timeout_s=5) held its peers there for 30 min instead of failing at 5 s.
        # A dimension spanning every rank uses the default group itself: the functional
        # collectives the passes insert name it, and a copy would be one more communicator.
        from torch.distributed.device_mesh import DeviceMesh

        for dim in DIMS:
            self._groups[dim] = self.ctx.group if self.shape[dim] == self.world else self.new_group_along(dim)
        device_type = "cuda" if dist.get_backend(self.ctx.group) == "nccl" else "cpu"
        layout = torch.arange(self.world).reshape(self.dp, self.pp, self.tp)
        self._device_mesh = DeviceMesh.from_group([self._groups[d] for d in DIMS], device_type, mesh=layout,
                                                  mesh_dim_names=DIMS)

    @property
    def device_mesh(self) -> Any:
        """torch's DeviceMesh (dims "dp", "pp", "tp"), for DTensor-based code; None on one process."""
        return self._device_mesh


def check_same_in_replica(mesh: Mesh, what: str, value: str, fix: str) -> None:
    """Raise on every rank when two ranks of one data-parallel replica (its pipeline positions and
    tensor-parallel ranks) hold different `value`s; replicas may differ. One all-reduce of a
    world-sized int64 vector (each rank fills its own slot: an all-gather gloo and NCCL both do
    fast)."""
    if not mesh.active or mesh.world == mesh.dp:
        return
    t = torch.zeros(mesh.world, dtype=torch.int64, device=comm_device(mesh.ctx.group))
    t[mesh.rank] = int(value[:15], 16)
    dist.all_reduce(t, group=mesh.ctx.group)
    got = t.tolist()
    bad = [r for r in range(mesh.world) if got[r] != got[mesh.rank_at(dp=mesh.coords(r)["dp"])]]
    if bad:
        raise ConfigError(f"ranks disagree on {what}: rank(s) {bad} differ from the first rank of their data-parallel "
                          f"replica ({mesh.describe().splitlines()[0]}). {fix}")


def module_generators(model: torch.nn.Module) -> list[torch.Generator]:
    """The torch.Generators `model`'s modules hold as attributes (`self.gen`), each once: a step
    draws from them as traced, beside torch's default generators."""
    seen: dict[int, torch.Generator] = {}
    for m in model.modules():
        for v in m.__dict__.values():
            if isinstance(v, torch.Generator):
                seen.setdefault(id(v), v)
    return list(seen.values())


def share_generators(mesh: Mesh, device: torch.device, held: Sequence[torch.Generator] = ()) -> None:
    """Give every tensor-parallel rank the random generator states of its group's first rank.

    Random ops under tensor parallelism draw on every tp rank what one device would draw
    (dropout: the whole mask, each rank keeping its piece), so the tp ranks' generators must be
    in one state. A script may leave them apart: seeded by rank, or drawing on one rank only
    (rank 0 sampling a batch it then broadcasts). One broadcast of the CPU generator's state (and
    `device`'s, on CUDA), and of the generators the model holds (`held`, module_generators: one
    seeded by rank drew other masks for a replicated activation on each tp rank), over the tp
    group; replicas keep their own."""
    if not mesh.active or mesh.tp == 1:
        return
    group = mesh.group("tp")
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    states += [g.get_state() for g in held]
    t = torch.cat(states).to(comm_device(group))
    dist.broadcast(t, src=mesh.ranks("tp")[0], group=group)
    if mesh.coords()["tp"] != 0:
        parts = t.cpu().split([s.numel() for s in states])
        torch.set_rng_state(parts[0].clone())
        if device.type == "cuda":
            torch.cuda.set_rng_state(parts[1].clone(), device)
        for g, part in zip(held, parts[len(parts) - len(held):]):
            g.set_state(part.clone())


def stream_seed(dp: int, pp: int, generator: torch.Generator | None = None) -> int:
    """The seed replica `dp` at pipeline position `pp` draws a step's random numbers from: one
    number drawn from `generator` (default: torch's default CPU generator), mixed with the two
    coordinates.

    Every rank draws it, so ranks seeded alike stay in step whatever their programs draw, and a
    checkpoint's generator states resume the same streams. Tensor-parallel ranks (the same dp and
    pp, generators shared first) get the same seed."""
    where = generator.device if generator is not None else torch.device("cpu")
    drawn = int(torch.randint(0, 2**62, (), dtype=torch.int64, generator=generator, device=where))
    mixed = hashlib.blake2b(f"fxspeed-stream:{drawn}:{dp}:{pp}".encode(), digest_size=8).digest()
    return int.from_bytes(mixed, "little") & (2**63 - 1)


@contextlib.contextmanager
def own_stream(mesh: Mesh, device: torch.device, held: Sequence[torch.Generator] = ()) -> Iterator[None]:
    """Run a step's random ops (dropout) on this replica's and pipeline position's own stream.

    Ranks seeded alike (as every script must seed them for equal initial weights) hold generators
    in one state: data-parallel replicas then drew the same dropout masks for their different
    rows, and each pipeline position the masks of the position before it (a stage of blocks
    repeating the first stage's blocks' masks). Inside, torch's default CPU generator (and
    `device`'s, on CUDA) is seeded with `stream_seed(dp, pp)`, and each generator the model holds
    (`held`) with `stream_seed(dp, pp, g)`; the states are put back after, so each generator moves
    by one draw per step on every rank, whatever the step drew. On one replica of one stage (one
    process, tensor parallelism alone) nothing changes: the step draws from the generators as
    eager does."""
    if not mesh.active or mesh.dp * mesh.pp == 1:
        yield
        return
    c = mesh.coords()
    seed = stream_seed(c["dp"], c["pp"])
    cuda = device.type == "cuda"
    cpu_state = torch.get_rng_state()
    device_state = torch.cuda.get_rng_state(device) if cuda else None
    own = [stream_seed(c["dp"], c["pp"], g) for g in held]
    held_states = [g.get_state() for g in held]
    torch.default_generator.manual_seed(seed)
    if cuda:  # this device's generator only (torch.manual_seed would reseed every visible device)
        torch.cuda.default_generators[torch.device(device).index or torch.cuda.current_device()].manual_seed(seed)
    for g, s in zip(held, own):
        g.manual_seed(s)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda:
            torch.cuda.set_rng_state(device_state, device)
        for g, state in zip(held, held_states):
            g.set_state(state)


def _check_dim(dim: str) -> str:
    if dim not in DIMS:
        raise ValueError(f"mesh dimension {dim!r} is not one of {DIMS} (or 'world')")
    return dim
