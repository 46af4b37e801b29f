"""Checkpoints independent of the parallel layout, and consolidated exports.

A checkpoint is a directory in `torch.distributed.checkpoint` (DCP) format holding one
`CanonicalState`: full tensors under the model's own parameter names, whatever ZeRO stage,
pipeline split or data-parallel degree saved it, so any other layout can load it.

Layout of the directory:
    .metadata, __<rank>_<n>.distcp   DCP: the tensors, keyed "model/<name>" and
                                     "optimizer/<name>/<slot>" (see `_flat_key`)
    extra.pt                         `CanonicalState.extra` of group rank 0 (torch.save)
    COMPLETE                         JSON marker, written last

Saving writes into a sibling `<directory>.tmp-<token>` and renames it into place only after
every rank's data is on disk, so a crash mid-save never leaves something at `<directory>` that
loads; `load_checkpoint` also refuses a directory without the COMPLETE marker (a partial copy).

Loading unpickles `extra.pt` and DCP's metadata: load only checkpoints you trust.
why: docs/decisions/checkpoint-format.md
"""

from __future__ import annotations

import glob
import io
import json
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fxspeed.errors import FxspeedError

__all__ = ["CanonicalState", "export_hf", "export_safetensors", "load_checkpoint", "save_checkpoint",
           "tied_aliases"]

MARKER = "COMPLETE"
EXTRA = "extra.pt"
FORMAT = "fxspeed-checkpoint"
VERSION = 1
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
    if group is not None:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (error, layout, token), group=group)
    else:
        gathered = [(error, layout, token)]
    token = gathered[0][2]  # group rank 0's: all ranks write into the same temporary directory
    tmp = f"{directory}.tmp-{token}"
    try:
        errors = [f"rank {r}: {e}" for r, (e, _, _) in enumerate(gathered) if e]
        if errors:
            raise FxspeedError(f"not saving checkpoint {directory!r}:\n" + "\n".join(errors))
        _check_replicas_agree(directory, [lay for _, lay, _ in gathered])
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
    except Exception as e:  # noqa: BLE001 - re-raised with the directory named
        raise FxspeedError(f"saving checkpoint {directory!r} failed (partial files left in {tmp!r}): {e}") from e

    # Every rank's tensors and DCP's .metadata are on disk: rank 0 finishes and renames.
    error = None
    if rank == 0:
        try:
            _atomic_write(os.path.join(tmp, EXTRA), extra)
            marker = {"format": FORMAT, "version": VERSION, "world_size": world,
                      "tensors": len(_union(gathered)), "torch": torch.__version__}
            _atomic_write(os.path.join(tmp, MARKER), json.dumps(marker).encode())
            _move_into_place(tmp, directory, token)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, not only rank 0
            error = f"finishing checkpoint {directory!r} on rank 0 failed (files left in {tmp!r}): {e!r}"
    if group is not None:
        box = [error]
        dist.broadcast_object_list(box, group=group, group_src=0)  # doubles as the closing barrier
        error = box[0]
    if error:
        raise FxspeedError(error)


def _normalize(directory: str | os.PathLike) -> str:
    # "ckpt/" + ".tmp-x" would land inside ckpt/; normpath drops the trailing separator.
    return os.path.normpath(os.fspath(directory))


def _prepare_tmp(directory: str, tmp: str) -> None:
    # Leftovers of saves that crashed are never loadable and possibly large: remove them. Runs on
    # rank 0 before any rank knows the new token, so no rank is writing into what it deletes.
    for stale in glob.glob(glob.escape(directory) + ".tmp-*") + glob.glob(glob.escape(directory) + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)
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


def _union(gathered: list[tuple]) -> set[str]:
    return set().union(*(lay for _, lay, _ in gathered))


