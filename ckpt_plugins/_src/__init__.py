"""The implementation. Private: use `ckpt_plugins` (saving and loading) and `ckpt_plugins.ext`
(framework extensions); module names and signatures here change without notice."""
