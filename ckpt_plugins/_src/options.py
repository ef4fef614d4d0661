"""What a save is asked to do (`SaveOptions`) and the steps an extension or the checkpoint manager
runs around its commit (`SaveHooks`)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Union

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(value: Union[int, str, None], what: str = "host_memory") -> Optional[int]:
    """A size given as bytes or as text with a unit ("8GiB", "512 MB"); None stays None."""
    if value is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
    if match is not None and match.group(2).lower() in _UNITS:
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive number of bytes or a size such as '8GiB' or '512MB' "
                         "(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
                         f"not {value!r}")
    return value


def compress_mode(value: Union[bool, str]) -> Union[bool, str]:
    """`compress` checked: False, True (each tensor compressed where that shrinks it) or "auto"
    (where that also shortens the commit, as the save's writers measure it: `engine.pace`)."""
    if isinstance(value, bool) or value == "auto":
        return value
    raise ValueError(f"compress must be True, False or 'auto', not {value!r}")


@dataclass(frozen=True)
class SaveOptions:
    """`framework` and `layout`: where the state comes from (recorded, for tools and people).
    `step`: the training step it holds. `overwrite`: it may replace a committed checkpoint (which
    stays loadable until the new one commits). `base`: a committed checkpoint this state was built
    on (a PEFT run's frozen base): frozen parameters it holds alike are left to it (`base_ref`).
    `compress`: store each tensor compressed, chunk by chunk, where that shrinks it (`codec`; the
    writers compress, never the snapshot); "auto": only while that also shortens the commit.
    `delta_from`: an earlier committed checkpoint; every box it holds alike is stored as the XOR of
    each chunk with the same chunk there, compressed, a chunk that did not change not at all, unless
    that would make a chain of more than `max_chain` deltas (`delta`)."""
    framework: str = "torch"
    layout: Dict[str, Any] = field(default_factory=dict)
    step: Optional[int] = None
    overwrite: bool = False
    base: Any = None
    compress: Union[bool, str] = False
    delta_from: Any = None
    max_chain: int = 4  # deltas on deltas before a save stores everything again

    def __post_init__(self):
        compress_mode(self.compress)

    @property
    def recorded(self) -> Dict[str, Any]:
        """What the metadata records of them."""
        return {"framework": self.framework, "layout": dict(self.layout), "step": self.step}


@dataclass(frozen=True)
class SaveHooks:
    """`captured()`: in the caller's thread once the state is captured, before the save plans or
    writes anything; what it raises is raised as it is and nothing is saved, so it must fail
    alike on every rank (DeepSpeed's tag check, whose collective runs during the capture).
    `on_commit()`: on the coordinating rank right after the commit, before the save counts as
    done (a "latest" pointer, retention); its failure is the save's error. `on_summary(figures)`:
    there too, just before, with the save's telemetry summary (a run's history); its failure only
    logs. `then(coordinator, info)`: on every rank after the commit, on the background group,
    before the save counts as done (the memory tier replicates there, the HF Trainer writes its
    model files); its failure is the save's, so it must reach every rank through the coordinator
    (`Coordinator.agreed`)."""
    captured: Optional[Callable[[], None]] = None
    on_commit: Optional[Callable[[], None]] = None
    on_summary: Optional[Callable[[Dict[str, Any]], None]] = None
    then: Optional[Callable[[Any, Any], None]] = None


NO_HOOKS = SaveHooks()
