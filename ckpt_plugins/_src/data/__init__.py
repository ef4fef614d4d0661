"""Data-loader state that reshards: `DataState` (a loader's global position, and a packer's
pending tokens) and `TokenPacker`."""
from .packing import TokenPacker
from ..errors import DataChangedError
from .state import DataState

__all__ = ["DataState", "DataChangedError", "TokenPacker"]
