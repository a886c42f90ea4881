"""Resolve a model's entry point to a handler instance.

Design note: runs in the backend worker process only. An entry point is one of
  - a built-in name: ``huggingface``, ``echo``, ``rolling`` (imported lazily, so ``echo`` never pulls torch);
    ``huggingface`` with ``option.task=embedding`` is ``handlers.embedding.EmbeddingHandler``;
  - a ``*.py`` file inside the model folder (``model.py`` by DJL convention), imported by path under a
    unique module name; the resolved path must stay inside the model folder;
  - a dotted ``package.module`` or ``package.module:ClassName``.
A module provides either a ``Handler``/``RollingHandler`` subclass (chosen by the ``handler`` option, else
a class named ``Handler``, else the only subclass it defines) or DJL-style functions ``handle(inputs)``
and optional ``initialize(ctx)``, wrapped in ``FunctionHandler``. ``load_handler`` does not call
``initialize``: the worker does, once, with the same context. Every failure is a ``ValueError`` that
says what is missing.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from handlers.base import Context, Handler, Input, Output, RollingHandler
from rollcore.options import option_value

BUILTIN_HANDLERS: dict[str, str] = {
    "huggingface": "handlers.huggingface:HuggingFaceHandler",
    "echo": "handlers.echo:EchoHandler",
    "rolling": "handlers.rolling_handler:HuggingFaceRollingHandler",
    # DJL spellings of the same handlers.
    "djl_python.huggingface": "handlers.huggingface:HuggingFaceHandler",
}

EMBEDDING_HANDLER = "handlers.embedding:EmbeddingHandler"  # huggingface with option.task=embedding

AnyHandler = Handler | RollingHandler


class FunctionHandler(Handler):
    """Adapts DJL-style module functions ``handle(inputs) -> list[Output]`` (+ ``initialize(ctx)``).

    A returned ``str`` becomes an Output's text and any other non-Output value its payload, so simple
    custom handlers need not build Outputs. Raises ``ValueError`` when the answer count is wrong.
    """

    def __init__(self, handle_fn: Callable[[list[Input]], Any],
                 initialize_fn: Callable[[Context], Any] | None = None) -> None:
        self._handle_fn = handle_fn
        self._initialize_fn = initialize_fn

    def initialize(self, ctx: Context) -> None:
        if self._initialize_fn is not None:
            self._initialize_fn(ctx)

    def handle(self, inputs: Sequence[Input]) -> list[Output]:
        results = self._handle_fn(list(inputs))
        if not isinstance(results, (list, tuple)) or len(results) != len(inputs):
            got = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
            raise ValueError(f"handle() must return one output per input: {len(inputs)} inputs, got {got}")
        return [_as_output(item, r) for item, r in zip(inputs, results, strict=True)]


def _as_output(item: Input, result: Any) -> Output:
    if isinstance(result, Output):
        return result
    if isinstance(result, str):
        return Output(request_id=item.request_id, text=result)
    return Output(request_id=item.request_id, payload=result)


def load_handler(ctx: Context, entry_point: str) -> AnyHandler:
    """Return an uninitialised handler for ``entry_point`` (see the module note). Raises ``ValueError``."""
    name = (entry_point or "").strip()
    if not name:
        raise ValueError("entry point is empty: set option.entryPoint to a built-in name or a .py file")
    if name in BUILTIN_HANDLERS:
        if BUILTIN_HANDLERS[name] == BUILTIN_HANDLERS["huggingface"] and \
                option_value(ctx.properties, "task") == "embedding":
            return _load_dotted(ctx, EMBEDDING_HANDLER)  # any AutoModel, embeddings only (dynamic batching)
        return _load_dotted(ctx, BUILTIN_HANDLERS[name])
    if name.endswith(".py"):
        return _from_module(ctx, _import_model_file(ctx.model_dir, name), name)
    if "/" in name or "\\" in name:
        raise ValueError(f"entry point {name!r} is not a built-in name, a .py file or a dotted module path")
    return _load_dotted(ctx, name)


def _load_dotted(ctx: Context, spec: str) -> AnyHandler:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"entry point {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    if not attr:
        return _from_module(ctx, module, spec)
    if not hasattr(module, attr):
        raise ValueError(f"entry point {spec!r}: module {module_name!r} has no attribute {attr!r}")
    target = getattr(module, attr)
    if inspect.isfunction(target):
        return FunctionHandler(target, _initialize_fn(module))
    return _instantiate(target, spec)


def _import_model_file(model_dir: Path, file_name: str) -> ModuleType:
    root = Path(model_dir).resolve()
    path = (root / file_name).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"entry point {file_name!r} resolves outside the model directory")
    if not path.is_file():
        raise ValueError(f"entry point {file_name!r} not found in the model directory")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"rollserve_model_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"entry point {file_name!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    # DJL lets model.py import its sibling files; the worker serves one model, so this is local to it.
    if str(root) not in sys.path:
        sys.path.append(str(root))
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ValueError(f"entry point {file_name!r} failed to import: {type(exc).__name__}: {exc}") from exc
    return module


def _from_module(ctx: Context, module: ModuleType, label: str) -> AnyHandler:
    chosen = ctx.option("handler")
    if chosen:
        if not hasattr(module, chosen):
            raise ValueError(f"entry point {label!r} has no {chosen!r} (named by option.handler)")
        target = getattr(module, chosen)
        if inspect.isclass(target):
            return _instantiate(target, label)
        if callable(target):
            return FunctionHandler(target, _initialize_fn(module))
        raise ValueError(f"entry point {label!r}: {chosen!r} is neither a Handler class nor a function")
    named = getattr(module, "Handler", None)
    if inspect.isclass(named) and issubclass(named, (Handler, RollingHandler)) and not inspect.isabstract(named):
        return _instantiate(named, label)
    own = [c for _, c in inspect.getmembers(module, inspect.isclass)
           if c.__module__ == module.__name__ and issubclass(c, (Handler, RollingHandler))
           and not inspect.isabstract(c)]
    if len(own) > 1:
        names = ", ".join(sorted(c.__name__ for c in own))
        raise ValueError(f"entry point {label!r} defines several handler classes ({names}); "
                         "choose one with option.handler")
    if own:
        return _instantiate(own[0], label)
    handle_fn = getattr(module, "handle", None)
    if callable(handle_fn):
        return FunctionHandler(handle_fn, _initialize_fn(module))
    raise ValueError(f"entry point {label!r} defines no handle(inputs) function and no Handler subclass")


def _initialize_fn(module: ModuleType) -> Callable[[Context], Any] | None:
    fn = getattr(module, "initialize", None)
    return fn if callable(fn) else None


def _instantiate(target: Any, label: str) -> AnyHandler:
    if not (inspect.isclass(target) and issubclass(target, (Handler, RollingHandler))):
        raise ValueError(f"entry point {label!r}: {getattr(target, '__name__', target)!r} is not a subclass "
                         "of handlers.base.Handler or RollingHandler")
    if inspect.isabstract(target):
        raise ValueError(f"entry point {label!r}: {target.__name__} is abstract (missing handle or step methods)")
    try:
        return target()
    except Exception as exc:
        raise ValueError(f"entry point {label!r}: {target.__name__}() failed: {type(exc).__name__}: {exc}") from exc
