"""The ``serving`` command and the server's startup as a new user meets them, each through the real command in a
subprocess: ``--help`` lists every command, a taken port is one line naming the setting, a folder with nothing to
load says what to add, a typo'd key suggests the known one, uvicorn's lines appear once, and no answer carries a
server path."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import REPO, ServerProcess, write_model
from tests.integration.store_models import state

COMMANDS = ("start", "config", "serve", "bench", "tune", "k8s", "worker")


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without settings a developer's shell may carry into the server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "SAGEMAKER_", "HF_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def serving(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "serving", *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)


def start_server(workdir: Path, config: dict[str, str], env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``serving --config ... --ports-file ...`` in ``workdir`` (a model store with an echo model) until it exits; its
    process group must be gone by then."""
    store = workdir / "model_store"
    write_model(store, "echo", {"option.entryPoint": "echo"})
    cfg = {"inference_address": "http://127.0.0.1:0", "management_address": "http://127.0.0.1:0",
           "grpc_address": "127.0.0.1:0", "model_store": str(store)}
    cfg = {**{k: v for k, v in cfg.items() if k not in config}, **config}  # the test's own keys last
    (workdir / "config.properties").write_text("".join(f"{k}={v}\n" for k, v in cfg.items()))
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--config", "config.properties", "--ports-file",
                             "ports.json"], cwd=workdir, env=clean_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the server's group left: {left}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


# --- 1. every command is listed, each with its own help ---

def test_help_lists_every_command_with_a_description() -> None:
    proc = serving("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    assert first_line(proc.stdout) == "usage: serving [-h] COMMAND ..."
    section = proc.stdout.split("\ncommands:\n", 1)[1].split("\n\n", 1)[0]  # up to the usage lines below
    listed = {}
    for line in section.splitlines():
        words = line.split(maxsplit=1)
        if line.startswith("    ") and not line.startswith("     ") and len(words) == 2:
            listed[words[0]] = words[1]
    assert set(listed) == set(COMMANDS), proc.stdout
    assert all(len(desc) > 10 for desc in listed.values()), listed


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_its_own_help(command: str) -> None:
    proc = serving(command, "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    prog = "start" if command == "serve" else command  # SageMaker's `serve` is start
    assert first_line(proc.stdout).startswith(f"usage: serving {prog} [-h]"), proc.stdout


# --- 2. a taken address: one line naming the setting, exit 2, nothing left behind ---

@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process's socket listens on (as a second server on the same port would find it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("setting", ["inference_address", "management_address", "metrics_address", "grpc_address"])
def test_a_taken_address_is_one_line_naming_its_setting(tmp_path: Path, taken_port: int, setting: str) -> None:
    value = f"127.0.0.1:{taken_port}" if setting == "grpc_address" else f"http://127.0.0.1:{taken_port}"
    proc = start_server(tmp_path, {setting: value})
    line = 5 if setting == "metrics_address" else 4  # the last line of config.properties: four others before it
    assert (tmp_path / "config.properties").read_text().splitlines()[line - 1].startswith(setting)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"rollserve: cannot listen on 127.0.0.1:{taken_port} ({setting}, from config.properties:{line}): address "
        f"already in use; set {setting} in config.properties or env SERVING_{setting.upper()} (port 0: any free port)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.properties", "model_store"]  # no key/ports file


def test_a_taken_address_from_the_environment_says_so(tmp_path: Path, taken_port: int) -> None:
    proc = start_server(tmp_path, {}, env={"SERVING_INFERENCE_ADDRESS": f"http://127.0.0.1:{taken_port}"})
    assert proc.returncode == 2
    assert first_line(proc.stderr) == (
        f"rollserve: cannot listen on 127.0.0.1:{taken_port} (inference_address, from env SERVING_INFERENCE_ADDRESS): "
        "address already in use; set inference_address in config.properties or env SERVING_INFERENCE_ADDRESS "
        "(port 0: any free port)")
    assert not (tmp_path / "key_file.json").exists() and not (tmp_path / "ports.json").exists()


def test_sagemakers_taken_port_names_its_variable(tmp_path: Path, taken_port: int) -> None:
    proc = start_server(tmp_path, {}, env={"SAGEMAKER_BIND_TO_PORT": str(taken_port)})
    assert proc.returncode == 2
    assert first_line(proc.stderr) == (
        f"rollserve: cannot listen on 127.0.0.1:{taken_port} (SAGEMAKER_BIND_TO_PORT, from env "
        "SAGEMAKER_BIND_TO_PORT): address already in use; set another port in env SAGEMAKER_BIND_TO_PORT")
    assert not (tmp_path / "key_file.json").exists() and not (tmp_path / "ports.json").exists()


# --- a store of broken models (items 3, 5 and 6 share one server) ---

BROKEN_GGUF = b"GGUF" + (3).to_bytes(4, "little") + b"\x07" * 20  # a header cut off after a few bytes
MISSING_IMPORT_PY = "import rollserve_no_such_module  # the handler's dependency is not installed\n"


@pytest.fixture(scope="module")
def broken_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("broken")
    store = workdir / "model_store"
    write_model(store, "echo", {"option.entryPoint": "echo"})
    write_model(store, "empty", {"batch_size": "1"})  # nothing to load: no weights, config.json, model.py or model_id
    (write_model(store, "badgguf", {"option.model_id": "model.gguf"}) / "model.gguf").write_bytes(BROKEN_GGUF)
    write_model(store, "badconfig", {"batch_size": "1"}, files={"config.json": '{"model_type": "llama",'})
    write_model(store, "badimport", {"option.entryPoint": "model.py"}, files={"model.py": MISSING_IMPORT_PY})
    outside = workdir / "elsewhere"  # option.model_id naming files outside the store by absolute path
    outside.mkdir()
    (outside / "cut.gguf").write_bytes(BROKEN_GGUF)
    write_model(store, "ggufabs", {"option.model_id": str(outside / "cut.gguf")})
    write_model(store, "missingabs", {"option.model_id": str(outside / "gone.gguf")})
    server = ServerProcess.start(workdir, config={"model_cache_dir": str(workdir / "cache")}, wait_ready=False)
    try:
        deadline = time.monotonic() + 300
        while any(state(server, m) not in ("READY", "FAILED") for m in BROKEN_MODELS + ("echo",)):
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        yield server
    finally:
        server.stop()


BROKEN_MODELS = ("empty", "badgguf", "badconfig", "badimport", "ggufabs", "missingabs")
NOTHING_TO_LOAD = ("the model folder has no weights (*.safetensors, *.bin), no config.json and no model.py: set "
                   "option.model_id in serving.properties (a Hugging Face id, an s3:// URL, a local folder or a .gguf "
                   "file), copy a checkpoint (config.json and weights) into the folder, or add a model.py handler")


# --- 3. a folder with nothing to load: FAILED at once, not retried, saying what to add ---

def test_a_folder_with_nothing_to_load_fails_at_once_saying_what_to_add(broken_store: ServerProcess) -> None:
    info = broken_store.describe("empty")
    assert info["state"] == "FAILED" and info["reason"] == NOTHING_TO_LOAD
    log = broken_store.log()
    assert re.findall(r"ERROR serving\.models\.registry: model empty: (.*)", log) == [NOTHING_TO_LOAD]
    assert "model empty: worker" not in log  # no worker was started for it, so none was retried
    r = httpx.post(f"{broken_store.url}/predictions/empty", json={"inputs": "x"},
                   headers=broken_store.inference_headers, timeout=10)
    assert r.status_code == 503 and r.json()["error"] == f"model 'empty' is FAILED: {NOTHING_TO_LOAD}"
    r = httpx.post(f"{broken_store.url}/predictions/echo", json={"inputs": "still served"},
                   headers=broken_store.inference_headers, timeout=10)
    assert r.status_code == 200 and r.json() == {"generated_text": "still served"}


def test_a_load_failure_that_would_repeat_is_not_retried(broken_store: ServerProcess) -> None:
    """A model.py importing a module that is not installed fails the same way on every worker: one try."""
    info = broken_store.describe("badimport")
    assert info["state"] == "FAILED"
    assert info["reason"] == ("ValueError: entry point 'model.py' failed to import: ModuleNotFoundError: No module "
                              "named 'rollserve_no_such_module'")
    tries = re.findall(r"model badimport: worker \d+ failed to load \(([^)]*)\)", broken_store.log())
    assert tries == ["not retried: it would fail again"]


def test_serving_config_reports_a_folder_with_nothing_to_load(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "empty", {"batch_size": "1"})
    proc = serving("config", str(folder))
    assert proc.returncode == 0  # the configuration is valid: the folder's files are what is missing
    assert proc.stderr.splitlines() == [f"warning: model empty: {NOTHING_TO_LOAD}"]
    assert first_line(proc.stdout) == f"model empty  ({folder.resolve()})"  # the configuration is still shown
    assert sorted(p.name for p in folder.iterdir()) == ["serving.properties"]


# --- 6. no answer names a server path ---

MESSAGE = {"role": "user", "content": "x"}


def answers_about(server: ServerProcess, model: str) -> dict[str, httpx.Response]:
    mgmt, inference = server.mgmt_headers, server.inference_headers
    return {
        "GET /models": httpx.get(f"{server.mgmt}/models", headers=mgmt, timeout=10),
        f"GET /models/{model}": httpx.get(f"{server.mgmt}/models/{model}", headers=mgmt, timeout=10),
        f"GET /models/{model} (inference port)": httpx.get(f"{server.url}/models/{model}", headers=mgmt, timeout=10),
        f"POST /predictions/{model}": httpx.post(f"{server.url}/predictions/{model}", json={"inputs": "x"},
                                                 headers=inference, timeout=10),
        f"POST /v1/completions {model}": httpx.post(f"{server.url}/v1/completions", headers=inference, timeout=10,
                                                   json={"model": model, "prompt": "x"}),
        # the chat APIs: 503 too (the model is not READY), not a 400 about a template it never loaded
        f"POST /v1/chat/completions {model}": httpx.post(f"{server.url}/v1/chat/completions", headers=inference,
                                                         timeout=10, json={"model": model, "messages": [MESSAGE]}),
        f"POST /v1/messages {model}": httpx.post(f"{server.url}/v1/messages", headers=inference, timeout=10,
                                                 json={"model": model, "max_tokens": 4, "messages": [MESSAGE]}),
        f"POST /v1/responses {model}": httpx.post(f"{server.url}/v1/responses", headers=inference, timeout=10,
                                                  json={"model": model, "input": "x"}),
    }


@pytest.mark.parametrize("model", BROKEN_MODELS)
def test_no_answer_about_a_broken_model_names_a_server_path(broken_store: ServerProcess, model: str) -> None:
    workdir = str(broken_store.workdir)
    answers = answers_about(broken_store, model)
    assert broken_store.describe(model)["state"] == "FAILED"
    assert {name: r.status_code for name, r in answers.items()} == {
        name: 503 if name.startswith("POST") else 200 for name in answers}
    for name, r in answers.items():
        assert workdir not in r.text and str(Path(workdir).resolve()) not in r.text, (name, r.text)
    assert workdir in broken_store.log()  # the log keeps the full paths


@pytest.mark.parametrize("model,reason", [
    ("badgguf", "GGUF file model.gguf cannot be served: GGUFFileError: GGUF file model.gguf: its header is "
                "truncated or corrupt (it ends early)"),
    ("ggufabs", "GGUF file cut.gguf cannot be served: GGUFFileError: GGUF file cut.gguf: its header is truncated or "
                "corrupt (it ends early)"),
    ("missingabs", "option.model_id='<path>/gone.gguf': no such local file or folder, and not an S3 URI "),
    ("badconfig", "OSError: It looks like the config file at 'badconfig/config.json' is not a valid JSON file."),
])
def test_broken_files_are_named_relative_to_the_model(broken_store: ServerProcess, model: str, reason: str) -> None:
    assert broken_store.describe(model)["reason"].startswith(reason)




# --- 5. uvicorn's lines once each ---

def test_each_uvicorn_line_is_written_once(tmp_path: Path) -> None:
    """Two HTTP listeners (inference, management) and a metrics one: three uvicorn servers in one process."""
    server = ServerProcess.start(tmp_path, models={"echo": {"option.entryPoint": "echo"}},
                                 config={"metrics_address": "http://127.0.0.1:0"})
    try:
        r = httpx.post(f"{server.url}/predictions/echo", json={"inputs": "once"}, headers=server.inference_headers,
                       timeout=10)
        assert r.status_code == 200 and r.json() == {"generated_text": "once"}
    finally:
        assert server.stop() == 0
    lines = [line.split(" ", 2)[2] for line in server.log().splitlines() if " uvicorn." in line]
    pid = server.proc.pid
    assert lines == [f"INFO uvicorn.error: Started server process [{pid}]", "INFO uvicorn.error: Shutting down",
                     f"INFO uvicorn.error: Finished server process [{pid}]"], server.log()
    log = server.log()
    assert [n for n in ("inference", "management", "metrics") if f"INFO serving.server: {n} API listening on" in log] \
        == ["inference", "management", "metrics"]  # each listener is named once by the server's own line
    assert log.count("/predictions/echo -> 200") == 1  # the request's one line (serving.requests)


# --- 4. an unknown key: one line with the closest known key ---

def test_a_typo_in_config_properties_suggests_the_key(tmp_path: Path) -> None:
    proc = start_server(tmp_path, {"inference_adress": "http://127.0.0.1:0"})
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: config.properties:5: inference_adress = 'http://127.0.0.1:0': unknown "
                                        "key; did you mean 'inference_address'?"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.properties", "model_store"]


@pytest.mark.parametrize("typo,value,suggestion", [
    ("batch_sise", "2", "batch_size"),
    ("MaxWorker", "2", "maxWorkers"),
    ("job.queue.sizes", "9", "job_queue_size"),
])
def test_a_typo_in_serving_properties_suggests_the_key(tmp_path: Path, typo: str, value: str, suggestion: str) -> None:
    folder = write_model(tmp_path, "m", {"option.entryPoint": "echo", typo: value})
    proc = serving("config", str(folder))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: {folder}/serving.properties:2: {typo} = '{value}': unknown key (a handler's own keys take the "
        f"option. prefix); did you mean '{suggestion}'?"]


def test_a_key_close_to_none_says_where_the_keys_are_listed(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", {"option.entryPoint": "echo", "zzzz": "1"})
    proc = serving("config", str(folder))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: {folder}/serving.properties:2: zzzz = '1': unknown key (a handler's own keys take the option. "
        "prefix); no known key is close (docs/reference.md lists them)"]


def test_a_typod_option_key_still_warns_with_its_suggestion(tmp_path: Path) -> None:
    folder = write_model(tmp_path, "m", {"option.entryPoint": "echo", "option.echo_delay_mss": "1"})
    proc = serving("config", str(folder))
    assert proc.returncode == 0 and proc.stderr == ""
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("warning:")] == [
        "warning: unknown option.echo_delay_mss: did you mean option.echo_delay_ms? (serving.properties:2)"]
