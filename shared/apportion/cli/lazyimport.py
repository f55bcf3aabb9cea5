"""A module imported on first use: the CLI's command modules name :mod:`apportion.events` at their top and use it
only inside their commands, so a command's ``--help`` does not pay for the events' models.

Typical use keeps the type checker's view of the module::

    if TYPE_CHECKING:
        from apportion import events
    else:
        events = lazy_module("apportion.events")
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

__all__ = ["lazy_module"]


def lazy_module(name: str) -> ModuleType:
    """The module ``name``, executed on the first access to one of its attributes (``importlib.util.LazyLoader``).

    A module already imported is returned as it is. The module goes into ``sys.modules`` and onto its parent
    package at once, so every later ``import``/``from ... import`` of it gets this same object (one set of
    classes for ``isinstance``).

    Raises:
        ModuleNotFoundError: no module ``name``.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module
