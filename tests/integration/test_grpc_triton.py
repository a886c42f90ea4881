"""OIP v2 with the real ``tritonclient.grpc``, run in its own process (its ``inference`` protos clash with ours)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import ServerProcess

# Never import tritonclient here: its ``inference`` protos would clash with rollserve's in this process.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("tritonclient") is None,
                                reason="tritonclient is not installed (pip install -e '.[test]')")
CLIENT = Path(__file__).with_name("grpc_triton_client.py")
PROMPT = "Deep learning is"
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("grpc-triton"),
                            models={"roll": {"option.rolling_batch": "auto", "option.strict_parameters": "true"},
                                    "echo": {"option.entryPoint": "echo"}},
                            config={"enable_model_api": "true"})
    yield s
    s.stop()


def test_tritonclient_session(server: ServerProcess) -> None:
    proc = subprocess.run([sys.executable, str(CLIENT), server.grpc_target, "roll", PROMPT, str(NUM_TOKENS),
                           server.tokens["management"]],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout)
    http = httpx.post(f"{server.url}/predictions/roll", timeout=60,
                      json={"inputs": PROMPT, "parameters": {"max_new_tokens": NUM_TOKENS, "ignore_eos": True}})
    expected = http.json()["generated_text"]

    assert seen["live"] and seen["ready"] and seen["model_ready"]
    assert seen["unknown_model_ready"] is False
    assert seen["server_metadata"]["name"] == "rollserve"
    meta = seen["model_metadata"]
    assert meta["name"] == "roll"
    assert {t["name"] for t in meta["inputs"]} == {"text_input", "stream", "sampling_parameters",
                                                  "exclude_input_in_output"}
    assert [t["name"] for t in meta["outputs"]] == ["text_output"]
    assert {m["name"]: m["state"] for m in seen["index"]["models"]} == {"echo": "READY", "roll": "READY"}

    assert seen["infer_text"] == [expected]  # greedy: same text as the HTTP API
    assert seen["infer_id"] == "infer-1"
    assert seen["infer_full_text"] == [PROMPT + expected]
    assert seen["invalid"]["status"] == "StatusCode.INVALID_ARGUMENT"
    http_invalid = httpx.post(f"{server.url}/predictions/roll", json={"inputs": PROMPT, "parameters": {"top_p": 0}})
    assert seen["invalid"]["message"] == http_invalid.json()["error"]

    assert seen["stream_errors"] == []
    assert len(seen["stream_pieces"]) == NUM_TOKENS  # one response per token
    assert "".join(seen["stream_pieces"]) == expected
    assert seen["stream_finals"] == [False] * (NUM_TOKENS - 1) + [True]
    assert "unknown parameters: nonsense" in seen["stream_error"]  # an error response; the stream stays usable
    assert seen["echo_after_unload"] == "UNAVAILABLE" and seen["echo_ready_after_load"] is True


def test_oip_messages_match_tritonclient(tmp_path: Path) -> None:
    """Every message and method we define has tritonclient's field numbers, types and names."""
    from serving.frontends.proto.gen.inference import grpc_service_pb2

    ours = tmp_path / "ours.pb"
    ours.write_bytes(grpc_service_pb2.DESCRIPTOR.serialized_pb)
    script = f"""
import sys
from google.protobuf import descriptor_pb2
import tritonclient.grpc.service_pb2 as theirs_pb2
theirs = descriptor_pb2.FileDescriptorProto.FromString(theirs_pb2.DESCRIPTOR.serialized_pb)
ours = descriptor_pb2.FileDescriptorProto.FromString(open({str(ours)!r}, 'rb').read())
def messages(fd):
    out = {{}}
    def walk(prefix, ms):
        for m in ms:
            out[prefix + m.name] = sorted((f.name, f.number, f.type, f.label, f.type_name) for f in m.field)
            walk(prefix + m.name + '.', m.nested_type)
    walk('', fd.message_type)
    return out
a, b = messages(ours), messages(theirs)
bad = [k for k in a if a[k] != b.get(k)]
methods = lambda fd: {{m.name: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
                      for m in fd.service[0].method}}
ma, mb = methods(ours), methods(theirs)
bad += [k for k in ma if ma[k] != mb.get(k)]
assert ours.package == theirs.package and ours.service[0].name == theirs.service[0].name
print(bad)
sys.exit(1 if bad else 0)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
