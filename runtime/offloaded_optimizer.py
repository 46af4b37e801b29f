"""Adam/AdamW with its states in a swap file: optimizer offload (ZeRO-Offload's idea, ZeRO-
Infinity's NVMe tier).

The first and second moments (8 of the 16 bytes per fp32 parameter that Adam training holds)
live in a `SwapFile`; host memory keeps three staging slots. The tensors the optimizer steps are
cut into chunks of about `chunk_bytes` of states, and a step is a pipeline over them:

    read states k+1      |  step chunk k (torch's fused Adam)  |  write states k-1

so the disk works while the CPU computes. The reads of the first two chunks start at the top of
the next `train_step` (`prefetch`), overlapping forward and backward. The update is torch's own
fused Adam kernel, elementwise, so chunking changes nothing: the result is bit for bit that of
`torch.optim.AdamW(fused=True)` over the same tensors.

`state_dict()` / `load_state_dict()` read and write the moments through the file, so
checkpoints hold the same keys as torch.optim's (`step`, `exp_avg`, `exp_avg_sq`), and the
param groups torch's AdamW(fused=True) flags (`fused`, `amsgrad`, ...): either loads into the other.

With `masters=True` (master weights, ZeRO-Offload's layout) the tensors it is given are the
low-precision *working* shards the program reads, and their fp32 masters live in the file too,
in front of the moments: a chunk is [master | exp_avg | exp_avg_sq], 12 bytes per parameter. A
chunk's step upcasts the working-precision gradients into an fp32 scratch (times the engine's
`grad_factors`: fp16's 1/scale, the clip coefficient, applied in that order as the in-memory
path does), runs the same fused Adam on the master, and rounds the new master into the working
shard. Host memory then holds 2 + 2 bytes per parameter (working copy, gradient) and the staging
slots. The masters are read and written as a `MasterStore` (runtime/flat_parameters.py):
`write_master` / `read_master`. With parameter offload the working shards live in files too:
`working_sink` takes each rounded piece instead of the working tensor.

On a CUDA device (`link`, runtime/host_tier.py) the tensors it is given live on the device and
the step runs on the host: per chunk, the gradients (and, without masters, the fp32 weights:
read each step, so the device copy stays the one the engine and the user write) are copied into
pinned staging buffers on a side stream, the next chunk's copy starting while this one steps,
and the new (masters: rounded) weights are copied back. The states stay in pinned host memory
(every chunk resident, no file: offload_device="cpu") or in files as above ("nvme"). The same
fused CPU kernel over the same values: bit for bit the files tier's result.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.optim.adam import adam as adam_update

from fxspeed.errors import FxspeedError
from fxspeed.ir import is_dense
from fxspeed.runtime.host_tier import DeviceLink
from fxspeed.runtime.offload_io import AlignedBuffer, SwapFile, round_up

SLOTS = 3  # read k+1, step k, write k-1
_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, eq=False)
class _Piece:
    """A tensor, or a run of a contiguous tensor's elements (a tensor larger than a chunk is cut
    into chunk-sized runs, so a staging slot never has to hold more than a chunk)."""
    p: torch.Tensor
    off: int        # element offset within each section of its chunk
    start: int      # first element of p (flat order)
    count: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.count == self.p.numel()

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of `t`, a tensor in p's layout (p itself, its gradient)."""
        return t if self.whole else t.view(-1)[self.start:self.start + self.count]

    def of_full(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of `t`, a tensor of p's shape in any layout (a saved state), for reading."""
        return t if self.whole else t.reshape(-1)[self.start:self.start + self.count]


@dataclass(eq=False)
class _Staging:
    """The host tier's staging of one chunk: its gradients and weights in host memory (flat, the
    chunk's element layout), the chunk they hold, and the copies in and out in flight."""
    grads: torch.Tensor
    weights: torch.Tensor
    chunk: "_Chunk | None" = None
    copied_in: Any = None
    copied_out: Any = None


@dataclass(frozen=True, eq=False)
class _Chunk:
    pieces: tuple[_Piece, ...]
    numel: int                    # elements per section
    file_offset: int              # bytes
    sections: int = 2             # [exp_avg | exp_avg_sq], or [master | exp_avg | exp_avg_sq]

    @property
    def nbytes(self) -> int:
        return self.sections * self.numel * 4

    def view(self, flat: torch.Tensor, section: int, pc: _Piece) -> torch.Tensor:
        base = section * self.numel + pc.off
        if pc.whole:
            # In the parameter's own strides: the fused kernel pairs elements by memory position.
            return flat.as_strided(pc.p.shape, pc.p.stride(), base)
        return flat[base:base + pc.count]  # a run of a contiguous tensor: flat order


class OffloadedAdam(torch.optim.Optimizer):
    """torch.optim.Adam / AdamW (`decoupled`) whose moments (and with `masters`, fp32 master
    weights of the given working tensors) live in files under `swap_root`."""

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, decoupled: bool, swap_root: str | os.PathLike | None, name: str,
                 chunk_bytes: int = 64 * 2**20, offload_bytes: int | None = None, masters: bool = False,
                 chunk_starts: Sequence[int] = (), link: DeviceLink | None = None, decay: Any = None) -> None:
        """`chunk_starts`: indices of tensors that begin a new chunk (the first of each gradient
        bucket the program steps on its own: a chunk shared by two buckets would be read and
        written once for each).

        `link` (the host tier, runtime/host_tier.py): the tensors live on `link.device` and the
        step runs on the host: each chunk's gradients (and, without `masters`, its weights) are
        copied to staging host buffers, stepped there, and the new weights copied back. With
        `swap_root=None` every chunk's states stay in (pinned) host memory; with a `swap_root`
        the offloaded chunks go to files as on the CPU.

        `decay` (runtime/optimizer.WeightDecay, Config.no_weight_decay): the weight decay of the
        elements it names, applied to each chunk's weights (the fp32 masters with `masters`) or
        gradients just before its update; `weight_decay` must then be 0."""
        # torch's Adam/AdamW group settings too, as its fused kernel runs them: state_dict() then
        # loads into torch.optim.AdamW(fused=True) as one of its own (a group without `fused` made
        # it fall back to its foreach kernel, which rounds differently)
        super().__init__(list(params), dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                            **_torch_flags(decoupled)))
        self.decoupled = decoupled
        self.decay = decay
        if decay is not None and weight_decay:
            raise FxspeedError("the offloaded optimizer takes weight_decay or a per-element decay, not both")
        self.masters = masters
        # masters: where the rounded new working values go instead of the working tensor itself,
        # as (tensor, first element, values) per piece (parameter offload: ParameterFiles.write_piece)
        self.working_sink: Callable[[torch.Tensor, int, torch.Tensor], None] | None = None
        self.link = link
        tensors = [p for g in self.param_groups for p in g["params"]]
        want = (torch.bfloat16, torch.float16) if masters else (torch.float32,)
        where = link.device.type if link is not None else "cpu"
        if swap_root is None and link is None:
            raise FxspeedError("the offloaded optimizer keeps its states in files (swap_root) or, on a device, in "
                               "host memory (link); it was given neither")
        for i, p in enumerate(tensors):
            if p.dtype not in want or p.device.type != where or p.dtype != tensors[0].dtype:
                raise FxspeedError(f"optimizer offload steps {'bf16/fp16 working' if masters else 'fp32'} tensors of "
                                   f"one dtype on the {where} device; tensor {i} is {p.dtype} on {p.device} (tensor 0: "
                                   f"{tensors[0].dtype}); please report this with the model and Config")
            if not is_dense(p):
                raise FxspeedError(f"optimizer offload needs dense tensors; tensor {i} of shape {tuple(p.shape)} has "
                                   f"strides {p.stride()} with gaps")
            # torch's fused Adam reads a float32 step tensor; kept in memory (4 bytes a tensor)
            self.state[p] = _StepOnly(step=torch.tensor(0.0, dtype=torch.float32))
        chunks = _chunks(tensors, chunk_bytes, sections=3 if masters else 2, starts=set(chunk_starts))
        # The first chunks go off the device until `offload_bytes` are there (the plan's choice
        # under Config.memory_budget_gb; None: all of them): to the file with a swap_root, else
        # (the host tier) to pinned host memory. The rest stay where the tensors are: in memory on
        # the CPU, on the device with a link (stepped there by the same fused Adam, no staging),
        # so the device holds what the plan counted. Offloaded first: their reads are the ones
        # prefetched during forward, and their writes overlap the resident chunks' updates.
        n_off, moved = 0, 0
        while n_off < len(chunks) and (offload_bytes is None or moved < offload_bytes):
            moved += chunks[n_off].nbytes
            n_off += 1
        to_file, to_host = (chunks[:n_off], []) if swap_root is not None else ([], chunks[:n_off])
        self._chunks = _place(to_file)
        self._resident = ([(c, self._host_zeros(c.sections * c.numel)) for c in to_host]
                          + [(c, self._home_zeros(c.sections * c.numel)) for c in chunks[n_off:]])
        # chunks whose states sit on the device beside their tensors (ids: chunks hold tensors)
        self._device_homed = {id(c) for c in chunks[n_off:]} if link is not None else set()
        size = sum(round_up(c.nbytes) for c in self._chunks)
        self.swap = SwapFile(swap_root, size, name=name) if swap_root is not None else None
        biggest = max((c.nbytes for c in self._chunks), default=0)
        self._slots = [AlignedBuffer(biggest) for _ in range(min(SLOTS, len(self._chunks)))]
        self._offloaded = set(self._chunks)
        # tensor -> its pieces, each with its chunk's index in _each_chunk()
        self._where: dict[int, list[tuple[int, _Piece]]] = {}
        for i, (c, _) in enumerate(self._each_chunk()):
            for pc in c.pieces:
                self._where.setdefault(id(pc.p), []).append((i, pc))
        # The fused kernel counts a step on every tensor it is given: each later piece of a cut
        # tensor keeps its own counter (equal to the tensor's, which the first piece uses).
        self._piece_steps: dict[tuple[int, int], torch.Tensor] = {
            (id(pc.p), pc.start): torch.tensor(0.0, dtype=torch.float32)
            for pieces in self._where.values() for _, pc in pieces if pc.start > 0}
        self._reads: dict[int, Future] = {}      # chunk -> read in flight into slot chunk % SLOTS
        self._writes: dict[int, Future] = {}     # slot -> write in flight from it
        self._on_disk: set[_Chunk] = set()       # chunks whose file region holds their states (else zeros)
        # fp32 gradients of one chunk (masters: the working-precision gradients are upcast here)
        # (without a link the host steps every chunk; with one, those it holds)
        on_host = chunks[:n_off] if link is not None else chunks
        self._scratch = torch.empty(max((c.numel for c in on_host), default=0) if masters else 0)
        # ... and of a chunk stepped on the device
        self._device_scratch = self._home_zeros(max((c.numel for c in chunks[n_off:]), default=0)) \
            if masters and link is not None else None
        # The host tier: two staging sets of a chunk's gradients and weights in the tensors' dtype
        # (chunk k+1's copy in fills one while chunk k steps from the other and its new weights go
        # back out), pinned on a CUDA device.
        biggest_numel = max((c.numel for c in on_host), default=0)
        self._staging = [_Staging(link.empty(biggest_numel, tensors[0].dtype), link.empty(biggest_numel, tensors[0].dtype))
                         for _ in range(2)] if link is not None and tensors else []
        self._next_staging = 0
        self.stats = {"chunks": len(self._chunks), "resident_chunks": len(self._resident), "swap_bytes": size,
                      "offloaded_bytes": moved, "direct_io": self.swap is not None and self.swap.direct,
                      "masters": masters, "host_tier": link is not None,
                      "host_bytes": sum(c.nbytes for c in to_host),
                      "device_bytes": sum(c.nbytes for c in chunks[n_off:]) if link is not None else 0}

    def _host_zeros(self, numel: int) -> torch.Tensor:
        """A host-held chunk's states: host memory (pinned when a link reaches a CUDA device)."""
        if self.link is None:
            return torch.zeros(numel)
        return self.link.empty(numel, torch.float32).zero_()

    def _home_zeros(self, numel: int) -> torch.Tensor:
        """A chunk's states kept beside its tensors: in memory, or on the link's device."""
        return torch.zeros(numel, device=self.link.device if self.link is not None else None)

    # --- the step ---------------------------------------------------------------------------
    def prefetch(self) -> None:
        """Start reading the first chunks' states (call before forward: the reads overlap it)."""
        for k in range(min(len(self._slots) - 1, len(self._chunks))):
            self._start_read(k)

    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_factors: Sequence[torch.Tensor | float] = (),
             only: Sequence[torch.Tensor] | None = None) -> None:
        """One Adam step over every chunk. `grad_factors` (masters only): multipliers of the upcast
        gradients, in order (the caller did not scale the working-precision gradients in place).

        `only`: step just these tensors (those with a gradient among them): the chunks holding
        their pieces, in file order, the read of the chunk after the last one left in flight.
        Called per gradient bucket inside backward (runtime/step_in_backward.py), buckets in the
        order of the tensors: the disk then reads bucket k+1's states while backward computes and
        writes bucket k's while the next bucket steps. A chunk shared by two buckets is read and
        written once for each (its pieces without a gradient are left as they are)."""
        if closure is not None:
            raise FxspeedError("the offloaded optimizer takes no closure")
        if grad_factors and not self.masters:
            raise FxspeedError("grad_factors apply to working-precision gradients (masters=True); scale fp32 "
                               "gradients in place")
        n = len(self._chunks)
        if only is None:
            self._step_chunks(range(n), self._resident, grad_factors)
            return
        wanted = sorted({i for t in only for i, _ in self._where.get(id(t), ())})
        self._step_chunks([i for i in wanted if i < n], [self._resident[i - n] for i in wanted if i >= n], grad_factors)

    def _step_chunks(self, offloaded: Iterable[int], resident: Iterable[tuple[_Chunk, torch.Tensor]],
                     grad_factors: Sequence[torch.Tensor | float]) -> None:
        group = self.param_groups[0]
        n = len(self._chunks)
        offloaded, resident = list(offloaded), list(resident)
        for st in self._staging:  # nothing staged survives a call (one that raised left its chunk)
            st.chunk = None
        # the host tier copies the next chunk's gradients in while this one steps
        order = [self._chunks[k] for k in offloaded] + [c for c, _ in resident]
        for i, k in enumerate(offloaded):
            chunk = self._chunks[k]
            if k + 1 < n:
                self._start_read(k + 1)
            slot = self._wait_read(k)
            self._update(group, chunk, slot.tensor, grad_factors, ahead=order[i + 1] if i + 1 < len(order) else None)
            self._writes[k % SLOTS] = self.swap.write(chunk.file_offset, slot, chunk.nbytes)
            self._on_disk.add(chunk)
        for i, (chunk, buf) in enumerate(resident, start=len(offloaded)):
            self._update(group, chunk, buf, grad_factors, ahead=order[i + 1] if i + 1 < len(order) else None)

    def _update(self, group: dict, chunk: _Chunk, flat: torch.Tensor, factors: Sequence[torch.Tensor | float],
                ahead: _Chunk | None = None) -> None:
        live = [pc for pc in chunk.pieces if pc.p.grad is not None]
        if not live:
            return
        staged = None
        here = id(chunk) in self._device_homed  # stepped on the device, in place
        if self.link is not None and not here:  # the host tier: this chunk's copies in, the next one's started
            staged = self._stage_in(chunk, live)
            if ahead is not None and id(ahead) not in self._device_homed:
                later = [pc for pc in ahead.pieces if pc.p.grad is not None]
                if later:
                    self._stage_in(ahead, later)
            self.link.wait(staged.copied_in)
        beta1, beta2 = group["betas"]
        first = 1 if self.masters else 0  # section of exp_avg
        m = [chunk.view(flat, first, pc) for pc in live]
        v = [chunk.view(flat, first + 1, pc) for pc in live]
        if self.masters:
            weights = [chunk.view(flat, 0, pc) for pc in live]
            scratch = self._device_scratch if here else self._scratch
            grads = [chunk.view(scratch, 0, pc).copy_(pc.of(pc.p.grad) if staged is None else
                                                             chunk.view(staged.grads, 0, pc)) for pc in live]
            for f in factors:  # as the in-memory path scales its fp32 gradients: one factor at a time
                torch._foreach_mul_(grads, f)
        elif staged is not None:  # fp32 on a device: the weights and gradients copied in
            weights = [chunk.view(staged.weights, 0, pc) for pc in live]
            grads = [chunk.view(staged.grads, 0, pc) for pc in live]
        else:
            weights, grads = [pc.of(pc.p) for pc in live], [pc.of(pc.p.grad) for pc in live]
        steps = [self._step_of(pc) for pc in live]
        # the fused kernel reads (and counts) its step on the tensors' device; the counters stay
        # on the host (state_dict, the chunks stepped there), advanced alongside
        moved_steps = [t.to(flat.device, copy=True) for t in steps] if flat.device != steps[0].device else steps
        if self.decay is not None:
            self.decay.apply([(pc.p, w, g, pc.start, pc.count) for pc, w, g in zip(live, weights, grads)], group["lr"])
        adam_update(weights, grads, m, v, [], moved_steps, fused=True,
                    decoupled_weight_decay=self.decoupled, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        if moved_steps is not steps:
            torch._foreach_add_(steps, 1.0)
        if self.masters and self.working_sink is not None:  # the working shards live in files (or host memory)
            for pc, w in zip(live, weights):
                self.working_sink(pc.p, pc.start, w)
        elif staged is not None:  # the new weights back to the device (masters: rounded on the host first)
            if self.masters:
                torch._foreach_copy_([chunk.view(staged.weights, 0, pc) for pc in live], weights)
            staged.copied_out = self.link.to_device([(pc.of(pc.p), chunk.view(staged.weights, 0, pc)) for pc in live])
        elif self.masters:  # the rounded new weights: what the next step computes with
            torch._foreach_copy_([pc.of(pc.p) for pc in live], weights)
        if staged is not None:
            staged.chunk = None

    def _stage_in(self, chunk: _Chunk, live: list[_Piece]) -> "_Staging":
        """The host tier: the staging set holding `chunk`'s gradients (and, without masters, its
        weights), their copy from the device started if it was not already."""
        for st in self._staging:
            if st.chunk is chunk:
                return st
        st = self._staging[self._next_staging]
        self._next_staging = (self._next_staging + 1) % len(self._staging)
        self.link.wait(st.copied_out)  # its last chunk's new weights have left for the device
        st.copied_out = None
        st.chunk = chunk
        pairs = [(chunk.view(st.grads, 0, pc), pc.of(pc.p.grad)) for pc in live]
        if not self.masters:
            pairs += [(chunk.view(st.weights, 0, pc), pc.of(pc.p)) for pc in live]
        st.copied_in = self.link.to_host(pairs)
        return st

    def _step_of(self, pc: _Piece) -> torch.Tensor:
        return self.state[pc.p]["step"] if pc.start == 0 else self._piece_steps[(id(pc.p), pc.start)]

    def _start_read(self, k: int) -> None:
        if k in self._reads:
            return
        s = k % SLOTS
        self._finish_write(s)  # the slot's previous chunk must be on disk before it is overwritten
        for j in [j for j in self._reads if j % SLOTS == s]:
            # A read ahead into the same slot that this order did not use (chunks stepped out of
            # file order): finished and dropped, never overwritten while in flight.
            self._reads.pop(j).result()
        chunk = self._chunks[k]
        if chunk in self._on_disk:
            self._reads[k] = self.swap.read(chunk.file_offset, self._slots[s], chunk.nbytes)
        else:  # never written: the states are zeros
            self._slots[s].tensor[:chunk.sections * chunk.numel].zero_()
            done: Future = Future()
            done.set_result(None)
            self._reads[k] = done

    def _wait_read(self, k: int) -> AlignedBuffer:
        self._start_read(k)
        self._reads.pop(k).result()
        return self._slots[k % SLOTS]

    def _finish_write(self, slot: int) -> None:
        w = self._writes.pop(slot, None)
        if w is not None:
            w.result()

    def synchronize(self) -> None:
        """Every write of the last step on disk (before reading the file another way, or closing)."""
        for s in list(self._writes):
            self._finish_write(s)

    def _drain(self) -> None:
        """No I/O in flight: writes on disk, prefetched reads finished and forgotten (the slots are
        about to be used for something else; the next step reads again)."""
        self.synchronize()
        for r in self._reads.values():
            r.result()
        self._reads.clear()
        for st in self._staging:  # the host tier: every copy of new weights to the device done
            self.link.wait(st.copied_out)
            st.copied_out = None

    # --- states through the file ----------------------------------------------------------
    def _each_chunk(self) -> list[tuple[_Chunk, torch.Tensor]]:
        """Every chunk with the tensor its states are (or are staged) in: offloaded ones through
        slot 0, resident ones in their own buffer."""
        return [(c, self._slots[0].tensor) for c in self._chunks] + list(self._resident)

    def _load(self, i: int) -> tuple[_Chunk, torch.Tensor]:
        """Chunk i of _each_chunk() with its states in memory (offloaded: read into slot 0, or zeroed
        if never written). Call _drain() first."""
        chunk, flat = self._each_chunk()[i]
        if chunk in self._offloaded:
            if chunk in self._on_disk:
                self.swap.read(chunk.file_offset, self._slots[0], chunk.nbytes).result()
            else:
                flat[:chunk.sections * chunk.numel].zero_()
        return chunk, flat

    def _store(self, chunk: _Chunk) -> None:
        """After changing a _load()ed chunk: an offloaded one goes back to its file region."""
        if chunk in self._offloaded:
            self.swap.write(chunk.file_offset, self._slots[0], chunk.nbytes).result()
            self._on_disk.add(chunk)

    def write_master(self, work: torch.Tensor, value: torch.Tensor | Callable[[int, int], torch.Tensor]) -> None:
        """masters: set the fp32 master of working tensor `work` (the working copy is the caller's).
        `value` is the whole master, or `value(start, count)` gives elements start..start+count of
        it (flat order), asked one chunk's piece at a time, so no full fp32 copy is ever built."""
        self._drain()
        if isinstance(value, torch.Tensor):
            whole = value.reshape(-1)
            value = lambda start, count: whole[start:start + count]  # noqa: E731 (the same, from a tensor)
        for i, pc in self._where[id(work)]:
            chunk, flat = self._load(i)
            dst = chunk.view(flat, 0, pc)
            dst.copy_(value(pc.start, pc.count).view(dst.shape))
            self._store(chunk)

    def read_master(self, work: torch.Tensor) -> torch.Tensor:
        """masters: a copy of the fp32 master of working tensor `work`."""
        self._drain()
        out = torch.empty(work.shape, dtype=torch.float32)
        for i, pc in self._where[id(work)]:
            chunk, flat = self._load(i)
            pc.of(out).copy_(chunk.view(flat, 0, pc))
        return out.to(work.device)  # the host tier: where the caller gathers it

    def full_state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Every tensor's state as torch.optim's AdamW holds it (step, exp_avg, exp_avg_sq): the
        moments read back from the file (a copy)."""
        self._drain()
        out: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        first = 1 if self.masters else 0
        for i in range(len(self._each_chunk())):
            chunk, flat = self._load(i)
            for pc in chunk.pieces:
                if pc.whole:  # a copy in host memory, whichever side the chunk lives on
                    out[pc.p] = {key: chunk.view(flat, section, pc).to("cpu", copy=True)
                                 for section, key in enumerate(_MOMENTS, start=first)}
                else:  # a cut tensor: assembled piece by piece, in p's (contiguous) layout
                    st = out.setdefault(pc.p, {key: torch.empty_like(pc.p, dtype=torch.float32, device="cpu")
                                               for key in _MOMENTS})
                    for section, key in enumerate(_MOMENTS, start=first):
                        pc.of(st[key]).copy_(chunk.view(flat, section, pc))
                out[pc.p]["step"] = self.state[pc.p]["step"].clone()
        return out

    def load_full_state(self, states: dict[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        """Write `states` (torch.optim AdamW layout, by tensor) into the file; tensors absent keep a
        zero state (as a fresh optimizer has). Masters are kept as they are."""
        self._drain()
        first = 1 if self.masters else 0
        for i in range(len(self._each_chunk())):
            chunk, flat = self._load(i)
            flat[first * chunk.numel:chunk.sections * chunk.numel].zero_()
            for pc in chunk.pieces:
                st = states.get(pc.p, {})
                step = torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).clone()
                if pc.start == 0:
                    self.state[pc.p]["step"] = step
                else:
                    self._piece_steps[(id(pc.p), pc.start)] = step
                for section, key in enumerate(_MOMENTS, start=first):
                    if key in st:
                        chunk.view(flat, section, pc).copy_(pc.of_full(st[key]))
            self._store(chunk)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format, moments included (read from the file)."""
        full = self.full_state()
        saved, self.state = self.state, full  # type: ignore[assignment]
        try:
            return super().state_dict()
        finally:
            self.state = saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's format. torch's own load checks the groups and sets their options, but it
        casts every moment to its parameter's dtype: with bf16/fp16 working copies that rounded
        Adam's fp32 moments (fp16 flushed exp_avg_sq to 0, and the next step blew the weights
        up). The moments are taken from `state_dict` itself, mapped to tensors in the same order
        torch maps them."""
        unsupported = [f"{k}={g[k]!r}" for g in state_dict["param_groups"] for k in ("amsgrad", "maximize")
                       if g.get(k)]
        if unsupported:
            raise FxspeedError(f"the offloaded optimizer steps Adam/AdamW without amsgrad or maximize; this state_dict "
                               f"has {', '.join(sorted(set(unsupported)))}: load it into an engine without offload, or "
                               "drop those settings")
        keep = {p: _StepOnly(s) for p, s in self.state.items()}
        super().load_state_dict({**state_dict, "state": {}})  # (with the moments, a cast copy of each)
        for g in self.param_groups:  # the kernel this optimizer runs, whatever the saved one ran
            g.update(_torch_flags(self.decoupled))
        self.state.clear()
        self.state.update(keep)
        ours = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        saved = state_dict["state"]
        self.load_full_state({p: saved[i] for p, i in zip(ours, saved_ids) if i in saved})

    def close(self) -> None:
        """Finish I/O and remove the swap directory."""
        self._drain()
        if self.swap is not None:
            self.swap.close()


class _StepOnly(dict):
    """A tensor's `optimizer.state` entry: its step counter only (the moments live in the file, or
    the host tier). Reading a moment from it (`engine.optimizer.state[p]["exp_avg"]`, a DeepSpeed
    user's way to watch them) raised a bare KeyError('exp_avg'); it now says where they are."""

    def __missing__(self, key: str) -> Any:
        if key in _MOMENTS:
            raise KeyError(f"{key!r}: with Config.offload the Adam moments live off the optimizer's `state` (in the "
                           "offload file, or host memory); read them with engine.optimizer.state_dict()['state'] "
                           "(torch's format, a copy) or engine.save")
        raise KeyError(key)


def _torch_flags(decoupled: bool) -> dict[str, Any]:
    """torch.optim.Adam/AdamW's group flags for what OffloadedAdam runs: its fused kernel, no
    amsgrad, no maximize; decoupled weight decay for AdamW."""
    return dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=True,
                decoupled_weight_decay=decoupled)


