"""Optional dependencies: one that is missing is a one-line error naming the install that fixes it."""
from __future__ import annotations

import importlib
from types import ModuleType

# the core's own optional modules -> the install that provides them (extensions name theirs)
INSTALLS = {
    "matplotlib": "pip install 'ckpt_plugins[trace]'",
    "fsspec": "pip install 'ckpt_plugins[s3]'",
    "s3fs": "pip install 'ckpt_plugins[s3]'",
}


class MissingDependency(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the install that fixes it."""


def require(module: str, what: str, install: str = "") -> ModuleType:
    """Import `module` for `what` (a feature, as the user knows it), or raise `MissingDependency`
    naming `install` (default: the core's own extras, else `pip install <module>`). Only the module
    itself being absent is translated: an installed package that fails to import raises its own error."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if (exc.name or "").split(".")[0] != top:
            raise
        hint = install or INSTALLS.get(top, f"pip install {top}")
        raise MissingDependency(f"{what} needs {top}, which is not installed: {hint}", name=top) from None
