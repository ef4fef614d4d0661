"""CPU-only workarounds for running DeepSpeed's own unit tests (tests/unit/checkpoint) on a
machine without GPUs, with DeepSpeed 0.19.8 installed with DS_BUILD_OPS=0 (see README.md here).

Load it as a pytest plugin:   PYTHONPATH=scripts/framework_suites pytest -p deepspeed_cpu_shim ...

It does not touch DeepSpeed's test files. What it does, in the pytest process *and* in every
worker process that DeepSpeed's DistributedTest launches (the workers are forked from a
`forkserver` server, so this module is registered as a forkserver preload module and is imported
there before any worker is forked). Extra modules for the workers: DS_WORKER_PRELOAD=mod1,mod2
(importable via PYTHONPATH) are preloaded into the forkserver after this one - a plugin given with
`-p` only acts in the pytest process, not in DeepSpeed's worker processes, unless it is preloaded
this way (or preloads itself).

1. LOCAL_SIZE defaults to 4, so that the CPU accelerator's device_count() is 4 and
   DistributedTest does not skip tests with world_size 2..4 ("not enough GPUs").
   (The run scripts also export LOCAL_SIZE=4; the workers get LOCAL_SIZE=world_size from
   DistributedTest itself.)
2. `deepspeed.comm.torch.build_shm_op` becomes a no-op returning None: the first
   init_distributed() would otherwise JIT-compile the shared-memory comm op (130-165 s),
   which gloo training never uses.
3. `DeepSpeedEngine.sparse_tensor_module_names` is given an empty (frozen)set: the attribute
   was removed from DeepSpeed 0.19.x but tests/unit/checkpoint/common.py still compares it.
4. Nothing is ever JIT-compiled: `OpBuilder.jit_load` raises pytest's Skipped with a message
   naming the op (e.g. FusedAdamBuilder / CPUAdamBuilder). DistributedTest forwards a worker's
   skip to the pytest process, so such tests are reported as SKIPPED with
   "deepspeed_cpu_shim: needs JIT compile of op <name>"; CPU_SHIM_COMPILE=1 builds them instead
   (FusedAdam's CPU op, which DeepSpeed picks for "type": "Adam", builds in about half a minute).
5. (pytest compatibility, not CPU) DeepSpeed pins pytest<8.4; this venv has pytest 9, which no
   longer registers DeepSpeed's `DistributedFixture` subclasses as fixtures (they relied on the
   private `_pytestfixturefunction` attribute), so every test using one errors with
   "fixture 'xxx' not found". When a test module is collected, each DistributedFixture subclass
   found in its namespace is registered as a function-scoped fixture of the same name that does
   what DeepSpeed's conftest does for it (instantiate the class and call it with the request,
   which launches its world_size processes). The classes themselves are left in place, so they
   still pickle by reference into the worker processes.
"""

import importlib
import multiprocessing
import os

_APPLIED = False


def _apply():
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True

    os.environ.setdefault("LOCAL_SIZE", "4")

    # 2. no shm comm op build. Patch the module object itself (an `import ... as m` binding
    #    could be a different object than the one TorchBackend.__init__ resolves names in).
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    comm_torch.build_shm_op = lambda *args, **kwargs: None

    # 3. attribute removed from the engine but still read by the tests' helpers
    engine_mod = importlib.import_module("deepspeed.runtime.engine")
    if not hasattr(engine_mod.DeepSpeedEngine, "sparse_tensor_module_names"):
        engine_mod.DeepSpeedEngine.sparse_tensor_module_names = frozenset()

    # 4. never JIT-compile an op: skip the test instead
    builder_mod = importlib.import_module("deepspeed.ops.op_builder.builder")

    def _no_jit_load(self, verbose=True):
        import pytest

        pytest.skip(f"deepspeed_cpu_shim: needs JIT compile of op {self.name} ({type(self).__name__}); "
                    "nothing is compiled in this run (DS_BUILD_OPS=0)")

    if not os.environ.get("CPU_SHIM_COMPILE"):  # CPU_SHIM_COMPILE=1: build ops (fused_adam: ~30 s here)
        builder_mod.OpBuilder.jit_load = _no_jit_load


def _is_dist_fixture_class(obj):
    return (isinstance(obj, type) and obj.__name__ != "DistributedFixture"
            and any(c.__name__ == "DistributedFixture" for c in obj.__mro__[1:]))


def _make_dist_fixture(cls, name):
    import pytest

    def _dist_fixture(request):
        cls()(request)  # DistributedExec.__call__: launches the processes and runs cls.run

    _dist_fixture.__name__ = name
    _dist_fixture.__qualname__ = f"deepspeed_cpu_shim.{name}"
    return pytest.fixture(name=name)(_dist_fixture)


def pytest_collectstart(collector):
    import types

    import pytest

    if not isinstance(collector, pytest.Module) or tuple(pytest.version_tuple[:2]) < (8, 4):
        return
    try:
        module = collector.obj  # imports the test module (cached by pytest)
    except BaseException:
        return  # let pytest's own collection report the import error / module-level skip
    fixtures = {
        name: obj
        for name, obj in vars(module).items()
        if _is_dist_fixture_class(obj) and getattr(obj, "is_dist_fixture", False)
    }
    if not fixtures:
        return
    holder = types.ModuleType(f"deepspeed_cpu_shim_fixtures_{module.__name__}")
    for name, cls in fixtures.items():
        setattr(holder, name, _make_dist_fixture(cls, name))
    collector.session._fixturemanager.parsefactories(holder=holder, node=collector)


def pytest_configure(config):
    _apply()
    # DistributedTest starts its workers through the forkserver start method; make the
    # forkserver import this module first so that every forked worker inherits the patches.
    # Modules named in DS_WORKER_PRELOAD (comma-separated, e.g. a checkpoint plugin that must also
    # act inside the workers) are preloaded after it; existing preload entries are kept.
    import multiprocessing.forkserver as _fs

    existing = list(getattr(getattr(_fs, "_forkserver", None), "_preload_modules", None) or [])
    extra = [m.strip() for m in os.environ.get("DS_WORKER_PRELOAD", "").split(",") if m.strip()]
    mods = ["deepspeed_cpu_shim"]
    for m in existing + extra:
        if m not in mods:
            mods.append(m)
    multiprocessing.set_forkserver_preload(mods)


# Imported as a forkserver preload module (not as a pytest plugin): apply at import time.
if __name__ == "deepspeed_cpu_shim":
    try:
        _apply()
    except Exception:  # never break the forkserver; the test would then show the real error
        pass
