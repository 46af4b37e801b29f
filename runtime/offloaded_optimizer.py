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
checkpoints hold the same keys as torch.optim's (`step`, `exp_avg`, `exp_avg_sq`).

With `masters=True` (master weights, ZeRO-Offload's layout) the tensors it is given are the
low-precision *working* shards the program reads, and their fp32 masters live in the file too,
in front of the moments: a chunk is [master | exp_avg | exp_avg_sq], 12 bytes per parameter. A
chunk's step upcasts the working-precision gradients into an fp32 scratch (times the engine's
`grad_factors`: fp16's 1/scale, the clip coefficient, applied in that order as the in-memory
path does), runs the same fused Adam on the master, and rounds the new master into the working
shard. Host memory then holds 2 + 2 bytes per parameter (working copy, gradient) and the staging
slots. The masters are read and written as a `MasterStore` (runtime/flat_parameters.py):
`write_master` / `read_master`.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch.optim.adam import adam as adam_update

from fxspeed.errors import FxspeedError
from fxspeed.runtime.offload_io import AlignedBuffer, SwapFile, round_up

SLOTS = 3  # read k+1, step k, write k-1
_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, eq=False)
class _Chunk:
    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]      # element offset of each parameter within each section
    numel: int                    # elements per section
    file_offset: int              # bytes
    sections: int = 2             # [exp_avg | exp_avg_sq], or [master | exp_avg | exp_avg_sq]

    @property
    def nbytes(self) -> int:
        return self.sections * self.numel * 4

    def view(self, flat: torch.Tensor, section: int, p: torch.Tensor, off: int) -> torch.Tensor:
        # In the parameter's own strides: the fused kernel pairs elements by memory position.
        return flat.as_strided(p.shape, p.stride(), section * self.numel + off)


