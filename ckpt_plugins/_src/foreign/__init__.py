"""Checkpoints in other formats, loaded in place: each format's reader presents one as foreign
metadata (`view`), which the ordinary load plan reshards and reads once. Readers are tried in
order on a directory that is not ours; extensions add their frameworks' native formats with
`register_reader`.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import CheckpointError, CorruptCheckpointError
from ..format import Metadata, stored_entries
from ..state import Ignore
from ..storage import Storage
from .dcp import NAME as DCP, is_dcp_dir, read_dcp
from .pickles import StandIn, load_pickle_restricted, load_torch_inert
from .safetensors import NAME as HF, is_hf_dir, read_hf_dir
from .view import ComputedObject, ForeignMetadata

__all__ = ["ForeignReader", "register_reader", "read_foreign", "detect", "fit_state", "HF", "DCP", "readers",
           "ForeignMetadata", "ComputedObject", "StandIn", "load_pickle_restricted", "load_torch_inert"]


@dataclass(frozen=True)
class ForeignReader:
    name: str  # what the format is called in messages: "HF safetensors"
    detect: Callable[[Storage], bool]  # cheap: a marker file
    read: Callable[[Storage], ForeignMetadata]


_READERS: List[ForeignReader] = [ForeignReader(HF, is_hf_dir, read_hf_dir), ForeignReader(DCP, is_dcp_dir, read_dcp)]
_DISCOVERED: List[bool] = []
ENTRY_POINTS = "ckpt_plugins.readers"  # extensions' formats, found on first use whatever the job imported


def register_reader(reader: ForeignReader) -> None:
    """Make `load` and the tools read another format. Extensions' readers go before the built-in
    ones: a framework's native directory may also look like one of them (Megatron's is DCP)."""
    if all(r.name != reader.name for r in _READERS):
        _READERS.insert(sum(r.name not in (HF, DCP) for r in _READERS), reader)


def _readers() -> List[ForeignReader]:
    if not _DISCOVERED:
        _DISCOVERED.append(True)
        for entry in entry_points(group=ENTRY_POINTS):
            register_reader(entry.load())
    return _READERS


def readers() -> List[str]:
    return [r.name for r in _readers()]


def fit_state(state: Dict[str, Any], metadata: Metadata) -> Tuple[Dict[str, Any], List[str]]:
    """A framework's whole state, fitted to what a foreign checkpoint holds: the entries it lacks
    (a scheduler, counters, RNG: a foreign checkpoint has the model and perhaps an optimizer) are
    left out and returned, to be named to the user; its entries the state has no place for
    (another framework's extra state) are ignored. Within an entry, `strict` applies as ever."""
    held = stored_entries(metadata)
    fitted = {k: v for k, v in state.items() if k in held or isinstance(v, Ignore)}
    fitted.update({k: Ignore() for k in held if k not in fitted})
    return fitted, sorted(k for k, v in state.items() if k not in held and not isinstance(v, Ignore))


def detect(storage: Storage) -> Optional[str]:
    """The name of the format a reader knows the directory as; None when none does."""
    return next((r.name for r in _readers() if r.detect(storage)), None)


def read_foreign(storage: Storage) -> Optional[ForeignMetadata]:
    """The directory as foreign metadata, or None when no reader knows it."""
    for reader in _readers():
        if reader.detect(storage):
            try:
                return reader.read(storage)
            except (CheckpointError, OSError):
                raise
            except Exception as exc:  # a malformed file the format's own checks let through
                raise CorruptCheckpointError(f"{storage} is not a readable {reader.name} checkpoint: "
                                             f"{type(exc).__name__}: {exc}") from None
    return None
