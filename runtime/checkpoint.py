"""Checkpoints independent of the parallel layout, and consolidated exports.

A checkpoint is a directory in `torch.distributed.checkpoint` (DCP) format holding one
`CanonicalState`: full tensors under the model's own parameter names, whatever ZeRO stage,
pipeline split or data-parallel degree saved it, so any other layout can load it.

Layout of the directory:
    .metadata, __<rank>_<n>.distcp   DCP: the tensors, keyed "model/<name>" and
                                     "optimizer/<name>/<slot>" (see `_flat_key`)
    extra.pt                         `CanonicalState.extra` of group rank 0 (torch.save of
                                     plain data and tensors: it must load with weights_only=True)
    COMPLETE                         JSON marker, written last: format, version and the size and
                                     crc32 of every other file

Saving writes into a sibling `<directory>.tmp-<token>` and swaps it into place only after
every rank's data is on disk, so a crash mid-save never leaves something at `<directory>` that
loads; `load_checkpoint` also refuses a directory without the COMPLETE marker (a partial copy).

Loading never runs code from the files: `extra.pt` is read with `torch.load(weights_only=True)`
and DCP's `.metadata` (a pickle) with an unpickler that accepts only DCP's metadata classes
(`SafeFileSystemReader`). Every file's size and crc32 are checked against the marker before
anything is read from it, and `expect=` checks names and shapes against the model before any
tensor is read.
why: docs/decisions/checkpoint-format.md
"""

from __future__ import annotations

import ctypes
import errno
import glob
import io
import json
import os
import pickle
import shutil
import uuid
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fxspeed.errors import FxspeedError

__all__ = ["CanonicalState", "SafeFileSystemReader", "export_hf", "export_safetensors", "load_checkpoint",
           "save_checkpoint", "tied_aliases", "validate_checkpoint"]

MARKER = "COMPLETE"
EXTRA = "extra.pt"
METADATA = ".metadata"
FORMAT = "fxspeed-checkpoint"
VERSION = 2  # 2: the marker lists every file's size and crc32 (version 1 checkpoints load unverified)
_MODEL, _OPTIM = "model/", "optimizer/"


@dataclass
class CanonicalState:
    """A training state independent of how it was laid out over ranks (ZeRO stage, pipeline split,
    data-parallel degree): full tensors under the model's original parameter names."""

    # parameters and buffers, full shapes, original names (one name per tensor; tied aliases omitted)
    model: dict[str, torch.Tensor] = field(default_factory=dict)
    # per parameter name: e.g. {"exp_avg": full tensor, "exp_avg_sq": ..., "step": 0-dim tensor}
    optimizer: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # picklable small things: scheduler / loss-scaler state, step counters, rng state, saving mesh
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# save


class _RankPrep(NamedTuple):
    """What each rank tells the others before a save writes anything."""

    error: str | None  # why this rank cannot save, or None
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]]  # its tensors' shapes and dtypes by key
    token: str  # group rank 0's names the temporary directory every rank writes into
    free: int | None  # free bytes on the filesystem this rank writes to (None: unknown)
    extra_bytes: int  # rank 0's pickled extra.pt


