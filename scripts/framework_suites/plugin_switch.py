"""A pytest plugin that switches ckpt_plugins on in a framework's own test suite, through the
public switches a user flips, and nothing else:

- every `transformers.Trainer` gets `hf_ext.trainer.enable(trainer)`;
- every `accelerate.Accelerator` gets `hf_ext.accelerate.enable(accelerator)`;
- every DeepSpeed config gets `"checkpoint": {"backend": "bytecheckpoint"}` (`deepspeed_ext.install()`
  activates it in every `deepspeed.initialize`, the Trainer's and accelerate's included).

    pytest <the framework's checkpoint tests> -p plugin_switch      (this folder on PYTHONPATH)

DeepSpeed's tests run in worker processes forked from a forkserver: preload this module there too
(`multiprocessing.set_forkserver_preload`, or the suite runner's DS_WORKER_PRELOAD=plugin_switch).
Importing the module switches the plugin on; it patches only classes that are already importable.
"""
import functools
import importlib
import json
import os

_DONE = False


def _after_init(cls, enable):
    native = cls.__init__

    @functools.wraps(native)
    def __init__(self, *args, **kwargs):
        native(self, *args, **kwargs)
        if not getattr(self, "_ckpt_plugins_switched", False):
            self._ckpt_plugins_switched = True
            enable(self)

    cls.__init__ = __init__


def _with_backend(config):
    """A DeepSpeed config (dict, JSON path or JSON text) with the plugin's checkpoint entry."""
    if config is None:
        return config
    if isinstance(config, (str, os.PathLike)):
        text = open(config).read() if os.path.exists(config) else str(config)
        config = json.loads(text)
    if not isinstance(config, dict):
        return config
    return {**config, "checkpoint": {**config.get("checkpoint", {}), "backend": "bytecheckpoint"}}


def switch_on() -> None:
    global _DONE
    if _DONE:
        return
    _DONE = True
    try:
        transformers = importlib.import_module("transformers")
        import hf_ext.trainer
        _after_init(transformers.Trainer, hf_ext.trainer.enable)
    except ImportError:
        pass
    try:
        accelerate = importlib.import_module("accelerate")
        import hf_ext.accelerate
        _after_init(accelerate.Accelerator, hf_ext.accelerate.enable)
    except ImportError:
        pass
    try:
        deepspeed = importlib.import_module("deepspeed")
    except ImportError:
        return
    import deepspeed_ext
    deepspeed_ext.install()
    activating = deepspeed.initialize

    @functools.wraps(activating)
    def initialize(*args, **kwargs):
        for key in ("config", "config_params"):
            if key in kwargs:
                kwargs[key] = _with_backend(kwargs[key])
        args_ns = kwargs.get("args") or (args[0] if args else None)
        if args_ns is not None and getattr(args_ns, "deepspeed_config", None) and "config" not in kwargs:
            kwargs["config"] = _with_backend(args_ns.deepspeed_config)
            args_ns.deepspeed_config = None
        return activating(*args, **kwargs)

    deepspeed.initialize = initialize
    # the Trainer's and accelerate's DeepSpeed configs are dicts held by their HfDeepSpeedConfig
    try:
        hf_ds = importlib.import_module("transformers.integrations.deepspeed")
        native_config = hf_ds.HfDeepSpeedConfig.__init__

        def config_init(self, config_file_or_dict, *rest, **kwargs):
            native_config(self, _with_backend(config_file_or_dict), *rest, **kwargs)

        hf_ds.HfDeepSpeedConfig.__init__ = config_init
    except (ImportError, AttributeError):
        pass


def pytest_configure(config):
    switch_on()


switch_on()
