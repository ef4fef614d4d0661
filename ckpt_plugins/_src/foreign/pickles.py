"""Reading other frameworks' pickled files (for importers) without running code from them.

`load_torch_inert` reads a `torch.save` file with torch's weights-only unpickler; every class the
file names beyond tensors and plain containers (argparse.Namespace, a framework's enums and config
classes) is replaced by an inert `StandIn` that only records what the pickle gives it.
`load_pickle_restricted` reads a plain pickle whose classes must all be on an allowlist.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, Dict, Tuple, Union

import torch

from ..errors import CorruptCheckpointError


class StandIn:
    """An object of a class we refuse to import: its constructor arguments and state, as data."""
    qualname = "?"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self):
        return f"<stand-in for {self.qualname}>"


def _stand_in(qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[-1], (StandIn,), {"qualname": qualname})


def load_torch_inert(source: Union[bytes, str], what: str) -> Any:
    """A torch.save payload (bytes, or a file's path) with stand-ins for every class it names (see
    the module docstring)."""
    opened = (lambda: io.BytesIO(source)) if isinstance(source, bytes) else (lambda: source)
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(opened())
        stand_ins = [(_stand_in(n), n) for n in names]
        with torch.serialization.safe_globals(stand_ins):
            return torch.load(opened(), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(f"{what} cannot be read as torch data without running code from it: {exc}") from None


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: Dict[Tuple[str, str], Any]):
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed here")


def load_pickle_restricted(data: bytes, allowed: Dict[Tuple[str, str], Any], what: str) -> Any:
    """A plain pickle whose every class is in `allowed` ((module, name) -> the object to use)."""
    try:
        return _Restricted(data, allowed).load()
    except Exception as exc:
        raise CorruptCheckpointError(f"{what} is not a pickle of the expected kind: {exc}") from None
