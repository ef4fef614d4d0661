"""ckpt_plugins: one parallelism-agnostic checkpoint core for Megatron, DeepSpeed and FSDP/HF."""
from ._src.api import (Checkpointer, DiffReport, KeyDiff, LoadResult, SaveHandle, SaveInfo, checkpoint_format,
                       checkpointer, diff, is_checkpoint, load, read_metadata, save, save_async)
from ._src.errors import (CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, LoadMismatchError,
                     MetadataError, NotACheckpointError, PeerLost, SaveError, UnsafePathError, VerificationError)
from ._src.manager import CheckpointManager
from ._src.data import DataChangedError, DataState, TokenPacker
from ._src.fragment import Fragment, box_fragment, flat_fragments, flat_range_boxes
from ._src.rng import RNGState, rng_state, set_rng_state
from ._src.state import Handler, Ignore, LoadItems, PerRank, SaveItems, register_handler
from ._src.tensor_map import tensor_fragments

__all__ = [
    "save", "save_async", "load", "read_metadata", "is_checkpoint", "checkpoint_format", "diff", "DiffReport",
    "KeyDiff", "checkpointer", "Checkpointer", "CheckpointManager", "SaveInfo", "SaveHandle", "LoadResult",
    "PerRank", "RNGState", "rng_state", "set_rng_state", "DataState", "DataChangedError", "TokenPacker",
    "Fragment", "box_fragment", "flat_fragments", "flat_range_boxes", "tensor_fragments",
    "Handler", "Ignore", "SaveItems", "LoadItems", "register_handler",
    "CheckpointError", "CorruptCheckpointError", "IncompleteCheckpointError", "LoadMismatchError",
    "MetadataError", "NotACheckpointError", "PeerLost", "SaveError", "UnsafePathError", "VerificationError",
]
__version__ = "0.1.0"
