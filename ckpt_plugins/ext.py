"""The API for framework extensions: what `hf_ext`, `deepspeed_ext` and `megatron_ext` (and any
third-party extension) may use of the core, besides `ckpt_plugins`' own top level. Everything
else in the package is private and may change without notice.

- Handlers: a framework's state entries as fragments and objects (`Handler`, `SaveItems`,
  `LoadItems`), the core's own handlers to build on (`OptimizerHandler`, `DictHandler`), and the
  layouts optimizer state is stored through (`ParamLayout`, `flat_layout`, `plain_layout`).
- Tensors as fragments of canonical tensors: `Fragment`, flat pieces, `Segment`s, `TensorMap`, and
  how a framework's models are stored (`ModelMapping`, `register_model_mapping`).
- The shared model families: the HF families' names (`FAMILIES`), sizes (`Dims`) and config.json
  (`hf_config`, `model_config`).
- Checkpoints as data: metadata, stored objects, pointers, storage backends, offline reading and
  writing (importers, exporters), data positions, the memory tier, and the agreement a step every
  rank runs after a commit goes through (`Coordinator.agreed`).
- Saves beside training: `StepGate` makes the optimizer step wait for an overlapped save's snapshot;
  `overlapped` is the hooks' rule for when a save overlaps; `committed_first` makes a framework's
  end of training wait for the last save's commit.
- Checkpoints in other formats, read in place: `ForeignMetadata` (what a reader presents),
  `ForeignReader` and `register_reader` (another format), the safetensors and DCP readers' parts.
- Optional dependencies: `require(module, what)`, whose `MissingDependency` names the install, and
  `require_version` for code that relies on a version's behaviour (`UnsupportedVersion`).
"""
from __future__ import annotations

from ._src.base_ref import BASE, reference, resolve
from ._src.committed import read_object, read_pointer
from ._src.coordinator import Coordinator
from ._src.data.position import load_position, position_items
from ._src.data.stream import Order, epoch_order
from ._src.families.dims import Dims
from ._src.families.family import FAMILIES, Family
from ._src.families.hf_config import HF_CONFIG, ModelConfig, hf_config, model_config
from ._src.families.segments import Segment, segment_fragments, segment_pieces, whole, within, zero_padding
from ._src.foreign import (DCP, HF, ForeignMetadata, ForeignReader, StandIn, fit_state, load_pickle_restricted,
                           load_torch_inert, register_reader)
from ._src.foreign.dcp import (DCP_METADATA, DcpNaming, chunk_boxes, chunk_location, data_files, dcp_index,
                               read_dcp_metadata, register_dcp_naming)
from ._src.foreign.archive import TensorLocation, read_archive, read_located
from ._src.foreign.view import FOREIGN_CHUNK, Transform, computed, raw_box, tensor_meta, view_boxes
from ._src.foreign.dcp_export import export_dcp
from ._src.foreign.safetensors import SAFE_INDEX, SAFE_NAME, ST_DTYPES as SAFETENSORS_DTYPES, safetensors_metadata
from ._src.format import (DATA_DIR, FORMAT_NAME, MASTER, MODEL, OPTIM, Metadata, dtype_from_name, dtype_name,
                          master_key, stored_entries)
from ._src.fragment import Box, FlatPiece, Fragment, Shape, box_fragment, flat_views
from ._src.offline import LazyFragment, open_checkpoint, read_tensor, write_checkpoint
from ._src.optional import MissingDependency, UnsupportedVersion, require, require_version
from ._src.options import SaveHooks
from ._src.plan import TensorSpec, choose_source
from ._src.progress import progress_bar
from ._src.results import take_finished
from ._src.step_gate import StepGate, committed_first, overlapped
from ._src.state import (DictHandler, Handler, Ignore, LoadItems, OptimizerHandler, ParamLayout,
                    PerRank, SaveItems, add_master_sources, canonical_name, flat_layout, frozen_keys,
                    plain_layout, register_handler, saved_groups)
from ._src.storage import AlignedStream, LocalStorage, Storage, register_scheme, storage_for
from ._src.tensor_map import ModelMapping, TensorMap, model_mapping, register_model_mapping, tensor_fragments, tensor_map
from ._src.tier import MemoryTier

__all__ = [
    # handlers
    "Handler", "SaveItems", "LoadItems", "Ignore", "PerRank", "register_handler", "DictHandler", "OptimizerHandler",
    "ParamLayout", "flat_layout", "plain_layout", "saved_groups", "canonical_name", "add_master_sources",
    "frozen_keys", "MODEL", "OPTIM", "MASTER", "master_key",
    # tensors
    "Fragment", "FlatPiece", "Box", "Shape", "box_fragment", "flat_views", "tensor_fragments", "Segment", "whole",
    "segment_fragments", "segment_pieces", "within", "zero_padding", "TensorMap", "ModelMapping", "register_model_mapping",
    "model_mapping", "tensor_map",
    # families
    "FAMILIES", "Family", "Dims", "HF_CONFIG", "ModelConfig", "hf_config", "model_config",
    # checkpoints as data
    "Metadata", "DATA_DIR", "FORMAT_NAME", "stored_entries", "dtype_name", "dtype_from_name", "read_object", "read_pointer", "TensorSpec",
    "choose_source", "Storage", "LocalStorage", "AlignedStream", "storage_for", "register_scheme", "LazyFragment",
    "open_checkpoint", "read_tensor", "write_checkpoint", "BASE", "reference", "resolve", "StandIn",
    "load_pickle_restricted", "load_torch_inert", "Order", "epoch_order", "load_position", "position_items",
    "MemoryTier", "Coordinator", "SaveHooks", "StepGate", "overlapped", "committed_first", "take_finished",
    "progress_bar", "bcp",
    # foreign checkpoints
    "ForeignMetadata", "ForeignReader", "register_reader", "fit_state", "HF", "DCP",
    "FOREIGN_CHUNK", "tensor_meta", "view_boxes", "raw_box", "computed", "Transform", "TensorLocation", "read_archive",
    "read_located", "chunk_boxes", "data_files", "dcp_index", "DcpNaming",
    "register_dcp_naming", "DCP_METADATA", "chunk_location", "read_dcp_metadata", "export_dcp",
    "SAFE_INDEX", "SAFE_NAME", "SAFETENSORS_DTYPES", "safetensors_metadata",
    # optional dependencies
    "require", "require_version", "MissingDependency", "UnsupportedVersion",
]


def bcp(argv) -> int:
    """Run a `bcp` command (its arguments as a list): how an extension's tools reuse another's."""
    from .cli import main
    return main(argv)
