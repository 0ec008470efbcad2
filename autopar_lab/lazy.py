"""One way to make a value whose fields are computed the first time one of them is read: :class:`Lazy`.

Three values are made so, each because most of them are never read: a deep model's full graph (traced when
something reads an operator, :func:`~autopar_lab.pricing.table.deferred_graph`), a mesh's intra-op plan solved in a
worker process (rebuilt from its strategy indices) and an override's intra-op plan (its totals evaluated), both
:class:`~autopar_lab.pricing.incremental.LazyIntraPlan`. Once filled, such a value is its class's value in every
respect: the fields are plain attributes and reading them costs nothing more.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Pair:
    ...     a: int
    ...     b: int
    >>> calls = []
    >>> p = Lazy.of(Pair, lambda: calls.append(1) or {"b": 2}, names=("b",), a=1)
    >>> p.a, p.is_filled, calls
    (1, False, [])
    >>> p.b, p.is_filled, calls, isinstance(p, Pair)
    (2, True, [1], True)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, TypeVar

T = TypeVar("T")
Fill = Callable[[], Mapping[str, Any]]

_CLASSES: dict[type, type] = {}


class Lazy:
    """A mixin that defers a value's fields. An instance made by :meth:`of` (or :meth:`defer` on a subclass) holds
    the fields given; the first read of one of ``names`` (with ``names`` None: of any attribute it lacks) calls
    ``fill()`` once and sets every field it returns. A ``fill`` that raises is called again at the next read.

    It pickles and copies as the plain value of its class, filled first (a subclass may pickle a recipe instead)."""

    @classmethod
    def of(cls, value_class: type[T], fill: Fill, *, names: Iterable[str] | None = None, **given: Any) -> T:
        """A ``value_class`` whose fields ``fill()`` computes when first read (see the class)."""
        lazy: Any = _CLASSES.get(value_class)
        if lazy is None:
            lazy = _CLASSES[value_class] = type(f"Lazy{value_class.__name__}", (cls, value_class), {})
        return lazy.defer(fill, names=names, **given)

    @classmethod
    def defer(cls, fill: Fill, *, names: Iterable[str] | None = None, **given: Any):
        """An instance of this class (a subclass of Lazy and of a value class) made without its ``__init__``."""
        obj = cls.__new__(cls)
        for name, value in given.items():
            object.__setattr__(obj, name, value)  # frozen dataclasses too
        obj.__dict__["_fill"] = (fill, None if names is None else frozenset(names))
        return obj

    @property
    def is_filled(self) -> bool:
        """True once ``fill()`` has run (or there was nothing to fill)."""
        return "_fill" not in self.__dict__

    def fill_now(self):
        """Fill the fields now if not done yet; returns self."""
        entry = self.__dict__.pop("_fill", None)
        if entry is not None:
            try:
                values = entry[0]()
            except BaseException:
                self.__dict__["_fill"] = entry  # a failed (or interrupted) fill is tried again at the next read
                raise
            for name, value in values.items():
                object.__setattr__(self, name, value)
        return self

    def __getattr__(self, name: str) -> Any:
        # Only attributes the instance lacks get here; dunder probes (copy, pickle) do not fill it.
        entry = self.__dict__.get("_fill")
        if entry is None or name.startswith("__") or (entry[1] is not None and name not in entry[1]):
            raise AttributeError(name)
        self.fill_now()
        return getattr(self, name)

    def __reduce__(self):
        self.fill_now()
        return plain_value, (value_class(type(self)), dict(self.__dict__))


def value_class(cls: type) -> type:
    """The first base of ``cls`` that is not a Lazy: the class whose value a lazy instance stands for."""
    return next(c for c in cls.__mro__ if not issubclass(c, Lazy) and c is not object) if issubclass(cls, Lazy) \
        else cls


def plain_value(cls: type[T], state: Mapping[str, Any]) -> T:
    """An instance of ``cls`` with these attributes, made without its ``__init__`` (a lazy value unpickled)."""
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj
