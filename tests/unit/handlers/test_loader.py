"""load_handler: built-in names, model.py by path (functions or Handler classes), dotted paths, errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from handlers.base import Context, Handler, Input
from handlers.echo import EchoHandler
from handlers.loader import FunctionHandler, load_handler

HANDLER_CLASS_MODULE = '''
from handlers.base import Handler, Output

class Handler(Handler):
    def initialize(self, ctx):
        self.suffix = ctx.option("suffix", "!")

    def handle(self, inputs):
        return [Output(request_id=i.request_id, text=i.prompt.upper() + self.suffix) for i in inputs]
'''

FUNCTION_MODULE = '''
from handlers.base import Output

state = {}

def initialize(ctx):
    state["name"] = ctx.model_name

def handle(inputs):
    return [Output(request_id=i.request_id, text=state["name"] + ":" + i.prompt) for i in inputs]
'''


def context(model_dir: Path, **properties: str) -> Context:
    return Context(model_name="m", model_dir=model_dir, properties=properties)


def write(model_dir: Path, name: str, source: str) -> None:
    (model_dir / name).write_text(textwrap.dedent(source))


def run(handler: Handler, ctx: Context, prompt: str = "hi") -> str:
    handler.initialize(ctx)
    [out] = handler.handle([Input(request_id="r", prompt=prompt)])
    return out.text


def test_builtin_echo(tmp_path: Path) -> None:
    assert isinstance(load_handler(context(tmp_path), "echo"), EchoHandler)


def test_model_py_with_functions(tmp_path: Path) -> None:
    write(tmp_path, "model.py", FUNCTION_MODULE)
    ctx = context(tmp_path)
    handler = load_handler(ctx, "model.py")
    assert isinstance(handler, FunctionHandler)
    assert run(handler, ctx) == "m:hi"


def test_model_py_with_handler_class(tmp_path: Path) -> None:
    write(tmp_path, "model.py", HANDLER_CLASS_MODULE)
    ctx = context(tmp_path, suffix="?")
    assert run(load_handler(ctx, "model.py"), ctx) == "HI?"


def test_option_handler_picks_a_class_among_several(tmp_path: Path) -> None:
    write(tmp_path, "custom.py", '''
        from handlers.base import Handler, Output

        class A(Handler):
            def handle(self, inputs):
                return [Output(request_id=i.request_id, text="A") for i in inputs]

        class B(Handler):
            def handle(self, inputs):
                return [Output(request_id=i.request_id, text="B") for i in inputs]
    ''')
    with pytest.raises(ValueError, match="several handler classes"):
        load_handler(context(tmp_path), "custom.py")
    ctx = context(tmp_path, handler="B")
    assert run(load_handler(ctx, "custom.py"), ctx) == "B"


def test_function_results_may_be_plain_values(tmp_path: Path) -> None:
    write(tmp_path, "model.py", '''
        def handle(inputs):
            return [{"len": len(i.prompt)} if i.prompt else "empty" for i in inputs]
    ''')
    ctx = context(tmp_path)
    handler = load_handler(ctx, "model.py")
    outs = handler.handle([Input("a", "abc"), Input("b", "")])
    assert outs[0].payload == {"len": 3} and outs[0].request_id == "a"
    assert outs[1].text == "empty" and outs[1].request_id == "b"


def test_wrong_output_count_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, "model.py", "def handle(inputs):\n    return []\n")
    handler = load_handler(context(tmp_path), "model.py")
    with pytest.raises(ValueError, match="one output per input"):
        handler.handle([Input("a", "x")])


def test_dotted_module_and_class() -> None:
    ctx = context(Path("."))
    assert isinstance(load_handler(ctx, "handlers.echo:EchoHandler"), EchoHandler)
    assert isinstance(load_handler(ctx, "handlers.echo"), EchoHandler)


def test_dotted_function_is_wrapped() -> None:
    assert isinstance(load_handler(context(Path(".")), "handlers.base:option_bool"), FunctionHandler)


@pytest.mark.parametrize(("entry_point", "message"), [
    ("../outside.py", "outside the model directory"),
    ("sub/../../outside.py", "outside the model directory"),
    ("missing.py", "not found"),
    ("nohandle.py", "no handle"),
    ("broken.py", "failed to import"),
    ("handlers.echo:Nope", "no attribute 'Nope'"),
    ("handlers.base:Context", "not a subclass"),
    ("handlers.base:Handler", "abstract"),
    ("no_such_package.mod", "cannot import"),
    ("", "empty"),
])
def test_failures_are_clear_value_errors(tmp_path: Path, entry_point: str, message: str) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "sub").mkdir()
    write(tmp_path, "outside.py", FUNCTION_MODULE)
    write(model_dir, "nohandle.py", "x = 1\n")
    write(model_dir, "broken.py", "raise RuntimeError('bad import')\n")
    with pytest.raises(ValueError, match=message):
        load_handler(context(model_dir), entry_point)


def test_symlink_escaping_model_dir_is_rejected(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    write(tmp_path, "outside.py", FUNCTION_MODULE)
    (model_dir / "model.py").symlink_to(tmp_path / "outside.py")
    with pytest.raises(ValueError, match="outside the model directory"):
        load_handler(context(model_dir), "model.py")


def test_two_model_dirs_get_separate_modules(tmp_path: Path) -> None:
    for name, text in (("a", "A"), ("b", "B")):
        (tmp_path / name).mkdir()
        write(tmp_path / name, "model.py", f'''
            def handle(inputs):
                return ["{text}" for _ in inputs]
        ''')
    a = load_handler(context(tmp_path / "a"), "model.py")
    b = load_handler(context(tmp_path / "b"), "model.py")
    assert a.handle([Input("r", "x")])[0].text == "A"
    assert b.handle([Input("r", "x")])[0].text == "B"
