"""Test scaffolding (not shipped in the package): a char-level tokenizer (`tokenizer`), tiny random
models, prompt batches and worker configs (`tiny_models`), the tiny end-to-end run (`tiny_run`) and
a real `DataConfig` with overrides (`data`). `tests/` is on `sys.path` (pytest puts the root
conftest's folder there), so tests import them as ``from helpers.tiny_run import tiny_trainer``."""
