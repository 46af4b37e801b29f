"""What a trace bakes in besides the batch: the Python values forward and loss_fn read.

A captured step runs ATen ops only; the Python that chose them ran at trace time. So every value
that Python read is part of the step's key, and a change retraces, as torch.compile's guards
would:

- each module's train/eval mode;
- each module's numbers and strings (bool, int, float, str) and lists or tuples of them, its
  own and one level into the plain objects and dicts it holds (HF's `self.config.X`);
- the class attributes of the module's own classes (not torch's), unless the instance shadows
  them (`Cond.flag = False`, or `m.flag = False` over a class-level `flag = True`);
- the module-level globals its forward reads by name (`MODE = "fast"; ... if MODE == ...`);
- the identity of each plain tensor attribute (not a buffer: traced as a constant, so
  replacing it must retrace; writing into it in place needs not), of each torch.Generator
  attribute (the program draws from the traced object; seeding it in place needs no retrace),
  of each callable attribute
  (`self.act = F.relu`, a patched `forward`), of each hook (the module's and the global ones: a
  trace runs them once) and of each child module (a parameter-free child swapped for another);
- numbers, strings, None, enums, dtypes, devices and numpy scalars are compared by value;
- loss_fn's numbers and strings from its closure and globals.

Not followed: functions forward calls (their globals), objects two levels down. The key is
compared across ranks, so it holds values and counters, never ids.
"""

from __future__ import annotations

import dis
import enum
import functools
import inspect
import itertools
import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

log = logging.getLogger("fxspeed")

SCALARS = (bool, int, float, str)
_LONGEST = 64  # a longer list or dict is data, not a setting
# values compared by equality besides SCALARS: None (an unset option), enums, dtypes, devices,
# numpy scalars (np.float32(0.5) read from a config)
_ATOMS = (type(None), enum.Enum, torch.dtype, torch.device)


def _is_atom(v: Any) -> bool:
    return type(v) in SCALARS or isinstance(v, _ATOMS) or (type(v).__module__ == "numpy" and hasattr(v, "item")
                                                           and getattr(v, "ndim", 1) == 0)


def _is_setting(v: Any) -> bool:
    """A number, a string, None, an enum, a dtype, or a short list or tuple of them."""
    if _is_atom(v):
        return True
    return type(v) in (list, tuple) and len(v) <= _LONGEST and all(_is_atom(x) for x in v)


def _frozen(v: Any) -> Any:
    # a list is compared by value: changed in place, it is the same object; a numpy scalar by its
    # Python value (its repr differs across numpy versions; NaN as a string, or it never equals
    # itself); a device by its type (its index is the rank's: keys are compared across ranks)
    if type(v) in (list, tuple):
        return tuple(_frozen(x) for x in v)
    if type(v).__module__ == "numpy" and hasattr(v, "item"):
        v = v.item()
        return "nan" if v != v else v
    if isinstance(v, torch.device):
        return ("device", v.type)
    return v


def _held_by_identity(v: Any) -> bool:
    """A value a trace bakes in by what it is, not by a number: a plain tensor attribute (a
    traced constant), a torch.Generator (`self.gen`: the program draws from that object, so one
    put in its place must retrace) or a callable (`self.act = F.relu`, a patched `forward`, a
    hook)."""
    return (isinstance(v, (torch.Tensor, torch.Generator))
            or (callable(v) and not isinstance(v, (nn.Module, type))))


