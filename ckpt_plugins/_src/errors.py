"""The exceptions ckpt_plugins raises. Every problem with a checkpoint is a CheckpointError."""


class CheckpointError(Exception):
    """Base class: anything wrong with a checkpoint, its plan, or its storage."""


class NotACheckpointError(CheckpointError):
    """The path holds no ckpt_plugins checkpoint at all (missing, empty, or foreign)."""


class IncompleteCheckpointError(CheckpointError):
    """The path holds a save that never committed (no metadata file): it is never loaded."""


class MetadataError(CheckpointError):
    """The metadata file is malformed, of an unknown version, or inconsistent."""


class UnsafePathError(MetadataError):
    """The metadata names a file outside the checkpoint directory."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes disagree with the metadata: checksum mismatch or truncated data file."""


class LoadMismatchError(CheckpointError):
    """What the caller wants to load does not fit the checkpoint: keys, shapes, dtypes, coverage."""


class DataChangedError(LoadMismatchError):
    """A data loader's data no longer matches the checkpoint's (its length or order changed)."""


class SaveError(CheckpointError):
    """A save failed on some rank; nothing was committed."""


class PeerLost(CheckpointError):
    """A rank stopped answering (its process died, or its host): the job's group is broken."""


class VerificationError(CheckpointError):
    """A verified load found the live state differing from what the load put in it."""