def save_checkpoint(directory: str | os.PathLike, state: CanonicalState, *,
                    group: dist.ProcessGroup | None = None, rank: int = 0) -> None:
    """Write `state` to `directory` (replacing an earlier fxspeed checkpoint there).

    With `group`, every rank of the group must call this with its own `state` holding only the
    tensors it has: the checkpoint holds the union of all ranks' keys; a key held by several
    ranks (data-parallel replicas) must have the same shape and dtype everywhere (checked) and
    the same values (not checked: one copy is written). `extra` is taken from group rank 0 and
    `rank` is ignored (the group rank decides). Returns on every rank only once the checkpoint
    is complete at `directory`; an error on any rank raises FxspeedError on all of them.

    Without `group` no collective runs: rank 0 writes the whole checkpoint (its `state` must be
    complete) and any other rank returns at once without writing.
    """
    directory = _normalize(directory)
    rank = dist.get_rank(group) if group is not None else rank
    world = dist.get_world_size(group) if group is not None else 1
    if group is None and rank != 0:
        return
    # Validate and prepare locally, then agree: a rank that raised alone would leave the others
    # hanging in DCP's collectives, so every rank learns every rank's error and layout first.
    token = uuid.uuid4().hex[:12]
    error, flat, extra = None, {}, b""
    try:
        flat = _flatten(state)
        if rank == 0:
            extra = _pickle_extra(state.extra, directory)  # fail now, not after writing every tensor
            _check_replaceable(directory)
            _prepare_tmp(directory, f"{directory}.tmp-{token}")
    except (FxspeedError, OSError) as e:
        error = str(e) if isinstance(e, FxspeedError) else f"cannot create a directory next to {directory!r}: {e}"
    layout = {k: (tuple(v.shape), v.dtype) for k, v in flat.items()}
    mine = _RankPrep(error, layout, token, _free_bytes(directory), len(extra))
    if group is not None:
        gathered: list[Any] = [None] * world
        _save_collective(directory, lambda: dist.all_gather_object(gathered, mine, group=group))
    else:
        gathered = [mine]
    token = gathered[0].token  # group rank 0's: all ranks write into the same temporary directory
    tmp = f"{directory}.tmp-{token}"
    try:
        errors = [f"rank {r}: {g.error}" for r, g in enumerate(gathered) if g.error]
        if errors:
            raise FxspeedError(f"not saving checkpoint {directory!r}:\n" + "\n".join(errors))
        _check_replicas_agree(directory, [g.layout for g in gathered])
        _check_room(directory, gathered)
    except FxspeedError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    # DCP gathers every rank's plan, keeps one writer per key (a key several ranks hold is written
    # once) and raises CheckpointException on all ranks if any rank fails to write.
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(tmp), process_group=group, no_dist=group is None)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised with the directory named
        # CheckpointException derives from BaseException: uncaught, it went past a training loop's
        # `except Exception` (a full disk killed the run). DCP raises it on every rank once every
        # rank's writes ended, so rank 0 can remove the partial files then (on a full disk, the
        # room the next save needs); after another error other ranks may still be writing.
        collective = isinstance(e, CheckpointException)
        if collective and rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = " (the checkpoint already there is untouched)" if os.path.isdir(directory) else ""
        left = f"rank 0 removed the partial files in {tmp!r}" if collective else f"partial files left in {tmp!r}"
        free = _free_bytes(directory)
        # torch's writer reports a full disk as "unexpected pos 704 vs 598" at best: say how full it is
        room = f" (the filesystem holding it has {_mb(free)} free now)" if free is not None else ""
        raise FxspeedError(f"saving checkpoint {directory!r} failed{kept}{room}; {left}: "
                           f"{str(e).strip()[:2000]}") from e

    # Every rank's tensors and DCP's .metadata are on disk. Each rank checksums the data files it
    # wrote (DCP names them __<group rank>_<n>.distcp) in parallel; rank 0 checksums the rest,
    # writes extra.pt and the marker listing every file's size and crc32, and swaps it into place.
    error, digests = None, {}
    try:
        digests = _digest_files(tmp, lambda f: f.startswith(f"__{rank}_") and f.endswith(".distcp"))
    except OSError as e:
        error = f"rank {rank} cannot read back its files in {tmp!r}: {e!r}"
    if group is not None:
        sums: list[Any] = [None] * world
        _save_collective(directory, lambda: dist.all_gather_object(sums, (error, digests), group=group))
    else:
        sums = [(error, digests)]
    error = None
    if rank == 0:
        try:
            failed = [e for e, _ in sums if e]
            if failed:
                raise FxspeedError("; ".join(failed))
            files: dict[str, dict[str, Any]] = {}
            for _, d in sums:
                files.update(d)
            _atomic_write(os.path.join(tmp, EXTRA), extra)
            files.update(_digest_files(tmp, lambda f: f not in files and f != MARKER and ".tmp-" not in f))
            marker = {"format": FORMAT, "version": VERSION, "world_size": world,
                      "tensors": len(_union(gathered)), "torch": torch.__version__, "files": files}
            _atomic_write(os.path.join(tmp, MARKER), json.dumps(marker, indent=1).encode())
            _move_into_place(tmp, directory, token)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, not only rank 0
            error = f"finishing checkpoint {directory!r} on rank 0 failed (files left in {tmp!r}): {e!r}"
    if group is not None:
        box = [error]
        # doubles as the closing barrier
        _save_collective(directory, lambda: dist.broadcast_object_list(box, group=group, group_src=0))
        error = box[0]
    if error:
        raise FxspeedError(error)


