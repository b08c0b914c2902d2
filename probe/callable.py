"""A module that is also a function: `probe.sites(model)` beside `python -m probe.sites`.

Importing a submodule binds it to the package's attribute of the same name, which would hide a
function exported there; giving the module a `__call__` keeps `probe.NAME(...)` working either way.
"""

from __future__ import annotations

import importlib
import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        module, name = self.__dict__["_call_target"]
        return getattr(importlib.import_module(module), name)(*args, **kwargs)


def make_callable(module_name: str, target_module: str, target: str) -> None:
    """Calling module `module_name` calls `target_module.target` (imported on first call)."""
    module = sys.modules[module_name]
    module.__dict__["_call_target"] = (target_module, target)
    module.__class__ = _CallableModule
