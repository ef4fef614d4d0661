"""Optional dependencies: one that is missing is a one-line error naming the install that fixes it."""
from __future__ import annotations

import importlib
import re
from importlib import metadata
from types import ModuleType
from typing import Tuple

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


class UnsupportedVersion(ImportError):
    """An installed dependency's version is outside the range whose behaviour the code relies on."""


def installed_version(distribution: str, module: ModuleType) -> str:
    """The installed version: the distribution's metadata, else (a source checkout on the path,
    as Megatron-LM often is) the module's `__version__`; "" when neither says."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", ""))


def _release(text: str) -> Tuple[int, ...]:
    match = re.match(r"\d+(\.\d+)*", text)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def require_version(module: str, distribution: str, supported: Tuple[str, str], what: str,
                    install: str = "") -> ModuleType:
    """`require`, then refuse a `distribution` outside `supported` = (lowest, first unsupported):
    for code that depends on a version's behaviour (partition bookkeeping, layouts, internals)."""
    imported = require(module, what, install)
    found = installed_version(distribution, imported)
    low, high = supported
    if found and not _release(low) <= _release(found) < _release(high):  # unknown: nothing to check against
        raise UnsupportedVersion(f"{what} supports {distribution} >={low},<{high}; {found} is installed",
                                 name=module)
    return imported
