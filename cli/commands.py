"""Import every command module so that each registers itself on the app."""

import importlib

for _name in ("generate", "info", "gguf", "kernels", "bench", "serve", "chat"):
    try:
        importlib.import_module(f"cli.{_name}")
    except ModuleNotFoundError as e:
        if e.name != f"cli.{_name}":
            raise
