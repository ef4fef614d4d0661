"""Test-only shim that lets megatron-core 0.19.2 run on a CPU-only torch build.

Call ``install()`` in every rank (spawned process) before importing any megatron module; it is
idempotent. Where a GPU is present it applies only what a build without TE and Apex needs (the
norms, the HybridStack norm, the optimizer-load fixes). What it changes, and why (each is a CPU
stand-in for a CUDA call Megatron makes):

* triton: megatron imports ``triton`` unconditionally from
  ``megatron.core.transformer.moe.ops.paged_stash`` (reached from ``pipeline_parallel.schedules``,
  i.e. from ``import megatron.core``). That one module is loaded with a stub ``triton`` present only
  while it executes; the stub is then removed again, so ``import triton`` elsewhere still fails
  (torch's ``has_triton()`` and megatron's own ``try: import triton`` probes keep seeing "no triton").
* ``torch.cuda``: the functions megatron calls (current_device, synchronize, RNG, streams, events,
  memory queries, ...) are replaced by CPU-safe versions. The "CUDA" RNG *is* the CPU default
  generator. ``torch.cuda.is_available()`` stays False. This is process-wide: any other code in
  the same process that calls these functions gets the CPU versions instead of an error.
* A ``TorchFunctionMode`` (entered for the rest of the process, on the installing thread) maps
  ``device="cuda"`` / ``"cuda:N"`` / int devices to CPU in every torch call, makes ``.cuda()`` and
  ``.pin_memory()`` identity, and makes ``Tensor.type()`` (no argument) report
  ``torch.cuda.FloatTensor``-style names, which megatron's optimizers check. Tensors are never
  actually moved; only calls naming a CUDA device are affected. It costs some Python overhead per
  torch call (fine for tiny test models). torch function modes are thread-local: the autograd
  engine runs CPU backward on the calling thread, so hooks see it too.
* ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` read and
  write the CPU default generator (the originals go through ``torch.cuda.default_generators`` and
  ``torch.cuda._lazy_call``, which on a CPU build fail or queue the call forever).
* ``typing.override`` (Python 3.12) aliased to ``typing_extensions.override``: megatron.training's
  model builders import it, and the 0.19.2 wheel is installed on 3.11 (see docs/install.md).
* The MoE alltoall dispatcher moves its split sizes to the host as NumPy arrays only when they are
  CUDA tensors (`moe_utils.maybe_move_tensor_to_cpu`); on CPU they stay tensors, which gloo's
  `all_to_all_single` rejects. On CPU they become the same NumPy arrays the GPU path makes.
* torch's norms refuse sequence parallelism (`WrappedTorchNorm`), which megatron requires for MoE
  with TP; Apex and TE norms, absent here, support it by marking their weights `sequence_parallel`
  so that their gradients are summed over TP. The norm is built as without it and marked so.
* `HybridStack` builds its final norm as TE's `TENorm` whatever the spec says; without TE it is the
  local spec's norm (`WrappedTorchNorm`), as every other norm in these tests.
* Two upstream distributed-optimizer bugs with the torch AdamW fallback (no TE/apex), both on the
  *load* path only (training does not reach them): see ``_patch_distrib_optimizer_load``.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE = None

# Modules that do a bare `import triton` at import time on the GPT path.
_TRITON_MODULES = ("megatron.core.transformer.moe.ops.paged_stash",)


# --------------------------------------------------------------------------------------------
# (a) triton stub, present only while the modules that need it execute
# --------------------------------------------------------------------------------------------
class _Anything:
    """Stands for any triton / triton.language attribute (tl.constexpr, tl.int64, ...)."""

    def __init__(self, name="triton"):
        self._name = name

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        return _Anything(f"{self._name}()")

    def __repr__(self):
        return f"<triton stub {self._name}>"


def _stub_jit(fn=None, **kwargs):
    """`@triton.jit` and `@triton.jit(...)`: a kernel object that raises if ever launched."""
    if fn is None:
        return lambda f: _not_runnable(f)
    return _not_runnable(fn)


def _not_runnable(fn):
    class _Kernel:
        __name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid):
            raise RuntimeError(f"triton kernel {self.__name__} called under the CPU test shim")

        def __call__(self, *a, **k):
            raise RuntimeError(f"triton kernel {self.__name__} called under the CPU test shim")

    return _Kernel()


def _make_triton_stub() -> dict:
    triton = types.ModuleType("triton")
    triton.__path__ = []  # a package, so `import triton.language` resolves from sys.modules
    triton.__version__ = "0.0.0-cpu-stub"
    triton.jit = _stub_jit
    triton.autotune = lambda *a, **k: (lambda f: f)
    triton.heuristics = lambda *a, **k: (lambda f: f)
    triton.Config = lambda *a, **k: None
    triton.cdiv = lambda a, b: -(-a // b)
    triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    language = types.ModuleType("triton.language")
    language.__getattr__ = lambda name: _Anything(f"triton.language.{name}")
    triton.language = language
    return {"triton": triton, "triton.language": language}


def _triton_importable() -> bool:
    if "triton" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _preload_with_triton_stub(modname: str) -> None:
    """Execute `modname` from its file with a stub triton in sys.modules, register it under its
    full name, then take the stub out again. Its parent packages are not imported here (that
    would import all of megatron.core while the stub is visible); a later import of the parent
    package finds the module in sys.modules."""
    if modname in sys.modules:
        return
    import megatron  # namespace/regular package root: cheap, imports no submodule

    rel = modname.split(".")[1:]
    path = None
    for root in megatron.__path__:
        candidate = os.path.join(root, *rel) + ".py"
        if os.path.exists(candidate):
            path = candidate
            break
    if path is None:
        raise ImportError(f"cannot find {modname}")
    stub = _make_triton_stub()
    saved = {k: sys.modules.get(k) for k in stub}
    sys.modules.update(stub)
    try:
        spec = importlib.util.spec_from_file_location(modname, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[modname]
            raise
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


# --------------------------------------------------------------------------------------------
# (b) torch.cuda -> CPU
# --------------------------------------------------------------------------------------------
class _Stream:
    """Stands for torch.cuda.Stream: CPU work is synchronous, so every method is a no-op."""

    def __init__(self, *args, **kwargs):
        self.device = torch.device("cpu")
        self.priority = kwargs.get("priority", 0)

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, _Stream)

    def __hash__(self):
        return 0


class _Event:
    """Stands for torch.cuda.Event; elapsed_time is 0 (nothing is timed on CPU)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end_event):
        return 0.0