class OffloadedAdam(torch.optim.Optimizer):
    """torch.optim.Adam / AdamW (`decoupled`) whose moments (and with `masters`, fp32 master
    weights of the given working tensors) live in files under `swap_root`."""

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, decoupled: bool, swap_root: str | os.PathLike, name: str,
                 chunk_bytes: int = 64 * 2**20, offload_bytes: int | None = None, masters: bool = False) -> None:
        super().__init__(list(params), dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.decoupled = decoupled
        self.masters = masters
        tensors = [p for g in self.param_groups for p in g["params"]]
        want = (torch.bfloat16, torch.float16) if masters else (torch.float32,)
        for i, p in enumerate(tensors):
            if p.dtype not in want or p.device.type != "cpu":
                raise FxspeedError(f"optimizer offload steps {'bf16/fp16 working' if masters else 'fp32'} tensors in "
                                   f"host memory; tensor {i} is {p.dtype} on {p.device} (Config.offload='optimizer' "
                                   "needs parameters on the CPU in this version)")
            if not _dense(p):
                raise FxspeedError(f"optimizer offload needs dense tensors; tensor {i} of shape {tuple(p.shape)} has "
                                   f"strides {p.stride()} with gaps")
            # torch's fused Adam reads a float32 step tensor; kept in memory (4 bytes a tensor)
            self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32)}
        chunks = _chunks(tensors, chunk_bytes, sections=3 if masters else 2)
        # The first chunks go to the file until `offload_bytes` are there (the plan's choice under
        # Config.memory_budget_gb); the rest stay in memory. Offloaded first: their reads are the
        # ones prefetched during forward, and their writes overlap the resident chunks' updates.
        n_off, moved = 0, 0
        while n_off < len(chunks) and (offload_bytes is None or moved < offload_bytes):
            moved += chunks[n_off].nbytes
            n_off += 1
        self._chunks = _place(chunks[:n_off])
        self._resident = [(c, torch.zeros(c.sections * c.numel)) for c in chunks[n_off:]]
        size = sum(round_up(c.nbytes) for c in self._chunks)
        self.swap = SwapFile(swap_root, size, name=name)
        biggest = max((c.nbytes for c in self._chunks), default=0)
        self._slots = [AlignedBuffer(biggest) for _ in range(min(SLOTS, len(self._chunks)))]
        self._offloaded = set(self._chunks)
        # tensor -> (its chunk index in _each_chunk(), its offset in the chunk's sections)
        self._where = {id(p): (i, off) for i, (c, _) in enumerate(self._each_chunk())
                       for p, off in zip(c.params, c.offsets)}
        self._reads: dict[int, Future] = {}      # chunk -> read in flight into slot chunk % SLOTS
        self._writes: dict[int, Future] = {}     # slot -> write in flight from it
        self._on_disk: set[_Chunk] = set()       # chunks whose file region holds their states (else zeros)
        # fp32 gradients of one chunk (masters: the working-precision gradients are upcast here)
        self._scratch = torch.empty(max((c.numel for c in chunks), default=0) if masters else 0)
        self.stats = {"chunks": len(self._chunks), "resident_chunks": len(self._resident), "swap_bytes": size,
                      "offloaded_bytes": moved, "direct_io": self.swap.direct, "masters": masters}

    # --- the step ---------------------------------------------------------------------------
    def prefetch(self) -> None:
        """Start reading the first chunks' states (call before forward: the reads overlap it)."""
        for k in range(min(len(self._slots) - 1, len(self._chunks))):
            self._start_read(k)

    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_factors: Sequence[torch.Tensor | float] = ()) -> None:
        """One Adam step over every chunk. `grad_factors` (masters only): multipliers of the upcast
        gradients, in order (the caller did not scale the working-precision gradients in place)."""
        if closure is not None:
            raise FxspeedError("the offloaded optimizer takes no closure")
        if grad_factors and not self.masters:
            raise FxspeedError("grad_factors apply to working-precision gradients (masters=True); scale fp32 "
                               "gradients in place")
        group = self.param_groups[0]
        n = len(self._chunks)
        for k, chunk in enumerate(self._chunks):
            if k + 1 < n:
                self._start_read(k + 1)
            slot = self._wait_read(k)
            self._update(group, chunk, slot.tensor, grad_factors)
            self._writes[k % SLOTS] = self.swap.write(chunk.file_offset, slot, chunk.nbytes)
            self._on_disk.add(chunk)
        for chunk, buf in self._resident:
            self._update(group, chunk, buf, grad_factors)

    def _update(self, group: dict, chunk: _Chunk, flat: torch.Tensor, factors: Sequence[torch.Tensor | float]) -> None:
        live = [(p, off) for p, off in zip(chunk.params, chunk.offsets) if p.grad is not None]
        if not live:
            return
        beta1, beta2 = group["betas"]
        first = 1 if self.masters else 0  # section of exp_avg
        m = [chunk.view(flat, first, p, off) for p, off in live]
        v = [chunk.view(flat, first + 1, p, off) for p, off in live]
        if self.masters:
            weights = [chunk.view(flat, 0, p, off) for p, off in live]
            grads = [chunk.view(self._scratch, 0, p, off).copy_(p.grad) for p, off in live]
            for f in factors:  # as the in-memory path scales its fp32 gradients: one factor at a time
                torch._foreach_mul_(grads, f)
        else:
            weights, grads = [p for p, _ in live], [p.grad for p, _ in live]
        adam_update(weights, grads, m, v, [], [self.state[p]["step"] for p, _ in live], fused=True,
                    decoupled_weight_decay=self.decoupled, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        if self.masters:  # the rounded new weights: what the next step computes with
            torch._foreach_copy_([p for p, _ in live], weights)

    def _start_read(self, k: int) -> None:
        if k in self._reads:
            return
        s = k % SLOTS
        self._finish_write(s)  # the slot's previous chunk must be on disk before it is overwritten
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

    def write_master(self, work: torch.Tensor, value: torch.Tensor) -> None:
        """masters: set the fp32 master of working tensor `work` (the working copy is the caller's)."""
        self._drain()
        i, off = self._where[id(work)]
        chunk, flat = self._load(i)
        chunk.view(flat, 0, work, off).copy_(value.reshape(work.shape))
        self._store(chunk)

    def read_master(self, work: torch.Tensor) -> torch.Tensor:
        """masters: a copy of the fp32 master of working tensor `work`."""
        self._drain()
        i, off = self._where[id(work)]
        chunk, flat = self._load(i)
        return chunk.view(flat, 0, work, off).clone()

    def full_state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Every tensor's state as torch.optim's AdamW holds it (step, exp_avg, exp_avg_sq): the
        moments read back from the file (a copy)."""
        self._drain()
        out: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        first = 1 if self.masters else 0
        for i in range(len(self._each_chunk())):
            chunk, flat = self._load(i)
            for p, off in zip(chunk.params, chunk.offsets):
                out[p] = {"step": self.state[p]["step"].clone(), "exp_avg": chunk.view(flat, first, p, off).clone(),
                          "exp_avg_sq": chunk.view(flat, first + 1, p, off).clone()}
        return out

    def load_full_state(self, states: dict[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        """Write `states` (torch.optim AdamW layout, by tensor) into the file; tensors absent keep a
        zero state (as a fresh optimizer has). Masters are kept as they are."""
        self._drain()
        first = 1 if self.masters else 0
        for i in range(len(self._each_chunk())):
            chunk, flat = self._load(i)
            flat[first * chunk.numel:chunk.sections * chunk.numel].zero_()
            for p, off in zip(chunk.params, chunk.offsets):
                st = states.get(p, {})
                self.state[p]["step"] = torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).clone()
                for section, key in enumerate(_MOMENTS, start=first):
                    if key in st:
                        chunk.view(flat, section, p, off).copy_(st[key])
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
        keep = {p: dict(s) for p, s in self.state.items()}
        super().load_state_dict(state_dict)  # maps saved ids to our tensors in self.state
        loaded = {p: dict(s) for p, s in self.state.items()}
        self.state.clear()
        self.state.update(keep)
        self.load_full_state(loaded)

    def close(self) -> None:
        """Finish I/O and remove the swap directory."""
        self._drain()
        self.swap.close()


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill exactly numel() consecutive slots in some dimension order (a permuted
    contiguous tensor: transposed, channels_last), so a same-strided view of a flat slot fits it."""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def _place(chunks: list[_Chunk]) -> list[_Chunk]:
    """The chunks with their file regions, each starting page-aligned."""
    out, offset = [], 0
    for c in chunks:
        out.append(dataclasses.replace(c, file_offset=offset))
        offset += round_up(c.nbytes)
    return out


def _chunks(tensors: list[torch.Tensor], chunk_bytes: int, sections: int = 2) -> list[_Chunk]:
    """Consecutive tensors grouped into chunks of at most `chunk_bytes` of states, `sections` fp32
    values per element (a larger tensor is a chunk alone)."""
    chunks: list[_Chunk] = []
    group: list[torch.Tensor] = []
    offsets: list[int] = []
    total = 0
    for p in tensors:
        if group and 4 * sections * (total + p.numel()) > chunk_bytes:
            chunks.append(_Chunk(tuple(group), tuple(offsets), total, 0, sections))
            group, offsets, total = [], [], 0
        group.append(p)
        offsets.append(total)
        total += p.numel()
    if group:
        chunks.append(_Chunk(tuple(group), tuple(offsets), total, 0, sections))
    return chunks
