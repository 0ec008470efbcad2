"""Renamed keywords keep working for one release, with a DeprecationWarning that names the new one."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keywords(**renames: str) -> Callable[[F], F]:
    """Decorate a function so that each old keyword (``old="new"``) is accepted as the new one, with a warning.

    >>> @renamed_keywords(mem_limit="mem_limit_bytes")
    ... def f(*, mem_limit_bytes=None):
    ...     return mem_limit_bytes
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     f(mem_limit=3), str(w[0].message)
    (3, 'f(mem_limit=...) is deprecated and will be removed in the next release; use mem_limit_bytes=...')
    """
    def decorate(fn: F) -> F:
        name = fn.__qualname__.replace(".__init__", "")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{name}() got both {old}= (its old name) and {new}=; pass only {new}=")
                    warnings.warn(f"{name}({old}=...) is deprecated and will be removed in the next release; use "
                                  f"{new}=...", DeprecationWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