def function_scalars(fn: Any) -> tuple:
    """The numbers and strings function `fn` (a loss_fn) reads from its closure cells or its
    module's globals, directly or one level into a list, tuple or dict of them: a trace bakes
    them in (SCALE = {"s": 1.0}; loss_fn = lambda out, *b: out * SCALE["s"]). Functions it calls
    and other objects are not followed. A callable object's own scalar attributes count too."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:  # None, or a callable object (an nn.Module loss, say)
        return scalars(fn) if fn is not None and hasattr(fn, "__dict__") else ()
    cells = [(n, c) for n, c in zip(code.co_freevars, fn.__closure__ or ())]
    read = []
    for name, cell in cells:
        try:
            read.append((name, cell.cell_contents))
        except ValueError:  # an empty cell: not bound yet
            continue
    g = getattr(fn, "__globals__", {})
    read += [(name, g[name]) for name in _globals_read(code) if name in g]
    out = []
    for name, v in read:
        if _is_setting(v):
            out.append((name, _frozen(v)))
        elif isinstance(v, dict) and len(v) <= _LONGEST and all(type(x) in SCALARS for x in v.values()):
            out.append((name, tuple(sorted(((repr(k), x) for k, x in v.items())))))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _globals_read(code: Any) -> tuple[str, ...]:
    """The global names `code` loads (co_names also lists attribute names: `self.device` would
    have read a script's global `device`)."""
    return tuple(dict.fromkeys(i.argval for i in dis.get_instructions(code)
                               if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")))


Slot = tuple[str, Mapping, str]  # (name in the key, the mapping holding the value, its key there)


def scalar_slots(m: Any, seen: set | None = None, held: list[tuple[dict, str, Any]] | None = None) -> list[Slot]:
    """(name, the mapping holding it, its key) of every setting `m` reads: its own attributes,
    one level into the plain objects and dicts it holds (a Hugging Face model's `self.config.X`,
    an options dict; each held object read once, `seen`), its classes' attributes and its
    forward's globals (each read once). `held` collects (m.__dict__, attribute, object) of each
    object read into and of each plain tensor attribute: those must stay the same objects."""
    seen = set() if seen is None else seen
    own = m.__dict__
    out: list[Slot] = [(k, own, k) for k, v in own.items() if k != "training" and _is_setting(v)]
    for k, v in own.items():
        if _held_by_identity(v):  # (Parameters, buffers and submodules live in their own dicts)
            if held is not None:
                held.append((own, k, v))
            continue
        if k.startswith("_") or id(v) in seen or isinstance(v, (nn.Module, type)):
            continue
        inner = v if type(v) is dict else getattr(v, "__dict__", None) if hasattr(v, "__dict__") else None
        if not isinstance(inner, dict):
            continue
        seen.add(id(v))
        if held is not None:
            held.append((own, k, v))
        # private slots left out: they hold bookkeeping such as HF generation_config's
        # _original_object_hash, a hash() that differs per process (PYTHONHASHSEED), which made
        # the ranks' step keys disagree
        out += [(f"{k}.{kk}", inner, kk) for kk, vv in inner.items()
                if isinstance(kk, str) and not kk.startswith("_") and _is_setting(vv)]
    if held is not None and isinstance(m, nn.Module):
        for name in _HOOK_DICTS:
            hooks = getattr(m, name, None)
            if hooks:
                held += [(hooks, k, fn) for k, fn in hooks.items()]
        held += [(m._modules, k, child) for k, child in m._modules.items()]  # a child swapped for another
    for cls in type(m).__mro__:
        if cls is object or cls.__module__.split(".")[0] in ("torch", "builtins"):
            continue
        for k, v in vars(cls).items():
            if k.startswith("_") or k in own or (id(cls), k) in seen or not _is_setting(v):
                continue
            seen.add((id(cls), k))
            out.append((f"{cls.__name__}.{k}", vars(cls), k))
    fn = inspect.unwrap(type(m).forward) if hasattr(type(m), "forward") else None
    if getattr(fn, "__code__", None) is not None and hasattr(fn, "__globals__"):
        g = fn.__globals__
        for name in _globals_read(fn.__code__):
            if name in g and (id(g), name) not in seen and _is_setting(g[name]):
                seen.add((id(g), name))
                out.append((f"global {fn.__module__}.{name}", g, name))
    return out


# a module's hooks: a trace runs them once, so one added or removed after it must retrace
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks")  # in torch.nn.modules.module


def _global_hook_dicts() -> list[dict]:
    from torch.nn.modules import module as mm

    return [getattr(mm, n, {}) for n in _GLOBAL_HOOK_DICTS]


def _global_hooks() -> list[tuple[dict, Any, Any]]:
    return [(d, k, fn) for d in _global_hook_dicts() for k, fn in d.items()]


def scalars(m: Any, seen: set | None = None) -> tuple:
    """(name, value) of what `scalar_slots` finds."""
    return tuple((name, _frozen(d[k])) for name, d, k in scalar_slots(m, seen))


class ModuleState:
    """Each module's mode and settings as a step key, with a fast test that nothing changed since
    the last one: the same modules' modes, attribute counts (a new attribute may shadow a class
    attribute) and values, read by name (about 0.2 ms for GPT-2's 164 modules), and the same held
    objects (a config replaced by another would leave the slots reading the old one's values)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._last: dict[bool, tuple] = {}  # train -> (key, modules, modes, sizes, slots, values, held, hooks)
        # a plain tensor attribute's number in the key: the same object keeps its number
        self._tags: dict[int, tuple[Any, int, bool]] = {}  # id -> (ref, number, held strongly)
        self._numbers = itertools.count()  # (never len(_tags): an id reused after its object died kept it)
        self._own: set[tuple[int, Any]] = set()  # (id(hooks dict), key) of the engine's own hooks

    def ignore(self, handle: Any) -> None:
        """Leave out of the key a hook the engine registered itself (torch's RemovableHandle)."""
        hooks = handle.hooks_dict_ref()
        if hooks is not None:
            self._own.add((id(hooks), handle.id))

    def key(self, train: bool) -> tuple:
        last = self._last.get(train)
        if last is not None and self._unchanged(*last[1:]):
            return last[0]
        seen: set = set()
        modules = list(self.model.modules())
        held_by: list[list[tuple[Any, Any, Any]]] = [[] for _ in modules]
        slots = [scalar_slots(m, seen, mine) for m, mine in zip(modules, held_by)]
        held_by = [[h for h in ids if (id(h[0]), h[1]) not in self._own] for ids in held_by]
        glob = _global_hooks()
        # identities as counters (keys are compared across ranks); children by their class
        # hooks by their place in their dict: a handle's id counts every hook the process made
        key = tuple((m.training if train else False,
                     tuple((name, _frozen(d[k])) for name, d, k in mine)
                     + tuple((k if isinstance(k, str) else f"hook {i}",
                              ("held", type(v).__name__ if isinstance(v, nn.Module) else self._tag(v)))
                             for i, (_, k, v) in enumerate(ids)))
                    for m, mine, ids in zip(modules, slots, held_by)) + (tuple(self._tag(fn) for _, _, fn in glob),)
        flat = [(d, k) for mine in slots for _, d, k in mine]
        held = [h for ids in held_by for h in ids] + glob
        self._forget_tags({id(v) for _, _, v in held})
        self._last[train] = (key, modules, [m.training for m in modules], [len(m.__dict__) for m in modules],
                             flat, [_frozen(d[k]) for d, k in flat], held,
                             [len(d) for d in _hook_dicts(modules)])
        return key

    def _tag(self, obj: Any) -> int:
        """A number for `obj` that stays while it is the same object (a weak reference where it
        allows one; else the object itself is kept)."""
        entry = self._tags.get(id(obj))
        if entry is None or entry[0]() is not obj:
            try:
                ref, strong = weakref.ref(obj), False
            except TypeError:
                ref, strong = (lambda o: lambda: o)(obj), True
            entry = (ref, next(self._numbers), strong)
            self._tags[id(obj)] = entry
        return entry[1]

    def _forget_tags(self, held: set[int]) -> None:
        """Drop the numbers of objects that died, and of the oldest objects held by reference
        (no weak reference allowed: dicts, builtins) beyond the last _STRONG_KEPT the model no
        longer holds: a module whose attribute takes a new such object every step would
        otherwise keep every one alive, while one switching between a few (`opts = A if train
        else B`) keeps their numbers and so its compiled programs. One that comes back after
        being dropped gets a new number (one more trace), never another object's."""
        for i, (ref, _, strong) in list(self._tags.items()):
            if ref() is None:
                del self._tags[i]
        strong = [(n, i) for i, (_, n, s) in self._tags.items() if s and i not in held]
        for _, i in sorted(strong)[:max(0, len(strong) - _STRONG_KEPT)]:  # (numbers grow: the oldest first)
            del self._tags[i]

    @staticmethod
    def _unchanged(modules: list[nn.Module], modes: list[bool], sizes: list[int], slots: list[tuple[Mapping, str]],
                   values: list, held: list[tuple[dict, str, Any]], hooks: list[int]) -> bool:
        return ([m.training for m in modules] == modes and [len(m.__dict__) for m in modules] == sizes
                and [len(d) for d in _hook_dicts(modules)] == hooks  # (a hook added: a new entry)
                and all(d.get(k) is v for d, k, v in held)
                and [_frozen(d.get(k)) for d, k in slots] == values)


_STRONG_KEPT = 16  # objects held by reference the step key remembers after the model let them go


def _hook_dicts(modules: list[nn.Module]) -> list[dict]:
    return [getattr(m, n, {}) for m in modules for n in (*_HOOK_DICTS, "_modules")] + _global_hook_dicts()


def warn_python_state_changed(model: nn.Module, before: tuple, after: tuple) -> None:
    """Tracing ran forward's Python, which changed module attributes: the compiled step will not
    run that Python again, so the attribute stays as tracing left it."""
    names = dict((id(m), n) for n, m in model.named_modules())
    mods = list(model.modules())
    for m, (_, b), (_, a) in zip(mods, before, after):
        if a != b:
            diff = [f"{k}: {dict(b).get(k)!r} -> {v!r}" for k, v in a if dict(b).get(k) != v]
            log.warning("fxspeed: %s's forward changes Python attribute(s) of module %r (%s) while being traced; the "
                        "compiled step runs without forward's Python: every step computes what eager's first call "
                        "computes, the attributes keep the values that call left and a branch on them is fixed. "
                        "Keep such state in a buffer (register_buffer) updated with tensor ops; or, for a setting "
                        "forward decides once on its first call and keeps (Hugging Face's config.problem_type), set "
                        "it before compile: the same steps, without this warning",
                        type(model).__name__, names.get(id(m), "?") or "(root)", "; ".join(diff[:3]))
            return
