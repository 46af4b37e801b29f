"""FlatParameters: the model's trainable parameters laid out in the compiler's buckets, full
or sharded per rank, and the tensors the optimizer steps for each ZeRO stage.

    zero 0    full flat buckets on every rank; optimizer over the Parameters (views into them),
              gradients as views into the reduced buckets (DDP with gradient_as_bucket_view),
              which are persistent buffers (grad_buffer) the program reduces into every step
    zero 1    full flat buckets; optimizer (and its states) over this rank's shard of each
              bucket; updated shards all-gathered back into the full buckets after the step
              (synchronously, or left in flight for a program that waits for them: defer=True)
    zero 2    as zero 1, but the graph hands back only this rank's gradient shard
    zero 3    only this rank's shard of each bucket exists between steps; the graph gathers

For zero 0-2 the model's Parameters are re-pointed into the flat buckets, so the user's
module (and its state_dict) always shows the current weights. Under zero 3 they are emptied
and `full_state()` gathers them on request.

Master weights (`work_dtype`, ZeRO-1/2/3 under bf16/fp16; the program's parameters are
low-precision working copies, see passes/graph/keep_weights_low.py): the ZeRO paper's layout.

    shards[k]       fp32 master of this rank's partition of bucket k: what the optimizer steps
    full[k]         the working copy of the whole bucket (zero 1/2; None under zero 3), which
                    the program reads and the post-step gathers fill
    work_shards[k]  this rank's slot of full[k] (zero 1/2) or its own working shard (zero 3)

A step: reduced low-precision gradient shard -> fp32 .grad of the master -> optimizer -> master
copied (rounded) into the working shard -> working shards gathered (half the bytes of fp32).
Full fp32 weights exist nowhere between steps, so the module's Parameters are emptied (as under
zero 3) and `gathered()` / `full_state()` gather the masters.
why: docs/decisions/master-weights-in-the-partition.md

Masters in the offload file (`masters_elsewhere`, Config.offload="optimizer": ZeRO-Offload's
layout, also on one rank): no fp32 shard is held here. `shards[k]` *is* `work_shards[k]`, what the
optimizer steps and keys its state by; its gradient stays in the working precision; the optimizer
(a MasterStore: runtime/offloaded_optimizer.py) holds the fp32 master beside Adam's moments and
rounds the new master into the working shard itself (or, with parameter offload, hands it to the
working shard's file). The buckets are allocated empty (no pages
touched) and filled by `fill(store)` once the store exists, one bucket at a time: the store takes
each master a chunk's piece at a time, so building the layout never holds the fp32 masters (nor
a bucket's flat fp32 copy) in memory.

Working shards in files (`offload_working`, Config.offload="parameters"/"all", zero 3): the
working shards' tensors keep their shape but hold no memory; their values live in a
ParameterFiles (runtime/offloaded_parameters.py) that the program reads ahead of each gather,
and every write of a working shard (fill, after_step, capture_from_parameters, the offloaded
optimizer's rounding) goes to the file.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from fxspeed.errors import FxspeedError
from fxspeed.ir import Bucket
from fxspeed.runtime.kernels.collectives import exchange_gather_out
from fxspeed.runtime.host_tier import DeviceLink
from fxspeed.runtime.offloaded_parameters import ParameterFiles


class MasterStore(Protocol):
    """Where fp32 masters live when not here, keyed by the working shard they belong to."""

    def read_master(self, work: torch.Tensor) -> torch.Tensor: ...

    def write_master(self, work: torch.Tensor, value: torch.Tensor | Callable[[int, int], torch.Tensor]) -> None:
        """`value`: the master, or `value(start, count)` its elements start..start+count (flat order)."""


class FlatParameters:
    def __init__(self, params: dict[str, nn.Parameter], buckets: list[Bucket], *, rank: int, world: int,
                 zero: int, group: dist.ProcessGroup | None, gather_group: dist.ProcessGroup | None = None,
                 work_dtype: torch.dtype | None = None, masters_elsewhere: bool = False,
                 working_in_files: bool = False, materialize: Callable[[list[nn.Parameter]], None] | None = None,
                 device: torch.device | None = None):
        """`gather_group` (same ranks as `group`) carries deferred post-step gathers, so the next
        step's small collectives on `group` do not queue behind them; without it none are deferred.
        `work_dtype`: the program reads working copies in this dtype and the shards are fp32
        masters (zero >= 1). `masters_elsewhere`: the masters live in a MasterStore; call
        `fill(store)` before the first step. `working_in_files` (zero 3 with master weights,
        parameter offload): the working shards go to files (`offload_working`), on one rank too.
        `materialize(params)`: called with each bucket's Parameters just before they are read (a
        model built on the meta device gets its values one bucket at a time: runtime/deferred_init.py;
        `device` says where then)."""
        self.params = params  # canonical name -> Parameter (tied aliases resolved by the caller)
        self.buckets = buckets
        # One rank: its shard is the whole bucket, nothing is gathered (zero 3 has no gathers in
        # the program there, so it keeps full working buckets as zero 1/2 do).
        # With parameter offload one rank keeps zero 3's layout: its shards (whole buckets) go to files.
        zero = zero if world > 1 or working_in_files else min(zero, 2)
        self.files: ParameterFiles | None = None
        self.rank, self.world, self.zero, self.group = rank, world, zero, group
        self.gather_group = gather_group
        # On gloo the post-step gathers are point-to-point exchanges (runtime/kernels/collectives.py),
        # half the cost of gloo's own all-gather, as the compiled programs' gathers are
        # (PassOptions.gather_via_exchange, set for gloo). why: docs/decisions/zero-gather-via-all-reduce-on-gloo.md
        self.exchange = world > 1 and group is not None and dist.get_backend(group) == "gloo"
        self.in_flight = False  # deferred gathers issued and not yet known to be finished
        self._issued: dict[str, int] = {}  # Parameter -> its version when the deferred gathers were issued
        self.grad_buffers: dict[int, torch.Tensor] = {}  # persistent reduced-gradient buckets
        self.full: list[torch.Tensor | None] = []
        self.shards: list[torch.Tensor] = []
        self.master = work_dtype is not None and zero >= 1
        self.work_dtype = work_dtype
        # The module's Parameters hold nothing between steps (zero 3, master weights).
        self.released = zero >= 3 or self.master
        self.work_shards: list[torch.Tensor] = self.shards if not self.master else []
        self._working: dict[str, torch.Tensor] = {}  # canonical name -> view into a working bucket
        self._versions: dict[str, tuple[int, int]] = {}  # released Parameter -> (version, storage) then
        self.store: MasterStore | None = None
        self._materialize = materialize or (lambda params: None)
        self.device = device or next(iter(params.values())).device  # given where the Parameters are on meta
        self.masters_elsewhere = masters_elsewhere and self.master
        if self.masters_elsewhere:
            for b in buckets:  # empty: filled by fill(store)
                lo, hi = self._range(b)
                work = torch.empty(b.padded, dtype=work_dtype, device=self.device) if zero < 3 else None
                self._add_working(b, work)
                self.work_shards.append(work[lo:hi] if work is not None else
                                        torch.empty(hi - lo, dtype=work_dtype, device=self.device))
            self.shards = self.work_shards  # what the optimizer steps; its masters are in the store
        # One bucket at a time: each Parameter is re-pointed (or released) as soon as its bucket
        # is built, so building the layout never holds a second copy of the model. Sharded layouts
        # copy the Parameters straight into this rank's shard and the working bucket: a full fp32
        # flat copy of a bucket (two buckets' worth of working bytes) is never made.
        with torch.no_grad():
            for b in buckets if not self.masters_elsewhere else ():
                self._materialize([params[n] for n in b.names])
                lo, hi = self._range(b)
                if self.master:
                    self.shards.append(self._values(b, lo, hi - lo))
                    work = self._values(b, 0, b.padded, dtype=work_dtype) if zero < 3 else None
                    self._add_working(b, work)
                    self.work_shards.append(work[lo:hi] if work is not None else
                                            self._values(b, lo, hi - lo, dtype=work_dtype))
                    self._release(b)
                elif zero >= 3:
                    self.full.append(None)
                    self.shards.append(self._values(b, lo, hi - lo))
                    self._release(b)
                else:
                    flat = self._flatten(b)
                    self.full.append(flat)
                    self.shards.append(flat[lo:hi])  # a view: the optimizer updates in place
                    self._point_into(b, flat)
        if gather_group is not None:
            # Gathers left in flight when the engine is dropped (or the process exits) are waited
            # for: the collective registry would otherwise keep the buckets alive and warn at exit.
            weakref.finalize(self, _wait_all, list(self.full))

    def offload_working(self, root: str | None, name: str, link: DeviceLink | None = None) -> ParameterFiles:
        """Parameter offload: the working shards move to files under `root` (their tensors keep
        shape and dtype, hold no memory); every later write of a working shard goes there. With a
        `link` (a device's host tier) and `root` None they move to pinned host memory instead."""
        if self.zero != 3 or not self.master:
            raise FxspeedError("parameter offload moves ZeRO-3's low-precision working shards; this layout is "
                               f"ZeRO-{self.zero}{' with master weights' if self.master else ' without master weights'}")
        self.files = ParameterFiles(self.work_shards, root, name=name, link=link)
        # masters elsewhere: the shards are still empty; fill() writes them
        self.files.offload(write=not self.masters_elsewhere)
        return self.files

    def _set_working_shard(self, k: int, values: torch.Tensor) -> None:
        """Bucket k's working shard := values (rounded to the working dtype)."""
        if self.files is not None:
            self.files.write(k, values)
        else:
            self.work_shards[k].copy_(values)

    def _add_working(self, b: Bucket, work: torch.Tensor | None) -> None:
        self.full.append(work)
        if work is not None:
            for name, shape, off in zip(b.names, b.shapes, b.offsets):
                self._working[name] = work[off:off + _numel(shape)].view(shape)

    @torch.no_grad()
    def fill(self, store: MasterStore) -> None:
        """masters_elsewhere: the working buckets from the Parameters, the masters into `store`,
        one bucket at a time (each bucket's Parameters are released as soon as it is done)."""
        self.store = store
        for k, b in enumerate(self.buckets):
            self._materialize([self.params[n] for n in b.names])
            self._write_from_parameters(k)
            self._release(b)

    def master_shard(self, k: int) -> torch.Tensor:
        """Bucket k's fp32 master shard (a copy read from the store when it lives there)."""
        return self.shards[k] if self.store is None else self.store.read_master(self.work_shards[k])

    def _flatten(self, b: Bucket, grads: bool = False) -> torch.Tensor:
        """A new padded flat buffer holding the bucket's parameters' current values (or, with
        `grads`, their .grad)."""
        return self._values(b, 0, b.padded, grads=grads)

    def _values(self, b: Bucket, start: int, count: int, *, dtype: torch.dtype | None = None,
                out: torch.Tensor | None = None, grads: bool = False) -> torch.Tensor:
        """Elements start..start+count of bucket b's flat layout, read from its Parameters (or, with
        `grads`, their .grad), zero in the padding: a new tensor in `dtype` (default the Parameters'),
        or written into `out` (which may be a view the Parameters point into: only the padding is
        zeroed)."""
        p0 = self.params[b.names[0]]
        if out is None:
            out = torch.zeros(count, dtype=dtype or p0.dtype, device=p0.device)
        end, filled = start + count, start
        for name, shape, off in sorted(zip(b.names, b.shapes, b.offsets), key=lambda e: e[2]):
            lo, hi = max(off, start), min(off + _numel(shape), end)
            if lo >= hi:
                continue
            out[filled - start:lo - start].zero_()
            t = self.params[name].grad if grads else self.params[name]
            out[lo - start:hi - start].copy_(_flat_range(t, lo - off, hi - off))
            filled = hi
        out[filled - start:].zero_()
        return out

    def _write_from_parameters(self, k: int) -> None:
        """Bucket k's master (here or in the store) and working copy := its Parameters' values,
        without a full flat copy of the bucket (the store takes the master a chunk's piece at a time)."""
        b = self.buckets[k]
        lo, hi = self._range(b)
        if self.store is not None:
            self.store.write_master(self.work_shards[k], lambda s, n: self._values(b, lo + s, n))
        elif self.master or self.full[k] is None:  # a shard of its own, not a view of the full bucket
            self._values(b, lo, hi - lo, out=self.shards[k])
        if self.full[k] is not None:   # zero 0-2: the whole (working) bucket
            self._values(b, 0, b.padded, out=self.full[k])
        elif self.master:              # zero 3: this rank's working shard
            if self.files is not None:
                self._set_working_shard(k, self._values(b, lo, hi - lo, dtype=self.work_dtype))
            else:
                self._values(b, lo, hi - lo, out=self.work_shards[k])

    def flat_grads(self, k: int) -> torch.Tensor:
        """Bucket k's parameter gradients (.grad, set by the caller) in the bucket's flat layout."""
        return self._flatten(self.buckets[k], grads=True)

    def _range(self, b: Bucket) -> tuple[int, int]:
        s = b.shard_size(self.world)
        return self.rank * s, (self.rank + 1) * s

    def _point_into(self, b: Bucket, flat: torch.Tensor) -> None:
        for name, shape, off in zip(b.names, b.shapes, b.offsets):
            self.params[name].data = flat[off:off + _numel(shape)].view(shape)

    def _release(self, b: Bucket) -> None:
        for name in b.names:
            p = self.params[name]
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._versions[name] = _stamp(p)

    def edited_outside(self) -> tuple[list[str], list[str]]:
        """(lost, repointed): Parameters the user changed since the engine laid them out, in ways
        the layout does not see. `lost`: released ones (0-size between steps) written in place
        (`p.mul_(0)`, `nn.init.zeros_(p)`: the write touched no element) or given values by
        `p.data = t` (the programs read the shards). `repointed`: ZeRO-1/2 Parameters, views into
        their full buckets, re-pointed by `p.data = t` (torch's vector_to_parameters): the
        optimizer would go on stepping the bucket while the Parameter held the new tensor."""
        lost: list[str] = []
        repointed: list[str] = []
        for k, b in enumerate(self.buckets):
            full = None if self.released else self.full[k].untyped_storage().data_ptr()
            for name in b.names:
                p = self.params[name]
                if full is None and (p.numel() != 0 or _stamp(p) != self._versions.get(name)):
                    lost.append(name)
                elif full is not None and p.untyped_storage().data_ptr() != full:
                    repointed.append(name)
        return lost, repointed

    def remember_versions(self) -> None:
        """Released Parameters: the engine wrote them itself (a load through the module's own
        load_state_dict, into full-size copies): not writes `edited_outside` should report."""
        if self.released:
            for b in self.buckets:
                for name in b.names:
                    self._versions[name] = _stamp(self.params[name])

    def forget_edits(self) -> None:
        """Released Parameters: take their state as they are now (0-size) as the engine's again."""
        for b in self.buckets:
            self._release(b)

    @torch.no_grad()
    def adopt(self, names: list[str]) -> None:
        """Re-pointed Parameters (`edited_outside`): their values go into their bucket, and they
        point into it again, as an in-place write would have left them."""
        self.wait_gathers()
        for k, b in enumerate(self.buckets):
            for name, shape, off in zip(b.names, b.shapes, b.offsets):
                if name in names:
                    p, view = self.params[name], self.full[k][off:off + _numel(shape)].view(shape)
                    if p.shape != view.shape:
                        raise FxspeedError(f"parameter {name} was given a tensor of shape {tuple(p.shape)} through "
                                           f"`.data` after compile; it is {tuple(view.shape)}. Compile a new engine "
                                           "to change a parameter's shape")
                    view.copy_(p.detach())
                    p.data = view

    # --- what the optimizer steps -----------------------------------------------------------
    def optimizer_tensors(self) -> list[torch.Tensor]:
        """Every bucket's optimizer tensors, in bucket order."""
        return [t for k in range(len(self.buckets)) for t in self.bucket_tensors(k)]

    def bucket_tensors(self, k: int) -> list[torch.Tensor]:
        """The optimizer tensors bucket k's gradients go to (set_grads): this rank's shard of it,
        or under ZeRO-0 its Parameters themselves (views into the full buckets), with gradients
        that are views into the reduced buckets: the optimizer sees what it sees under DDP.
        why: docs/decisions/zero0-optimizer-over-parameter-views.md"""
        if self.zero == 0:
            return [self.params[n] for n in self.buckets[k].names]
        return [self.shards[k]]

    def grad_buffer(self, k: int) -> torch.Tensor:
        """Bucket k's persistent gradient buffer (ZeRO-0), which the program flattens into and
        reduces in place every step, as DDP reuses its buckets (why:
        docs/decisions/persistent-gradient-buckets-for-zero0.md). Under a pipeline, the bucket the
        engine reduces a stage's gradients into. Zero-filled once, so the padding stays zero."""
        if k not in self.grad_buffers:
            b, ref = self.buckets[k], self.shards[k]
            self.grad_buffers[k] = torch.zeros(b.padded, dtype=getattr(torch, b.dtype), device=ref.device)
        return self.grad_buffers[k]

    def set_grads(self, reduced: dict[int, torch.Tensor]) -> None:
        """Attach reduced buckets as .grad of the optimizer tensors. A bucket is either full
        (ZeRO-0/1 graphs, a pipeline's reduction) or already this rank's shard (ZeRO-2/3
        graphs); under ZeRO-1/2/3 a full one gives up a copy of this rank's shard.

        Consumes `reduced`: each full bucket is dropped as soon as its shard is copied out, so
        at most one extra bucket is alive (when the caller holds no other reference)."""
        while reduced:
            k, t = reduced.popitem()
            b = self.buckets[k]
            if self.zero == 0:
                for name, shape, off in zip(b.names, b.shapes, b.offsets):
                    self.params[name].grad = t[off:off + _numel(shape)].view(shape)
            elif t.numel() == b.padded and self.world > 1:
                lo, hi = self._range(b)
                # keep only our shard (in the master's dtype); the full bucket dies
                self.shards[k].grad = t[lo:hi].to(self.shards[k].dtype, copy=True)
            else:
                # a working-precision shard -> fp32 (masters here), or kept as it is (masters in
                # the store: the optimizer upcasts it one chunk at a time)
                self.shards[k].grad = t.to(self.shards[k].dtype)
            del t

    def clear_grads(self) -> None:
        for t in self.optimizer_tensors():
            t.grad = None

    def after_step(self, defer: bool = False) -> None:
        """ZeRO-1/2: every rank updated its shard; gather them so all ranks hold full weights.

        defer=True (the next program waits for the gathers, see passes/wait_parameter_gathers):

            before:  step -> gather b0, b1, ... (wait for all) -> return      | next forward
            after:   step -> issue gather b0, b1, ... -> return               | next forward:
                                                          wait(b0) before b0's first use, ...

        Each bucket is gathered in place (its shard is a view of the full bucket), so nothing is
        copied; the functional collective registers the work against the bucket's storage, where
        `wait_tensor` on any of its Parameters finds it. Until then the full buckets hold other
        ranks' old values: call wait_gathers() before reading them.
        why: docs/decisions/defer-parameter-gathers.md"""
        if self.master and self.store is None:
            with torch.no_grad():  # the rounded new weights: what the next step computes with
                if self.files is None:
                    torch._foreach_copy_(self.work_shards, self.shards)
                else:
                    for k, master in enumerate(self.shards):
                        self._set_working_shard(k, master)
        if self.zero not in (1, 2) or self.world == 1:
            return
        if defer and self.gather_group is not None:
            name = self.gather_group.group_name
            gather = exchange_gather_out if self.exchange else _c10d.all_gather_into_tensor_out
            for k in range(len(self.buckets)):
                gather(self.work_shards[k], self.world, name, out=self.full[k])
            self.in_flight = True
            # The Parameters are views into the buckets being gathered; an in-place write through
            # one bumps its own version (the gathers write the buckets, not the Parameters).
            # (Released Parameters hold nothing: a write to them is `edited_outside`'s.)
            self._issued = {} if self.released else {n: self.params[n]._version for b in self.buckets for n in b.names}
            return
        if self.exchange:
            # The shard is this rank's slot of the full bucket: the sends read it in place while the
            # receives fill the other slots, so every bucket can be in flight at once.
            name = self.group.group_name
            for k in range(len(self.buckets)):
                exchange_gather_out(self.work_shards[k], self.world, name, out=self.full[k])
            for f in self.full:
                _c10d.wait_tensor(f)
            return
        # At most two gathers in flight: each needs a private copy of the shard (the shard is
        # a view into the output buffer), and copies of every bucket at once would cost 1/N
        # of the model.
        pending = None
        for k in range(len(self.buckets)):
            work = _all_gather(self.full[k], self.work_shards[k].clone(), group=self.group, async_op=True)
            if pending is not None:
                pending.wait()
            pending = work
        if pending is not None:
            pending.wait()

    def raced_writes(self) -> list[str]:
        """Parameters written in place while the deferred gathers were in flight: the other
        ranks' slices may land over the write, on some ranks and not others."""
        if not self.in_flight:
            return []
        return [n for n, v in self._issued.items() if self.params[n]._version != v]

    def wait_gathers(self) -> None:
        """Finish deferred gathers still in flight (a no-op for those the program waited for)."""
        if not self.in_flight:
            return
        for f in self.full:
            _c10d.wait_tensor(f)
        self.in_flight = False

    # --- state -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """ZeRO-3 and master weights: temporarily materialize full fp32 parameters (for retracing,
        eval or exporting)."""
        if not self.released:
            yield
            return
        for b, flat in zip(self.buckets, self.gather_full()):
            self._point_into(b, flat)
        try:
            yield
        finally:
            for b in self.buckets:
                self._release(b)

    def gather_bucket(self, k: int) -> None:
        """ZeRO-3 (no master weights): bucket k's Parameters point at its whole gathered weights
        (collective over the group) until release_bucket(k)."""
        if self.zero != 3 or self.master:
            raise FxspeedError(f"gather_bucket is ZeRO-3's without master weights; this layout is ZeRO-{self.zero}")
        flat = torch.empty(self.buckets[k].padded, dtype=self.shards[k].dtype, device=self.shards[k].device)
        gather_into(flat, self.shards[k], self.group, self.world)
        self._point_into(self.buckets[k], flat)

    def release_bucket(self, k: int) -> None:
        """Bucket k's Parameters hold nothing again (its shard stays)."""
        self._release(self.buckets[k])

    def gather_full(self) -> list[torch.Tensor]:
        """Every bucket's full fp32 weights (gathered masters or zero-3 shards: collective)."""
        if not self.released:
            return [f for f in self.full]  # type: ignore[misc]
        out = []
        for k, b in enumerate(self.buckets):
            mine = self.master_shard(k)
            flat = torch.empty(b.padded, dtype=mine.dtype, device=mine.device)
            gather_into(flat, mine, self.group, self.world)
            out.append(flat)
        return out

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full, unsharded parameters under their canonical names (collective under ZeRO-3)."""
        flats = self.gather_full()
        state = {}
        for b, flat in zip(self.buckets, flats):
            for name, shape, off in zip(b.names, b.shapes, b.offsets):
                state[name] = flat[off:off + _numel(shape)].view(shape).clone()
        return state

    def working(self, name: str) -> torch.Tensor | None:
        """The working copy of parameter `name` (a view into its working bucket) that a program
        with master weights reads; None when there is none (zero 3, frozen, not master)."""
        return self._working.get(name)

    def owns(self, name: str) -> bool:
        return any(name in b.names for b in self.buckets)

    def capture_from_parameters(self) -> None:
        """Re-read the (gathered) Parameters into this rank's shards, e.g. after load_state_dict."""
        with torch.no_grad():
            for k in range(len(self.buckets)):
                self._write_from_parameters(k)


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (same arguments); 2.11 has
# only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_into(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, world: int) -> None:
    """All-gather `shard` from every rank into `out`; on one rank, a copy (no process group needed)."""
    if world == 1:
        out.copy_(shard.reshape(-1))
    else:
        _all_gather(out, shard, group=group)
_c10d = torch.ops._c10d_functional


def _wait_all(tensors: list[torch.Tensor | None]) -> None:
    for t in tensors:
        if t is not None:
            _c10d.wait_tensor(t)


def _stamp(p: torch.Tensor) -> tuple[int, int]:
    """What tells a write to a released Parameter: `.data =` keeps the version counter and
    in-place writes bump it; `.data =` of another 0-size tensor (torch's vector_to_parameters
    given these Parameters) points it at another storage."""
    return p._version, p.untyped_storage().data_ptr()


def _flat_range(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Elements a..b of `t` in flat (row-major) order. A non-contiguous tensor (transposed,
    channels_last) is copied only in the rows of its first dimension that hold them: a store asks
    for a master one piece at a time, and a whole copy per piece cost a full copy of the
    Parameter each time (a transposed 4096 x 8192 one took 0.98 s to lay out, 0.11 s contiguous)."""
    if t.is_contiguous() or t.dim() == 0:
        return t.reshape(-1)[a:b]
    row = t[0].numel()
    r0, r1 = a // row, -(-b // row)
    return t[r0:r1].reshape(-1)[a - r0 * row:b - r0 * row]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