def _place(chunks: list[_Chunk]) -> list[_Chunk]:
    """The chunks with their file regions, each starting page-aligned."""
    out, offset = [], 0
    for c in chunks:
        out.append(dataclasses.replace(c, file_offset=offset))
        offset += round_up(c.nbytes)
    return out


def _chunks(tensors: list[torch.Tensor], chunk_bytes: int, sections: int = 2, starts: set[int] = frozenset()
            ) -> list[_Chunk]:
    """Consecutive tensors grouped into chunks of at most `chunk_bytes` of states, `sections` fp32
    values per element. A contiguous tensor larger than a chunk is cut into chunk-sized runs (a
    flat ZeRO shard, a large embedding); another layout larger than a chunk is a chunk alone.
    Tensor i begins a new chunk when i is in `starts`."""
    cap = max(chunk_bytes // (4 * sections), 1)  # elements per chunk
    chunks: list[_Chunk] = []
    group: list[_Piece] = []
    total = 0

    def close() -> None:
        nonlocal group, total
        if group:
            chunks.append(_Chunk(tuple(group), total, 0, sections))
        group, total = [], 0

    for i, p in enumerate(tensors):
        n = p.numel()
        if group and (total + n > cap or i in starts):
            close()
        if n <= cap or not p.is_contiguous():
            group.append(_Piece(p, total, 0, n))
            total += n
            continue
        # Runs of a multiple of 64 elements: torch's fused CPU kernel works in cache-line-aligned
        # units of vectors with a scalar tail only at the end, so a run computes bit for bit what
        # the whole tensor would (a run of 2621 elements put 13 through the tail: 2e-9 apart).
        run = cap - cap % 64 if cap >= 64 else cap
        for start in range(0, n, run):  # the last run may share its chunk with the next tensors
            close()
            group.append(_Piece(p, 0, start, min(run, n - start)))
            total = group[0].count
    close()
    return chunks