def _save_collective(directory: str, run: Any) -> None:
    """One of save's collectives; a peer that died mid-save (killed, out of memory) surfaced as
    gloo's bare "Connection reset by peer" from inside all_gather_object."""
    try:
        run()
    except RuntimeError as e:
        raise FxspeedError(f"saving checkpoint {directory!r} failed: another rank left the save (its process ended or "
                           f"failed; see its own error); {_kept(directory)}. Restart every rank from the last checkpoint: "
                           f"{str(e).strip()[:500]}") from e


def _free_bytes(directory: str) -> int | None:
    """Free bytes on the filesystem that will hold `directory` (its nearest existing ancestor)."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"


def _check_room(directory: str, gathered: list[_RankPrep]) -> None:
    """Refuse before writing when a rank's filesystem cannot hold the whole checkpoint (each key
    written once, plus rank 0's extra.pt), the previous checkpoint kept until the new one is
    complete. A full disk mid-write used to end in torch's "unexpected pos 704 vs 598"."""
    shapes: dict[str, tuple] = {}
    for g in gathered:
        shapes.update(g.layout)
    need = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in shapes.values())
    need += gathered[0].extra_bytes + (1 << 20)  # rank 0's extra.pt; DCP's metadata and the marker
    short = [(r, g.free) for r, g in enumerate(gathered) if g.free is not None and g.free < need]
    if short:
        r, free = short[0]
        raise FxspeedError(f"not saving checkpoint {directory!r}: it needs about {_mb(need)} and the filesystem "
                           f"holding it has {_mb(free)} free (seen by rank {r}); {_kept(directory)}. Free some "
                           "space or save elsewhere")


def _kept(directory: str) -> str:
    return "the checkpoint already there is untouched" if os.path.isdir(directory) else "nothing was written"


def _normalize(directory: str | os.PathLike) -> str:
    # "ckpt/" + ".tmp-x" would land inside ckpt/; normpath drops the trailing separator.
    return os.path.normpath(os.fspath(directory))


def _prepare_tmp(directory: str, tmp: str) -> None:
    # Leftovers of saves that crashed are never loadable and possibly large: remove them. Runs on
    # rank 0 before any rank knows the new token, so no rank is writing into what it deletes. An
    # `.old-*` directory is the previous checkpoint moved aside by a save that died between its
    # two renames (where the atomic swap is unavailable): keep it while it is the only complete copy.
    stale = glob.glob(glob.escape(directory) + ".tmp-*")
    if os.path.exists(os.path.join(directory, MARKER)):
        stale += glob.glob(glob.escape(directory) + ".old-*")
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(tmp)


def _flat_key(name: str, slot: str | None = None) -> str:
    """DCP key of a model tensor or of one optimizer slot. Parameter names keep their dots; "/"
    separates levels, so the split back is unambiguous (slot names may not contain "/")."""
    return _MODEL + name if slot is None else f"{_OPTIM}{name}/{slot}"


def _flatten(state: CanonicalState) -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for name, t in state.model.items():
        _check_tensor(t, f"model[{name!r}]")
        flat[_flat_key(name)] = t.detach()
    for name, slots in state.optimizer.items():
        if not isinstance(slots, Mapping):
            raise FxspeedError(f"optimizer[{name!r}] is a {type(slots).__name__}; expected a dict of "
                               "slot name -> tensor, e.g. {'exp_avg': ..., 'step': tensor(3.)}")
        for slot, t in slots.items():
            if not isinstance(slot, str) or not slot or "/" in slot:
                raise FxspeedError(f"optimizer[{name!r}] slot name {slot!r} must be a non-empty str without '/'")
            _check_tensor(t, f"optimizer[{name!r}][{slot!r}]")
            flat[_flat_key(name, slot)] = t.detach()
    if not isinstance(state.extra, dict):
        raise FxspeedError(f"CanonicalState.extra is a {type(state.extra).__name__}; expected a dict")
    return flat