_DEFAULT_STREAM = _Stream()


def _cpu_get_rng_state(device="cuda"):
    return torch.default_generator.get_state()


def _cpu_set_rng_state(new_state, device="cuda"):
    torch.default_generator.set_state(new_state)


def _cpu_manual_seed(seed):
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: calling it here would recurse.
    torch.default_generator.manual_seed(int(seed))


_CUDA_FUNCS = {
    # megatron uses current_device() as a device argument; CPU has no index. "cpu" works for
    # device=..., .to(...), torch.device(...); int-typed uses go through the function mode.
    "current_device": lambda: "cpu",
    "synchronize": lambda device=None: None,
    "set_device": lambda device: None,
    "empty_cache": lambda: None,
    "device_count": lambda: 1,
    "memory_allocated": lambda device=None: 0,
    "max_memory_allocated": lambda device=None: 0,
    "memory_reserved": lambda device=None: 0,
    "max_memory_reserved": lambda device=None: 0,
    "reset_peak_memory_stats": lambda device=None: None,
    "memory_stats": lambda device=None: {},
    "manual_seed": _cpu_manual_seed,
    "manual_seed_all": _cpu_manual_seed,
    "get_rng_state": _cpu_get_rng_state,
    "set_rng_state": _cpu_set_rng_state,
    "get_rng_state_all": lambda: [torch.default_generator.get_state()],
    "set_rng_state_all": lambda states: torch.default_generator.set_state(list(states)[0]),
    "current_stream": lambda device=None: _DEFAULT_STREAM,
    "default_stream": lambda device=None: _DEFAULT_STREAM,
    "set_stream": lambda stream: None,
    "stream": lambda stream=None: contextlib.nullcontext(stream),
    "Stream": _Stream,
    "Event": _Event,
    # megatron.training's argument validation asks for the GPU architecture (Hopper here: no
    # Blackwell-only paths)
    "get_device_properties": lambda device=None: types.SimpleNamespace(major=9, minor=0, name="cpu (shim)",
                                                                       total_memory=0, multi_processor_count=1),
    "get_device_capability": lambda device=None: (9, 0),
}


def _patch_torch_cuda() -> None:
    for name, fn in _CUDA_FUNCS.items():
        setattr(torch.cuda, name, fn)
    # megatron also calls them through the submodule (torch.cuda.random.get_rng_state).
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all",
                 "get_rng_state_all", "set_rng_state_all"):
        setattr(torch.cuda.random, name, _CUDA_FUNCS[name])


# --------------------------------------------------------------------------------------------
# (c)+(d) a torch function mode: CUDA device arguments -> CPU, .cuda()/.pin_memory() identity,
# Tensor.type() names as on CUDA
# --------------------------------------------------------------------------------------------
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.bool: "torch.cuda.BoolTensor",
}
_CPU = torch.device("cpu")


