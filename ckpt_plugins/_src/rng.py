"""Random number generator states as plain data (tensors and JSON), so they can be checkpointed
without pickle and restored on any rank of any framework.

Python's, NumPy's and torch's CPU generators, plus the CUDA generators when CUDA is present.
Store the result per rank (`PerRank(rng_state())`): each rank has its own streams.
"""
from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch

from .format import Metadata
from .state import Handler, LoadItems, SaveItems


def rng_state() -> Dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: Dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state((nps["kind"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"],
                         nps["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGState(Handler):
    """A state entry that saves this rank's generators and restores them on load:
    `{"rng": RNGState()}`. A rank the checkpoint has no state for keeps its own (and the load
    result lists it in `kept_per_rank`)."""

    def save_items(self, prefix: str) -> SaveItems:
        return SaveItems(per_rank={prefix: rng_state()})

    def load_items(self, prefix: str, metadata: Metadata) -> LoadItems:
        return LoadItems(per_rank={prefix: set_rng_state})
