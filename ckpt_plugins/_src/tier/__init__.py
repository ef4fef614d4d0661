"""The memory tier: checkpoints in the hosts' shared memory, replicated to a peer host."""
from .memory import MemoryTier

__all__ = ["MemoryTier"]