def _check_tensor(t: Any, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise FxspeedError(f"{where} is a {type(t).__name__}, not a tensor: wrap numbers in torch.tensor(...) "
                           "or move the value into CanonicalState.extra")
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        # DTensor / ShardedTensor would be saved as shards: the canonical format is full tensors.
        raise FxspeedError(f"{where} is a {type(t).__name__}; gather it into a full torch.Tensor first")
    if t.device.type == "meta":
        raise FxspeedError(f"{where} is on the meta device and holds no data")


def _check_replaceable(directory: str) -> None:
    """Overwrite only an earlier checkpoint or an empty directory, never a user's other files."""
    if not os.path.exists(directory):
        return
    if not os.path.isdir(directory):
        raise FxspeedError(f"{directory!r} exists and is not a directory; choose another checkpoint path")
    if os.listdir(directory) and not os.path.exists(os.path.join(directory, MARKER)):
        raise FxspeedError(f"{directory!r} exists, is not empty and is not an fxspeed checkpoint (no {MARKER} "
                           "file): refusing to replace it; choose another path or remove it")


def _check_replicas_agree(directory: str, layouts: list[dict[str, tuple]]) -> None:
    seen: dict[str, tuple[int, tuple]] = {}
    bad = []
    for r, layout in enumerate(layouts):
        for k, sd in layout.items():
            if k in seen and seen[k][1] != sd:
                bad.append(f"{_describe(k)}: rank {seen[k][0]} has shape {list(seen[k][1][0])} {seen[k][1][1]}, "
                           f"rank {r} has shape {list(sd[0])} {sd[1]}")
            seen.setdefault(k, (r, sd))
    if bad:
        raise FxspeedError(f"not saving checkpoint {directory!r}: ranks hold different tensors under the same "
                           "name (each name must be one full tensor, identical on every rank that holds it):\n  "
                           + "\n  ".join(bad[:10]) + (f"\n  ... {len(bad) - 10} more" if len(bad) > 10 else ""))


def _describe(key: str) -> str:
    kind, name, slot = _split_key(key)
    return f"model[{name!r}]" if kind == "model" else f"optimizer[{name!r}][{slot!r}]"


def _union(gathered: list[_RankPrep]) -> set[str]:
    return set().union(*(g.layout for g in gathered))


def _pickle_extra(extra: dict[str, Any], directory: str) -> bytes:
    buf = io.BytesIO()
    try:
        torch.save(extra, buf)
    except Exception as e:  # noqa: BLE001 - name what could not be pickled
        raise FxspeedError(f"CanonicalState.extra of checkpoint {directory!r} cannot be pickled: {e!r}; "
                           "keep it to plain values (dicts, lists, numbers, strings, tensors)") from e
    try:  # loading uses weights_only=True: refuse now what could not be loaded back
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise FxspeedError(f"CanonicalState.extra of checkpoint {directory!r} holds objects a safe load refuses "
                           f"({_first_line(e)}); keep it to dicts, lists, tuples, numbers, strings, None and torch "
                           "tensors (a numpy array as torch.from_numpy(a), an object as its state_dict())") from e
    return buf.getvalue()


def _first_line(e: BaseException) -> str:
    """The informative line of an error (torch's weights_only errors wrap it in advice to load
    with weights_only=False, which is exactly what must not be done)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation"))]
    pick = next((ln for ln in useful if "unsupported" in ln.lower()), useful[0] if useful else "")
    return f"{type(e).__name__}: {pick}"[:300] if pick else type(e).__name__


def _refused_global(e: BaseException) -> bool:
    return "unsupported global" in str(e).lower()


def _digest(path: str) -> dict[str, Any]:
    """Size and crc32 of a file, streamed (zlib.crc32 runs at several GB/s; sha256 at about 1)."""
    crc, n = 0, 0
    buf = bytearray(1 << 22)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                break
            crc = zlib.crc32(view[:k], crc)
            n += k
    return {"bytes": n, "crc32": f"{crc:08x}"}


def _digest_files(directory: str, keep: Any) -> dict[str, dict[str, Any]]:
    return {f: _digest(os.path.join(directory, f)) for f in sorted(os.listdir(directory))
            if keep(f) and os.path.isfile(os.path.join(directory, f))}


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _move_into_place(tmp: str, directory: str, token: str) -> None:
    # A directory cannot be renamed over a non-empty one. Where the OS can swap two paths
    # atomically (Linux renameat2 RENAME_EXCHANGE) `directory` holds the old checkpoint or the new
    # one at every instant. Elsewhere move the old checkpoint aside first, then delete it: a crash
    # between the two renames leaves no checkpoint at `directory` (load names the `.old-*` copy)
    # rather than a mix of old and new files.
    old = None
    if os.path.exists(directory) and _exchange(tmp, directory):
        _fsync_dir(os.path.dirname(os.path.abspath(directory)))
        shutil.rmtree(tmp, ignore_errors=True)  # now the old checkpoint
        return
    if os.path.exists(directory):
        old = f"{directory}.old-{token}"
        os.replace(directory, old)
    os.replace(tmp, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(os.path.dirname(os.path.abspath(directory)))


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap paths `a` and `b` (Linux renameat2 RENAME_EXCHANGE); False where the OS or
    filesystem cannot (the caller falls back to two renames)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except Exception:  # noqa: BLE001 - no libc symbol (macOS, Windows, old glibc)
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), b)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# load


def load_checkpoint(directory: str | os.PathLike, *, names: list[str] | None = None,
                    group: dist.ProcessGroup | None = None, rank: int = 0,
                    expect: Mapping[str, Any] | None = None, check_dtypes: bool = False) -> CanonicalState:
    """Read a checkpoint written by `save_checkpoint`, with any number of ranks, as full CPU tensors.

    `names`: only these parameter/buffer names (model entries and their optimizer slots), e.g.
    a pipeline stage's own; every name must be in the checkpoint. None reads everything.
    `expect`: the whole model's names -> shapes (a tensor, a shape, or (shape, dtype)); when
    given, the checkpoint must hold exactly these names with these shapes (optimizer slots:
    the parameter's shape or 0-dim), checked from the metadata before any tensor is read
    (see `validate_checkpoint`). `extra` is always returned whole. Each rank reads the files
    itself (the directory must be visible to all); with `group`, ranks may ask for different
    `names`, and a failure on any rank raises FxspeedError on every rank instead of leaving the
    others to hang. `rank` is unused (kept for symmetry with `save_checkpoint`).

    Nothing read can run code (`SafeFileSystemReader`, `torch.load(weights_only=True)`), and
    every file read is checked against the size and crc32 the save recorded first.
    Raises FxspeedError when the checkpoint is missing, incomplete, corrupted or does not match
    `expect`, naming the file or what is missing.
    """
    del rank
    directory = _normalize(directory)
    result, error = None, None
    try:
        result = _load_local(directory, names, expect, check_dtypes)
    except FxspeedError as e:
        error = str(e)
    if group is not None:
        errors: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        failed: dict[str, list[int]] = {}
        for r, e in enumerate(errors):
            if e:
                failed.setdefault(e, []).append(r)
        if failed:
            raise FxspeedError("loading checkpoint failed on some ranks:\n" + "\n".join(
                f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}" for e, rs in failed.items()))
    if error:
        raise FxspeedError(error)
    assert result is not None
    return result


def validate_checkpoint(directory: str | os.PathLike, expect: Mapping[str, Any], *,
                        check_dtypes: bool = False) -> None:
    """Raise FxspeedError unless the checkpoint at `directory` holds exactly the model tensors of
    `expect` (name -> a tensor, a shape, or (shape, dtype)) with the same shapes (and dtypes with
    `check_dtypes`), and optimizer slots only for those names, each 0-dim or of the parameter's
    shape. Reads only the marker and DCP's metadata (no tensor); one error lists every missing,
    unexpected and mismatched name (the first few of each and their count)."""
    directory = _normalize(directory)
    marker = _check_complete(directory)
    _verify(directory, marker, [METADATA])
    _check_layout(directory, _read_metadata(directory).state_dict_metadata, expect, check_dtypes)


def _load_local(directory: str, names: list[str] | None, expect: Mapping[str, Any] | None,
                check_dtypes: bool) -> CanonicalState:
    marker = _check_complete(directory)
    _verify(directory, marker, [METADATA, EXTRA])  # small: before either is parsed
    metadata = _read_metadata(directory)
    meta = metadata.state_dict_metadata
    extra = _load_extra(directory)
    if expect is not None:
        _check_layout(directory, meta, expect, check_dtypes)
    keys = [k for k in meta if k.startswith((_MODEL, _OPTIM))]
    if names is not None:
        wanted = set(names)
        present = {_split_key(k)[1] for k in keys}
        missing = sorted(wanted - present)
        if missing:
            have = sorted(present)
            raise FxspeedError(f"checkpoint {directory!r} has no tensors named {missing[:10]}"
                               f"{' ...' if len(missing) > 10 else ''}; it holds {len(have)} names, e.g. {have[:5]}. "
                               "Were they saved under other names (a wrapper prefix, tied alias)?")
        keys = [k for k in keys if _split_key(k)[1] in wanted]
    # DCP loads in place: allocate every tensor from the saved shape and dtype first.
    flat: dict[str, torch.Tensor] = {}
    for k in keys:
        md = meta[k]
        if not isinstance(md, TensorStorageMetadata):
            raise FxspeedError(f"checkpoint {directory!r}: entry {k!r} is not a tensor; not an fxspeed checkpoint")
        flat[k] = torch.empty(md.size, dtype=md.properties.dtype)
    if flat:
        reader = SafeFileSystemReader(directory)
        # The data files holding the wanted tensors: verified before DCP reads any of them.
        storage = getattr(metadata, "storage_data", None) or {}
        data_files = sorted({info.relative_path for index, info in storage.items()
                             if getattr(index, "fqn", None) in flat})
        _verify(directory, marker, data_files)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
                dcp.load(flat, storage_reader=reader, no_dist=True)
        except Exception as e:  # noqa: BLE001 - DCP's errors name neither the directory nor the file
            raise FxspeedError(f"checkpoint {directory!r} is corrupted: reading its tensors from "
                               f"{', '.join(data_files)} failed ({_first_line(e)})") from e
    state = CanonicalState(extra=extra)
    for k, t in flat.items():
        kind, name, slot = _split_key(k)
        if kind == "model":
            state.model[name] = t
        else:
            state.optimizer.setdefault(name, {})[slot] = t  # type: ignore[index]
    return state


def _read_metadata(directory: str) -> Any:
    try:
        return SafeFileSystemReader(directory).read_metadata()
    except UnsafeCheckpointError as e:
        raise FxspeedError(f"checkpoint {directory!r}: refusing to load {os.path.join(directory, METADATA)!r}: {e}. "
                           "An fxspeed checkpoint's metadata holds only DCP's metadata classes; unpickling this "
                           "file could run code. Load only checkpoints written by fxspeed") from None
    except Exception as e:  # noqa: BLE001 - a corrupt, truncated or foreign .metadata
        raise FxspeedError(f"checkpoint {directory!r}: cannot read {os.path.join(directory, METADATA)!r} "
                           f"({_first_line(e)}); the checkpoint is corrupted or was not written by "
                           "fxspeed.save_checkpoint") from e


def _load_extra(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, EXTRA)
    try:
        with warnings.catch_warnings():  # a damaged file: the error below says so, not a protocol warning
            warnings.filterwarnings("ignore", message=".*pickle protocol.*")
            extra = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        why = _first_line(e)
        if _refused_global(e):
            raise FxspeedError(f"checkpoint {directory!r}: refusing to load {path!r}: it holds objects other than "
                               f"tensors and plain data ({why}); unpickling them could run code. An fxspeed "
                               "checkpoint never holds them: load only checkpoints written by fxspeed") from None
        raise FxspeedError(f"checkpoint {directory!r}: cannot read {path!r} ({why}); the file is corrupted or "
                           "truncated") from e
    if not isinstance(extra, dict):
        raise FxspeedError(f"checkpoint {directory!r}: {path!r} holds a {type(extra).__name__}, not a dict; "
                           "the checkpoint is corrupted or was not written by fxspeed")
    return extra


def _verify(directory: str, marker: dict[str, Any], files: Sequence[str]) -> None:
    """Check `files` against the sizes and crc32s in the marker (version 1 markers have none)."""
    recorded = marker.get("files")
    if recorded is None:
        return
    for f in files:
        path = os.path.join(directory, f)
        want = recorded.get(f)
        if want is None:
            raise FxspeedError(f"checkpoint {directory!r} is corrupted: {path!r} is not among the files its "
                               f"{MARKER} marker lists (its metadata refers to a file the save did not write)")
        if not os.path.isfile(path):
            raise FxspeedError(f"checkpoint {directory!r} is corrupted: {path!r} is missing (the save wrote it)")
        size = os.path.getsize(path)
        if size != want.get("bytes"):
            raise FxspeedError(f"checkpoint {directory!r} is corrupted: {path!r} has {size} bytes but the save "
                               f"wrote {want.get('bytes')} (truncated or overwritten); restore it from a good "
                               "copy or load an earlier checkpoint")
        have = _digest(path)["crc32"]
        if have != want.get("crc32"):
            raise FxspeedError(f"checkpoint {directory!r} is corrupted: {path!r} has crc32 {have} but the save "
                               f"recorded {want.get('crc32')} (its bytes changed on disk or in a copy); restore it "
                               "from a good copy or load an earlier checkpoint")


def _spec(value: Any) -> tuple[tuple[int, ...], torch.dtype | None]:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (torch.dtype, type(None)))
            and isinstance(value[0], (tuple, list, torch.Size))):
        return tuple(int(d) for d in value[0]), value[1]
    return tuple(int(d) for d in value), None


def _listing(title: str, items: list[str], limit: int = 5) -> str:
    more = f", ... {len(items) - limit} more" if len(items) > limit else ""
    return f"\n  {title} ({len(items)}): " + ", ".join(items[:limit]) + more


def _check_layout(directory: str, meta: Mapping[str, Any], expect: Mapping[str, Any], check_dtypes: bool) -> None:
    want = {n: _spec(v) for n, v in expect.items()}
    have: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    slots: list[tuple[str, str, tuple[int, ...]]] = []
    for k, md in meta.items():
        if not k.startswith((_MODEL, _OPTIM)) or not isinstance(md, TensorStorageMetadata):
            continue
        kind, name, slot = _split_key(k)
        if kind == "model":
            have[name] = (tuple(md.size), md.properties.dtype)
        else:
            slots.append((name, slot, tuple(md.size)))  # type: ignore[arg-type]
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    shapes = [f"{n} {list(have[n][0])} in the checkpoint, {list(want[n][0])} in the model"
              for n in sorted(set(want) & set(have)) if have[n][0] != want[n][0]]
    dtypes = [f"{n} {have[n][1]} in the checkpoint, {want[n][1]} in the model"
              for n in sorted(set(want) & set(have))
              if check_dtypes and want[n][1] is not None and have[n][1] != want[n][1]]
    opt_unknown = sorted({n for n, _, _ in slots if n not in want})
    opt_shapes = [f"{n}/{s} {list(shape)}, parameter {list(want[n][0])}" for n, s, shape in sorted(slots)
                  if n in want and shape != () and shape != want[n][0] and n not in missing]
    problems = [(missing, "in the model, missing from the checkpoint"),
                (unexpected, "in the checkpoint, not in the model"),
                (shapes, "with another shape"), (dtypes, "with another dtype"),
                (opt_unknown, "optimizer states for names the model does not have"),
                (opt_shapes, "optimizer states of another shape")]
    if not any(items for items, _ in problems):
        return
    counts = ", ".join(f"{len(items)} {title.split(',')[0]}" for items, title in problems if items)
    raise FxspeedError(f"checkpoint {directory!r} does not match the model ({counts}); nothing was loaded:"
                       + "".join(_listing(title, items) for items, title in problems if items)
                       + "\nWas it saved from another model (layer count, width) or under other names (a wrapper "
                         "prefix)? Load it into the model it was saved from.")


def _split_key(key: str) -> tuple[str, str, str | None]:
    if key.startswith(_MODEL):
        return "model", key[len(_MODEL):], None
    name, slot = key[len(_OPTIM):].rsplit("/", 1)
    return "optimizer", name, slot


def _check_complete(directory: str) -> dict[str, Any]:
    if not os.path.isdir(directory):
        partial = sorted(glob.glob(glob.escape(directory) + ".tmp-*"))
        old = sorted(p for p in glob.glob(glob.escape(directory) + ".old-*") if os.path.exists(os.path.join(p, MARKER)))
        hint = (f"; {partial[0]!r} is left from a save that did not finish (the process died before "
                f"renaming it into place)" if partial else "")
        if old:
            hint += (f"; the previous checkpoint is intact at {old[0]!r} (a save died while replacing it): "
                     f"rename it to {directory!r} to load it")
        raise FxspeedError(f"no checkpoint at {directory!r}: the directory does not exist{hint}")
    missing = [f for f in (MARKER, METADATA, EXTRA) if not os.path.exists(os.path.join(directory, f))]
    if missing:
        raise FxspeedError(f"checkpoint {directory!r} is incomplete: missing {', '.join(missing)} "
                           f"({MARKER} is written last, so the save did not finish or the copy is partial); "
                           "save again or load an earlier checkpoint")
    try:
        with open(os.path.join(directory, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError) as e:
        raise FxspeedError(f"checkpoint {directory!r}: unreadable {MARKER} marker ({e!r}); the checkpoint is "
                           "corrupted") from e
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or marker.get("version", 0) > VERSION:
        got = marker if not isinstance(marker, dict) else (marker.get("format"), marker.get("version"))
        raise FxspeedError(f"checkpoint {directory!r} has format/version {got!r}; this fxspeed reads "
                           f"{FORMAT!r} up to version {VERSION}")
    if marker.get("version", 1) >= 2 and not isinstance(marker.get("files"), dict):
        raise FxspeedError(f"checkpoint {directory!r}: its {MARKER} marker lists no file checksums; the "
                           "checkpoint is corrupted")
    return marker


# ----------------------------------------------------------------------------------------------
# reading DCP metadata without running code


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's pickle names a global outside the allow-list (loading it could run code)."""


_ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "pathlib._local": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict", "int", "float", "complex", "bool", "str",
                           "bytes", "bytearray"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `Metadata` and nothing else: every global must be one of DCP's metadata
    classes, torch.Size, a torch dtype / layout / memory format, a pathlib path or a builtin
    container or number. Anything else (os.system, builtins.eval, a user class...) raises."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"it names the global {module}.{name}, which DCP metadata never holds")


class SafeFileSystemReader(dcp.FileSystemReader):
    """A `FileSystemReader` whose `.metadata` is read by a restricted unpickler (DCP's own uses
    plain `pickle.load`, which runs whatever the file says). The tensor files are already read
    with `torch.load(weights_only=True)` by DCP."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        rank = kwargs.get("rank")
        get_path = getattr(self, "_get_metadata_path", None)
        path = get_path(rank) if get_path is not None else os.path.join(os.fspath(self.path), METADATA)
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"it holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


# ----------------------------------------------------------------------------------------------
# consolidated exports


def export_safetensors(path: str | os.PathLike, model_state: Mapping[str, torch.Tensor], *, rank: int = 0,
                       metadata: dict[str, str] | None = None) -> None:
    """Write `model_state` as one safetensors file (rank 0 only; other ranks return at once).

    Every name given is written, so `nn.Module.load_state_dict(load_file(path), strict=True)`
    works even for a module with tied weights (whose state_dict lists each alias). Tensors that
    share storage (tied aliases, views of one flat buffer) are written as separate contiguous
    copies, since safetensors refuses shared memory; only those are copied. To drop tied
    aliases instead (the Hugging Face convention), leave them out of `model_state`, as
    `export_hf` does. The file is written to a temporary name and renamed into place.
    """
    if rank != 0:
        return
    from safetensors.torch import save_file

    path = os.fspath(path)
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model_state.items():
        _check_tensor(t, f"model_state[{name!r}]")
        t = t.detach().to("cpu")
        storage = t.untyped_storage()
        whole = storage.nbytes() == t.numel() * t.element_size() and t.is_contiguous()
        if not whole or storage.data_ptr() in seen:
            t = t.contiguous().clone() if t.is_contiguous() else t.contiguous()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    meta = {"format": "pt", **(metadata or {})}  # transformers refuses files without format=pt
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: kept name} for parameters and buffers registered under several names; the kept
    name is the first in registration order (what `named_parameters()` yields, and what Hugging
    Face keeps: GPT-2 -> {"lm_head.weight": "transformer.wte.weight"})."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
    return aliases


def export_hf(directory: str | os.PathLike, model: torch.nn.Module, model_state: Mapping[str, torch.Tensor], *,
              rank: int = 0, metadata: dict[str, str] | None = None) -> None:
    """Write a directory that `type(model).from_pretrained(directory)` loads: `config.json`
    (from `model.config`) and `model.safetensors` (from `model_state`). Rank 0 only.

    `model` supplies the config and the names: tied aliases are omitted (filled from whichever
    name of the pair `model_state` has), non-persistent buffers dropped, and any other name
    missing from or unknown to `model.state_dict()` raises FxspeedError before anything is written.
    """
    if rank != 0:
        return
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise FxspeedError(f"{type(model).__name__} has no Hugging Face `config` with save_pretrained; "
                           "use export_safetensors for plain modules")
    aliases, persistent = tied_aliases(model), list(model.state_dict(keep_vars=True))
    state = dict(model_state)
    for alias, kept in aliases.items():
        if kept not in state and alias in state:
            state[kept] = state[alias]
        state.pop(alias, None)  # the Hugging Face convention: from_pretrained re-ties it
    for name, _ in model.named_buffers():
        if name not in persistent:
            state.pop(name, None)  # e.g. attention masks rebuilt at init; state_dict() omits them
    expected = set(persistent) - set(aliases)
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unknown:
        raise FxspeedError(f"export_hf({os.fspath(directory)!r}): model_state does not match "
                           f"{type(model).__name__}: missing {missing[:10]}, unknown {unknown[:10]}; pass the "
                           "full model state under the model's own parameter names")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    ordered = {n: state[n] for n in persistent if n in state}  # the model's own order
    export_safetensors(os.path.join(directory, "model.safetensors"), ordered, rank=0, metadata=metadata)