def _pickle_extra(extra: dict[str, Any], directory: str) -> bytes:
    buf = io.BytesIO()
    try:
        torch.save(extra, buf)
    except Exception as e:  # noqa: BLE001 - name what could not be pickled
        raise FxspeedError(f"CanonicalState.extra of checkpoint {directory!r} cannot be pickled: {e!r}; "
                           "keep it to plain values (dicts, lists, numbers, strings, tensors)") from e
    return buf.getvalue()


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _move_into_place(tmp: str, directory: str, token: str) -> None:
    # A directory cannot be renamed over a non-empty one: move the old checkpoint aside first,
    # then delete it. A crash between the two renames leaves no checkpoint at `directory` (a
    # clear "missing" error) rather than a mix of old and new files.
    old = None
    if os.path.exists(directory):
        old = f"{directory}.old-{token}"
        os.replace(directory, old)
    os.replace(tmp, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(os.path.dirname(os.path.abspath(directory)))


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
                    group: dist.ProcessGroup | None = None, rank: int = 0) -> CanonicalState:
    """Read a checkpoint written by `save_checkpoint`, with any number of ranks, as full CPU tensors.

    `names`: only these parameter/buffer names (model entries and their optimizer slots), e.g.
    a pipeline stage's own; every name must be in the checkpoint. None reads everything.
    `extra` is always returned whole. Each rank reads the files itself (the directory must be
    visible to all); with `group`, ranks may ask for different `names`, and a failure on any rank
    raises FxspeedError on every rank instead of leaving the others to hang. `rank` is unused
    (kept for symmetry with `save_checkpoint`).

    Raises FxspeedError when the checkpoint is missing or incomplete, naming what is missing.
    """
    del rank
    directory = _normalize(directory)
    result, error = None, None
    try:
        result = _load_local(directory, names)
    except FxspeedError as e:
        error = str(e)
    if group is not None:
        errors: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failed:
            raise FxspeedError("loading checkpoint failed on some ranks:\n" + "\n".join(failed))
    if error:
        raise FxspeedError(error)
    assert result is not None
    return result


def _load_local(directory: str, names: list[str] | None) -> CanonicalState:
    _check_complete(directory)
    reader = dcp.FileSystemReader(directory)
    try:
        meta = reader.read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign .metadata
        raise FxspeedError(f"checkpoint {directory!r}: cannot read DCP metadata ({e!r}); the checkpoint is corrupt "
                           "or was not written by fxspeed.save_checkpoint") from e
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
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(flat, storage_reader=reader, no_dist=True)
    state = CanonicalState()
    for k, t in flat.items():
        kind, name, slot = _split_key(k)
        if kind == "model":
            state.model[name] = t
        else:
            state.optimizer.setdefault(name, {})[slot] = t  # type: ignore[index]
    try:
        state.extra = torch.load(os.path.join(directory, EXTRA), weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise FxspeedError(f"checkpoint {directory!r}: {EXTRA} cannot be read ({e!r})") from e
    return state


def _split_key(key: str) -> tuple[str, str, str | None]:
    if key.startswith(_MODEL):
        return "model", key[len(_MODEL):], None
    name, slot = key[len(_OPTIM):].rsplit("/", 1)
    return "optimizer", name, slot


def _check_complete(directory: str) -> None:
    if not os.path.isdir(directory):
        partial = sorted(glob.glob(glob.escape(directory) + ".tmp-*"))
        hint = (f"; {partial[0]!r} is left from a save that did not finish (the process died before "
                f"renaming it into place)" if partial else "")
        raise FxspeedError(f"no checkpoint at {directory!r}: the directory does not exist{hint}")
    missing = [f for f in (MARKER, ".metadata", EXTRA) if not os.path.exists(os.path.join(directory, f))]
    if missing:
        raise FxspeedError(f"checkpoint {directory!r} is incomplete: missing {', '.join(missing)} "
                           f"({MARKER} is written last, so the save did not finish or the copy is partial); "
                           "save again or load an earlier checkpoint")
    try:
        with open(os.path.join(directory, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError) as e:
        raise FxspeedError(f"checkpoint {directory!r}: unreadable {MARKER} marker ({e!r})") from e
    if marker.get("format") != FORMAT or marker.get("version", 0) > VERSION:
        raise FxspeedError(f"checkpoint {directory!r} has format {marker.get('format')!r} version "
                           f"{marker.get('version')!r}; this fxspeed reads {FORMAT!r} up to version {VERSION}")


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
    aliases, persistent = tied_aliases(model), list(model.state_dict())
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
