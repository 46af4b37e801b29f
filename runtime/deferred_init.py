"""Deferred initialization: a model built on the meta device is materialized by the engine one
bucket at a time, so a rank never holds the whole fp32 model (DeepSpeed's `zero.Init`, FSDP's
meta-device init).

    with fxspeed.parameters_on_meta():        # parameters hold no memory; buffers are real
        model = GPT(cfg)
    engine = fxspeed.compile(model, 2, fxspeed.Config(zero=3), example_inputs=...)
    # each rank built each bucket in turn, kept its shard and dropped the rest (under tensor
    # parallelism: each init group, cut to its slices; under a pipeline: its stages' weights only)

Values do not depend on the order buckets are built in, nor on the ranks, the ZeRO stage or the
layout: each module is initialized by its own init function under a generator seeded from
(seed, the module's name), so every rank makes the same values and `fxspeed.materialize(model,
seed=...)` makes the same model eagerly (the reference to compare with, or to save). They are
not the values an eager build under `torch.manual_seed(seed)` draws (that is one generator
running through the modules in construction order).

The values are those of `model.apply(init)` (children before parents), `init` being the one
given, else a Hugging Face (sub-)model's own `_init_weights(module)`, else each module's
`reset_parameters()`. Every floating-point tensor is NaN until the inits that write it run and is
checked after: a tensor an init left unset is an error naming it, never uninitialized memory
trained on in silence (integer and bool tensors start at zero).
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxspeed.errors import ConfigError

log = logging.getLogger("fxspeed")

InitFn = Callable[[nn.Module], None]


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


class DeferredInit:
    """The meta tensors of `model` and how to give them values on `device`, as if
    `model.apply(init)` ran (children before parents) with each module's call under its own seed.

    A probe first runs every module's init with the meta tensors in place and the writes skipped,
    to see what each writes: its own tensors, or a child's (transformers' GPT-2 rescales `c_proj`
    from its attention and MLP modules). The modules whose inits write a tensor, and those holding
    it, are one group, made together: `materialize(params)` makes the groups of those Parameters,
    `materialize_all()` the rest, and `release(tensors)` drops the groups made of tensors this
    rank never holds (another pipeline stage's). The Parameter objects stay the same (only their memory changes):
    the engine keys its layout, hooks and optimizer on them."""

    def __init__(self, model: nn.Module, device: torch.device | str, seed: int = 0, init: InitFn | None = None):
        self.model, self.device, self.seed, self.init = model, torch.device(device), seed, init
        # the model's own init, per module: a Hugging Face composite (LLaVA's CLIP vision tower and
        # Llama, an encoder-decoder) inits each sub-model's modules with that sub-model's
        # `_init_weights`, as transformers' smart_apply does; the root's serves the rest
        self._hf_owner: dict[int, nn.Module] = {}
        if init is None and callable(getattr(model, "_init_weights", None)):
            def own(m: nn.Module, owner: nn.Module) -> None:
                if m is not model and _is_hf_model(m) and callable(getattr(m, "_init_weights", None)):
                    owner = m
                self._hf_owner.setdefault(id(m), owner)
                for c in m.children():
                    own(c, owner)
            own(model, model)
        self._name = {id(m): name for name, m in reversed(list(model.named_modules(remove_duplicate=False)))}
        self._post = _post_order(model)  # model.apply's order: a module after its children
        self._made: set[int] = set()  # ids of the tensors given memory here
        # every tensor by id: (the module holding it, its name there, whether a buffer); a tied one
        # under its first holder in model.apply's order
        self._home: dict[int, tuple[nn.Module, str, bool]] = {}
        for m in self._post:
            for buffer, d in ((False, m._parameters), (True, m._buffers)):
                for n, t in d.items():
                    if t is not None:
                        self._home.setdefault(id(t), (m, n, buffer))
        self._tensors = {id(t): t for m in self._post for t in _own(m)}
        meta = {i for i, t in self._tensors.items() if t.is_meta}
        # what each init writes (probed: meta tensors and real ones, whose values it keeps), and the
        # groups: union of the meta tensors a module's init writes with its own
        self._writes: dict[int, set[int]] = {}
        parent: dict[int, int] = {i: i for i in meta}
        # the probe names what it saw written by storage: `p.data.normal_()` writes through an alias
        # that is neither p nor a view of it (transformers 4.x's inits, most hand-written ones)
        by_storage: dict[int, set[int]] = {}
        for i, t in self._tensors.items():
            by_storage.setdefault(_storage_key(t), set()).add(i)

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        anchor: dict[int, int] = {}  # id(module) -> a meta tensor its init writes (names its group)
        for m in self._post:
            fn = self._init_of(m)
            if fn is None:
                continue
            written = {i for key in self._probe(m, fn) for i in by_storage.get(key, ())}
            if not written & meta:
                continue
            self._writes[id(m)] = written
            anchor[id(m)] = next(iter(written & meta))
            root = find(anchor[id(m)])
            # its own meta tensors go with it: made together, checked together
            for i in (written & meta) | {id(t) for t in _own(m) if id(t) in meta}:
                parent[find(i)] = root
        written_any = {i for w in self._writes.values() for i in w}
        untouched = [i for i in self._tensors if i in meta and i not in written_any]  # in apply's order
        if untouched:
            holder = self._home[untouched[0]][0]
            raise ConfigError(
                f"{self._where(holder)} holds tensors on the meta device that no init gives values to"
                f"{f' ({len(untouched)} tensors in all)' if len(untouched) > 1 else ''}: "
                f"{self._no_init_reason(holder)}. Pass "
                "fxspeed.compile(..., init=fn), where fn(module) fills the module's own parameters and buffers "
                "(it is called on every module, children first, as model.apply(fn) would), or build the model "
                "with real weights" + (_LOST_BUFFER if any(self._home[i][2] for i in untouched) else ""))
        self._group_of = {i: find(i) for i in meta}
        self._members: dict[int, list[int]] = {}  # group -> its tensors
        for i, g in self._group_of.items():
            self._members.setdefault(g, []).append(i)
        self._runs: dict[int, list[nn.Module]] = {}  # group -> the modules whose inits make it, in apply's order
        for m in self._post:
            if id(m) in anchor:
                self._runs.setdefault(self._group_of[anchor[id(m)]], []).append(m)
        self._pending = set(self._members)  # groups not made yet

    def _where(self, m: nn.Module) -> str:
        name = self._name[id(m)]
        return f"{type(self.model).__name__}.{name} ({type(m).__name__})" if name else \
            f"{type(self.model).__name__} (the root module)"

    def _no_init_reason(self, holder: nn.Module) -> str:
        if self.init is not None:
            return "the init given does not write them"
        if id(holder) in self._hf_owner:
            return f"{type(self._hf_owner[id(holder)]).__name__}._init_weights does not write them"
        return "it has no reset_parameters()"

    @property
    def done(self) -> bool:
        return not self._pending

    def _init_of(self, m: nn.Module) -> InitFn | None:
        if self.init is not None:
            return self.init
        if id(m) in self._hf_owner:
            return self._hf_owner[id(m)]._init_weights
        reset = getattr(m, "reset_parameters", None)
        return (lambda module: reset()) if callable(reset) else None

    def _probe(self, m: nn.Module, fn: InitFn) -> set[int]:
        """Storage keys of the tensors `fn(m)` writes, found by running it with every write skipped.
        An init that cannot run on meta tensors (reads a value) is taken to write all of m's subtree."""
        probe = _WriteProbe()
        try:
            # (fork_rng: an init that draws out of place, torch.randn(...), would move the global generator)
            with torch.random.fork_rng(devices=[]), probe, _seeing_meta_noop_inits(probe), torch.no_grad():
                fn(m)
        except Exception as e:  # noqa: BLE001 (any failure: fall back to the widest group)
            log.debug("fxspeed: probing the init of %s failed (%s); its subtree is made as one group", self._where(m), e)
            return {_storage_key(t) for sub in m.modules() for t in _own(sub)}
        return probe.written

    def materialize_buffers(self) -> None:
        """The groups holding meta buffers, now: the programs read buffers whole from the first step
        (and they are small)."""
        for i, (_, _, buffer) in self._home.items():
            if buffer and i in self._group_of:
                self._make(self._group_of[i])

    def materialize(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Values for `params` (and the rest of their groups). Returns the tensors given values by
        this call (those of the groups made now), so a caller can cut each group down at once
        (tensor parallelism keeps a slice: the full tensors of one group are alive at a time)."""
        made: list[torch.Tensor] = []
        for p in params:
            if id(p) in self._group_of:
                made += self._make(self._group_of[id(p)])
        return made

    def materialize_all(self) -> None:
        for g in list(self._pending):
            self._make(g)

    def release(self, tensors: Iterable[torch.Tensor]) -> None:
        """`tensors` are never held here (another pipeline stage's weights): a group all of whose
        tensors are among them is never made, and each of them becomes a 0-size tensor on the
        device, as the engine leaves the weights it frees. A group that also holds a tensor not
        released is left as it is: its values are made when asked for (the kept ones need them,
        and a group's init runs on all of its tensors); the caller frees the released ones after."""
        gone = {id(t) for t in tensors}
        for g in [g for g in self._pending if all(i in gone for i in self._members[g])]:
            self._pending.discard(g)
            with self._rnn_refs_dropped(self._members[g]):
                for i in self._members[g]:
                    t = self._tensors[i]
                    _swap_in(t, torch.empty(0, dtype=t.dtype, device=self.device),
                             f"{type(self.model).__name__}.{self._qualified(i)}")

    @contextlib.contextmanager
    def _rnn_refs_dropped(self, tensors: list[int]) -> Iterator[None]:
        """torch's RNNs hold weak references to their Parameters (`_flat_weight_refs`), which
        swap_tensors refuses: dropped for the swap and remade after, as RNNBase._apply does."""
        rnns = {id(m): m for m in (self._home[i][0] for i in tensors) if isinstance(m, nn.RNNBase)}.values()
        for m in rnns:
            m._flat_weight_refs = []
        yield
        for m in rnns:
            m._init_flat_weights()

    def _make(self, group: int) -> list[torch.Tensor]:
        if group not in self._pending:
            return []
        self._pending.discard(group)
        made = self._members[group]
        with self._rnn_refs_dropped(made):
            for i in made:
                _allocate(self._tensors[i], self.device, f"{type(self.model).__name__}.{self._qualified(i)}")
                self._made.add(i)
        for m in self._runs.get(group, ()):
            self._run_init(m)
        unset = [i for i in made if (self._tensors[i].is_floating_point() or self._tensors[i].is_complex())
                 and bool(torch.isnan(self._tensors[i]).any())]
        if unset:
            raise ConfigError(
                f"the init of {type(self.model).__name__} left {', '.join(self._qualified(i) for i in unset[:5])} unset "
                "(NaN where it gave no value). Pass fxspeed.compile(..., init=fn) / fxspeed.materialize(..., init=fn) "
                "with an fn(module) that fills every parameter and buffer the module holds itself, or build the model "
                "with real weights" + (_LOST_BUFFER if any(self._home[i][2] for i in unset) else ""))
        return [self._tensors[i] for i in made]

    def _qualified(self, i: int) -> str:
        """Tensor i's name in the model ("blocks.0.ln1.weight")."""
        m, leaf, _ = self._home[i]
        return f"{self._name[id(m)]}.{leaf}" if self._name[id(m)] else leaf

    def _run_init(self, m: nn.Module) -> None:
        """m's init under its own generator. What it writes or holds that was real before (not made
        here: a weight the user loaded, its own or a child's) keeps its value; a tensor it writes
        that is still meta (another group's) is not written."""
        real = [self._tensors[i] for i in self._writes[id(m)] | {id(t) for t in _own(m)} if i not in self._made]
        kept = [(t, t.detach().clone()) for t in real if not t.is_meta and t.numel()]
        # transformers skips what it flagged as initialized: a flag set while on meta would leave
        # the new memory unset. Put back after: the flag is part of the module state a trace keyed
        # on (left deleted, every HF model retraced at its first step, gathering ZeRO-3's whole model)
        flags = [(t, t._is_hf_initialized) for t in (m, *_own(m)) if hasattr(t, "_is_hf_initialized")]
        for t, _ in flags:
            del t._is_hf_initialized
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), torch.no_grad():
                torch.manual_seed(module_seed(self.seed, self._name[id(m)]))
                self._init_of(m)(m)
                for t, value in kept:
                    t.copy_(value)
        finally:
            for t, flag in flags:
                t._is_hf_initialized = flag


_LOST_BUFFER = (" (a buffer computed in __init__, such as rotary frequencies, is lost on the meta device: build with "
                "`with fxspeed.parameters_on_meta():` to keep buffers real)")


def _is_hf_model(m: nn.Module) -> bool:
    """A transformers PreTrainedModel (by name: fxspeed does not import transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(m).__mro__)


def _own(m: nn.Module) -> list[torch.Tensor]:
    return [t for d in (m._parameters, m._buffers) for t in d.values() if t is not None]


def _post_order(model: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for c in m.children():
            visit(c)
        out.append(m)

    visit(model)
    return out


def _allocate(t: torch.Tensor, device: torch.device, name: str) -> None:
    """Memory on `device` for meta tensor t, NaN where floating point (to tell what the init left
    unset). `.data =` cannot move a tensor off meta; the swap keeps the Python object, so ties and
    the engine's references to it hold."""
    new = torch.empty_like(t, device=device)
    # (integers and bools have no value to tell "unset" by: zero, so a part an init leaves is at
    # least the same on every rank, not whatever the allocator held)
    new.fill_(float("nan")) if new.is_floating_point() or new.is_complex() else new.zero_()
    _swap_in(t, new, name)


def _swap_in(t: torch.Tensor, new: torch.Tensor, name: str) -> None:
    """`new`'s memory into meta tensor t, in place (a Parameter stays a Parameter)."""
    try:
        torch.utils.swap_tensors(t, nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new)
    except RuntimeError as e:
        if "weakref" not in str(e):
            raise
        raise ConfigError(f"{name} is on the meta device and something holds a weak reference to it (weakref."
                          "ref), so it cannot be given memory in place (torch.utils.swap_tensors refuses). Drop the "
                          "weak reference until compile / fxspeed.materialize is done, or build the model with real "
                          "weights") from e


def _storage_key(t: torch.Tensor) -> int:
    """What a tensor, its views and its `.data` alias share (meta tensors too: each has a storage
    of its own, without memory); the object's id where a tensor type has no storage."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return id(t)


class _WriteProbe(TorchDispatchMode):
    """Records the storages ops write (the tensor the init handed in, a view of it or its `.data`)
    and skips every write, so a probe changes nothing and draws no random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not func._schema.is_mutable:
            return func(*args, **kwargs)
        out = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(v, torch.Tensor):
                    out.append(v)
                    self.written.add(_storage_key(v))
        return out[0] if len(out) == 1 else tuple(out)


# torch.nn.init functions that return at once on a meta tensor, so no write reaches the probe:
# (the module, the attribute); _no_grad_trunc_normal_ serves trunc_normal_ however it was imported
_META_NOOP_INITS = (("torch.nn.init", "_no_grad_trunc_normal_"), ("torch.nn.init", "orthogonal_"),
                    ("torch.nn.init", "dirac_"), ("torch.nn.init", "sparse_"))


@contextlib.contextmanager
def _seeing_meta_noop_inits(probe: _WriteProbe) -> Iterator[None]:
    """During a probe, the torch.nn.init functions that skip meta tensors record them as written
    (also where transformers keeps its own references to them, `TORCH_INIT_FUNCTIONS`)."""
    import sys

    def recording(original: Callable[..., Any]) -> Callable[..., Any]:
        def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                probe.written.add(_storage_key(tensor))
                return tensor
            return original(tensor, *args, **kwargs)
        return init

    undo: list[tuple[Any, str, Any]] = []
    for module, attr in _META_NOOP_INITS:
        owner = sys.modules[module]
        undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, recording(getattr(owner, attr)))
    hf = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    hf_undo = dict(hf) if isinstance(hf, dict) else {}
    for name in ("trunc_normal_", "orthogonal_", "dirac_", "sparse_"):
        if name in hf_undo:
            hf[name] = recording(hf_undo[name])
    try:
        yield
    finally:
        for owner, attr, original in undo:
            setattr(owner, attr, original)
        if hf_undo:
            hf.update(hf_undo)


def module_seed(seed: int, name: str) -> int:
    """The generator seed of the module named `name`: the same on every rank and in every order."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def refuse_init_without_meta(model: nn.Module, init: InitFn | None, where: str) -> None:
    """`init=` for a model with no meta tensors would run on nothing: the user asked for values
    the model would not get."""
    if init is not None and not has_meta_tensors(model):
        raise ConfigError(f"{where}: init= gives values to a model built on the meta device; {type(model).__name__} "
                          "holds none there (it has its values already). Drop init=, call model.apply(init) to "
                          "re-initialize a built model, or build it under `with fxspeed.parameters_on_meta():`")


def materialize(model: nn.Module, init: InitFn | None = None, seed: int = 0,
                device: torch.device | str = "cpu") -> nn.Module:
    """Give a model built on the meta device values on `device`, eagerly, in place: the same values
    `fxspeed.compile(model, ..., init=init)` builds with `Config(seed=seed)` (seed None -> 0).
    Returns the model. Without init, a model holding no meta tensors is returned as it is."""
    refuse_init_without_meta(model, init, "fxspeed.materialize")
    DeferredInit(model, device, seed, init).materialize_all()
    return model


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, every Parameter a module registers goes to the meta device as soon as it is made;
    buffers stay real (rotary frequencies, masks computed in __init__ keep their values, which
    `with torch.device("meta")` would lose). Each Parameter is made (and initialized by the
    module's __init__) on its usual device first and dropped at once: the peak is one tensor."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original
