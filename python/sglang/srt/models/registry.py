"""Model classes keyed by HF architecture name.

Every module in sglang.srt.models that exports `EntryClass` (a class or a list of
classes) is registered under each class's __name__, which must equal the HF
`architectures` entry it serves.
"""

from __future__ import annotations

import functools
import importlib
import logging
import pkgutil

from torch import nn

import sglang.srt.models as models_pkg

logger = logging.getLogger(__name__)


@functools.cache
def _registry() -> dict[str, type[nn.Module]]:
    found: dict[str, type[nn.Module]] = {}
    for info in pkgutil.iter_modules(models_pkg.__path__):
        if info.name == "registry":
            continue
        try:
            module = importlib.import_module(f"{models_pkg.__name__}.{info.name}")
        except Exception:  # one broken model module must not hide the others
            logger.exception("failed to import model module %s; its architectures are unavailable", info.name)
            continue
        entry = getattr(module, "EntryClass", None)
        for cls in entry if isinstance(entry, (list, tuple)) else [entry] if entry else []:
            found[cls.__name__] = cls
    return found


def supported_architectures() -> list[str]:
    return sorted(_registry())


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """The class for the first supported name in `architectures`."""
    registry = _registry()
    for arch in architectures or []:
        if arch in registry:
            return registry[arch]
    raise ValueError(f"model architectures {architectures} are not supported; supported: {', '.join(supported_architectures())}")
