"""The repository's scripts (``scripts/*.py``, not a package), loaded as modules for tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(stem: str) -> ModuleType:
    """A fresh module of ``scripts/<stem>.py`` (a test may patch it without touching another's)."""
    name = f"protolearn_script_{stem}"
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
