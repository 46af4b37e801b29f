"""Objects compiled programs reach by name: a graph can hold a string but not an engine's
optimizer or files, so the engine registers them under the name its PassOptions gave the
passes (optimizer_store, parameter_store, activation_store) and the runtime ops look them up.
Held weakly: a dropped engine's objects go with it, and a program run after that fails loudly.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

from fxspeed.errors import FxspeedError

T = TypeVar("T")


class NamedStores(Generic[T]):
    """Name -> object, weakly. `uses` says what a program does with one, for the error."""

    def __init__(self, uses: str) -> None:
        self.uses = uses
        self._by_name: "weakref.WeakValueDictionary[str, T]" = weakref.WeakValueDictionary()

    def register(self, name: str, obj: T) -> None:
        """Make `obj` what programs compiled with this store name use."""
        self._by_name[name] = obj

    def get(self, name: str) -> T:
        obj = self._by_name.get(name)
        if obj is None:
            raise FxspeedError(f"a program {self.uses} {name!r}, which this process has not registered (it belongs "
                               "to an engine that was dropped, or to another process)")
        return obj