def _map_device(d):
    if isinstance(d, bool):
        return d
    if isinstance(d, int):
        return _CPU
    if isinstance(d, str) and d.startswith("cuda"):
        return _CPU
    if isinstance(d, torch.device) and d.type == "cuda":
        return _CPU
    return d


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites the device arguments of every torch call (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = args[0]
            if t.device.type == "cpu" and t.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[t.dtype]
            return func(*args)
        if func is torch.Tensor.type and len(args) == 2 and isinstance(args[1], str):
            args = (args[0], args[1].replace("torch.cuda.", "torch."))
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _map_device(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# (e) megatron's CUDA RNG state helpers on the CPU generator
# --------------------------------------------------------------------------------------------
def _mcore_get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.default_generator.get_state()


def _mcore_set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    torch.default_generator.set_state(new_state)


def _rebind_everywhere(originals: dict) -> None:
    """Replace module-level references (`from ... import _get_cuda_rng_state`) to the originals."""
    for mod in list(sys.modules.values()):
        if mod is None or not getattr(mod, "__name__", "").startswith("megatron"):
            continue
        d = getattr(mod, "__dict__", {})
        for name, (orig, new) in originals.items():
            if d.get(name) is orig:
                d[name] = new


def _patch_megatron_rng() -> None:
    rnd = importlib.import_module("megatron.core.tensor_parallel.random")
    originals = {
        "_get_cuda_rng_state": (rnd._get_cuda_rng_state, _mcore_get_cuda_rng_state),
        "_set_cuda_rng_state": (rnd._set_cuda_rng_state, _mcore_set_cuda_rng_state),
    }
    _rebind_everywhere(originals)


# --------------------------------------------------------------------------------------------
# (f) upstream distributed-optimizer bugs with the torch AdamW fallback
# --------------------------------------------------------------------------------------------
def _patch_distrib_optimizer_load() -> None:
    """Two bugs on the *load* path of megatron's DistributedOptimizer with the torch AdamW fallback
    (training never reaches them; megatron's own save/load of the optimizer does):

    1. `_set_main_param_and_optimizer_states` copies every tensor in the live Adam state, and
       torch AdamW keeps `step` as a tensor there, so it indexes `tensors['step']`; the loaded
       per-parameter dicts have no `step` (megatron restores it from the param groups) ->
       KeyError. Fix: treat keys missing from the loaded dict as "leave as is".
    2. `load_parameter_state_from_dp_reshardable` copies into the fp32 shards, which for fp32
       models are views of leaf parameters that require grad, without `torch.no_grad()` ->
       "a leaf Variable that requires grad is being used in an in-place operation". Fix: run
       it under no_grad (its siblings already are)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO

    if getattr(DO, "_cpu_shim_patched", False):
        return
    set_states = DO._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            live = self._get_main_param_and_optimizer_states(model_param)
            tensors = {**{k: None for k in live if k not in tensors}, **tensors}  # None is skipped
        return set_states(self, model_param, tensors)

    load_dp = DO.load_parameter_state_from_dp_reshardable

    def load_parameter_state_from_dp_reshardable(self, state_dict):
        with torch.no_grad():
            return load_dp(self, state_dict)

    DO._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DO.load_parameter_state_from_dp_reshardable = load_parameter_state_from_dp_reshardable
    DO._cpu_shim_patched = True


def _patch_moe_split_sizes() -> None:
    utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    original = utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    _rebind_everywhere({"maybe_move_tensor_to_cpu": (original, maybe_move_tensor_to_cpu)})
    utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_torch_norm_sequence_parallel() -> None:
    import dataclasses

    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    original = WrappedTorchNorm.__new__

    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        norm = original(cls, dataclasses.replace(config, sequence_parallel=False), *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)
    importlib.import_module("megatron.core.models.hybrid.hybrid_block").TENorm = WrappedTorchNorm


def install(fix_optimizer_load: bool = True) -> None:
    """Make megatron-core importable and runnable on CPU in this process. Idempotent.
    fix_optimizer_load=False leaves the two upstream load bugs in place (to reproduce them)."""
    global _INSTALLED, _MODE
    if _INSTALLED:
        return
    on_cpu = not torch.cuda.is_available()  # on a GPU only the fixes for a build without TE and Apex apply
    if on_cpu:
        _patch_torch_cuda()
    import typing
    if not hasattr(typing, "override"):  # Python 3.12's, used by megatron.training on this 3.11
        import typing_extensions
        typing.override = typing_extensions.override
    if not _triton_importable():
        for name in _TRITON_MODULES:
            _preload_with_triton_stub(name)
    import megatron.core  # noqa: F401  (now importable)

    _patch_torch_norm_sequence_parallel()
    if fix_optimizer_load:
        _patch_distrib_optimizer_load()
    if on_cpu:
        _patch_megatron_rng()
        _patch_moe_split_sizes()
        _MODE = CudaToCpuMode()
        _MODE.__enter__()  # for the rest of the process (this thread)
    _INSTALLED = True
