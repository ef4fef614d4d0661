"""ckpt_plugins: one parallelism-agnostic checkpoint core for Megatron, DeepSpeed and FSDP/HF."""
from .api import Checkpointer, LoadResult, SaveHandle, SaveInfo, checkpointer, load, read_metadata, save
from .errors import (CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, LoadMismatchError,
                     MetadataError, NotACheckpointError, SaveError, UnsafePathError)
from .fragment import Fragment, box_fragment, flat_fragments, flat_range_boxes
from .state import Handler, LoadItems, PerRank, SaveItems, tensor_fragments

__all__ = [
    "save", "load", "read_metadata", "checkpointer", "Checkpointer", "SaveInfo", "SaveHandle", "LoadResult",
    "PerRank",
    "Fragment", "box_fragment", "flat_fragments", "flat_range_boxes", "tensor_fragments",
    "Handler", "SaveItems", "LoadItems",
    "CheckpointError", "CorruptCheckpointError", "IncompleteCheckpointError", "LoadMismatchError",
    "MetadataError", "NotACheckpointError", "SaveError", "UnsafePathError",
]
__version__ = "0.1.0"
