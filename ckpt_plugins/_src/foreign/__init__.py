"""Checkpoints in other formats, loaded in place: each format's reader presents one as foreign
metadata (`view`), which the ordinary load plan reshards and reads once. Readers are tried in
order on a directory that is not ours; extensions add their frameworks' native formats with
`register_reader`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

from ..storage import Storage
from .dcp import is_dcp_dir, read_dcp
from .pickles import StandIn, load_pickle_restricted, load_torch_inert
from .safetensors import is_hf_dir, read_hf_dir
from .view import ComputedObject, ForeignMetadata

__all__ = ["ForeignReader", "register_reader", "read_foreign", "readers", "ForeignMetadata", "ComputedObject",
           "StandIn", "load_pickle_restricted", "load_torch_inert"]


@dataclass(frozen=True)
class ForeignReader:
    name: str  # what the format is called in messages: "HF safetensors"
    detect: Callable[[Storage], bool]  # cheap: a marker file
    read: Callable[[Storage], ForeignMetadata]


_READERS: List[ForeignReader] = [ForeignReader("HF safetensors", is_hf_dir, read_hf_dir),
                                 ForeignReader("PyTorch DCP", is_dcp_dir, read_dcp)]


def register_reader(reader: ForeignReader, first: bool = False) -> None:
    """Make `load` and the tools read another format (`first`: before the built-in ones, for a
    format whose directories also look like one of them)."""
    if all(r.name != reader.name for r in _READERS):
        _READERS.insert(0 if first else len(_READERS), reader)


def readers() -> List[str]:
    return [r.name for r in _READERS]


def read_foreign(storage: Storage) -> Optional[ForeignMetadata]:
    """The directory as foreign metadata, or None when no reader knows it."""
    for reader in _READERS:
        if reader.detect(storage):
            return reader.read(storage)
    return None
