"""Secure by default, through real servers: every management route and RPC needs the management token (no
token or a wrong one -> 401 / UNAUTHENTICATED, the right one works), inference needs its token when
``inference_auth=true``, the model API is off unless ``enable_model_api=true`` (403 / PERMISSION_DENIED),
``management_address=off`` leaves no management listener and no management RPC, the key file is private
and the tokens never reach the log."""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest

from serving.frontends.proto.gen.inference import grpc_service_pb2 as oip_pb
from serving.frontends.proto.gen.inference import grpc_service_pb2_grpc as oip_grpc
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc as pb_grpc
from tests.integration.harness import ServerProcess
from tests.integration.test_hostile_values import oip_request

ECHO = {"option.entryPoint": "echo"}
MANAGEMENT_ROUTES = [("GET", "/models", {}), ("GET", "/models/echo", {}), ("POST", "/models", {"url": "echo"}),
                     ("PUT", "/models/echo", {"min_worker": "1"}), ("PUT", "/models/echo", {"batch_size": "1"}),
                     ("DELETE", "/models/nope", {}),
                     ("DELETE", "/requests/nope", {}), ("GET", "/metrics", {}), ("GET", "/openapi.json", {})]
INFERENCE_ROUTES = [("POST", "/predictions/echo", {"inputs": "hi"}), ("POST", "/invocations", {"inputs": "hi"}),
                    ("POST", "/v1/completions", {"model": "echo", "prompt": "hi"}), ("GET", "/v1/models", None),
                    ("POST", "/generate", {"inputs": "hi"}), ("GET", "/info", None), ("GET", "/openapi.json", None)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Model API off (the default), inference authorization on."""
    s = ServerProcess.start(tmp_path_factory.mktemp("auth"), models={"echo": ECHO}, config={"inference_auth": "true"})
    yield s
    s.stop()


def wrong(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token[:-1]}{'A' if token[-1] != 'A' else 'B'}"}


def test_key_file_is_private_and_tokens_stay_out_of_the_log(server: ServerProcess) -> None:
    key_file = server.workdir / "key_file.json"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert server.tokens["management"] != server.tokens["inference"]
    log = server.log()
    assert str(key_file) in log
    assert server.tokens["management"] not in log and server.tokens["inference"] not in log


@pytest.mark.parametrize(("method", "path", "params"), MANAGEMENT_ROUTES,
                         ids=[f"{m} {p} {','.join(q)}".strip() for m, p, q in MANAGEMENT_ROUTES])
def test_every_management_route_needs_the_management_token(server: ServerProcess, method: str, path: str,
                                                           params: dict[str, str]) -> None:
    url = server.mgmt + path
    for headers in ({}, wrong(server.tokens["management"]), server.inference_headers):
        r = httpx.request(method, url, params=params, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["WWW-Authenticate"].startswith("Bearer") and r.json()["error_type"] == "unauthorized"
    r = httpx.request(method, url, params=params, headers=server.mgmt_headers, timeout=30)
    # a PUT that scales (min_worker) is the model API; one that changes batching knobs needs the token only
    expected = {"POST": 403, "PUT": 403 if "min_worker" in params else 200,
                "DELETE": 403 if path.startswith("/models") else 404}.get(method, 200)
    assert r.status_code == expected, r.text
    if expected == 403:
        assert "enable_model_api" in r.json()["error"]


@pytest.mark.parametrize(("method", "path", "body"), INFERENCE_ROUTES,
                         ids=[f"{m} {p}" for m, p, _ in INFERENCE_ROUTES])
def test_inference_needs_its_token_when_inference_auth_is_on(server: ServerProcess, method: str, path: str,
                                                             body: Any) -> None:
    url = server.url + path
    for headers in ({}, wrong(server.tokens["inference"]), server.mgmt_headers):
        assert httpx.request(method, url, json=body, headers=headers, timeout=30).status_code == 401
    r = httpx.request(method, url, json=body, headers=server.inference_headers, timeout=30)
    assert r.status_code == 200, r.text


def test_probes_need_no_token(server: ServerProcess) -> None:
    for base in (server.url, server.mgmt):
        for path in ("/ping", "/health/live", "/health/ready"):
            assert httpx.get(base + path, timeout=5).status_code == 200


def grpc_calls(channel: grpc.Channel) -> dict[str, Callable[[Any], Any]]:
    """One call per management RPC and per inference RPC kind (``metadata`` -> the call's result)."""
    mgmt, oip, gen = pb_grpc.ManagementStub(channel), oip_grpc.GRPCInferenceServiceStub(channel), \
        pb_grpc.GenerationStub(channel)
    t = 30
    return {
        "ListModels": lambda md: mgmt.ListModels(pb.ListModelsRequest(), timeout=t, metadata=md),
        "DescribeModel": lambda md: mgmt.DescribeModel(pb.DescribeModelRequest(name="echo"), timeout=t, metadata=md),
        "RegisterModel": lambda md: mgmt.RegisterModel(pb.RegisterModelRequest(url="echo", model_name="e2"),
                                                       timeout=t, metadata=md),
        "ScaleWorkers": lambda md: mgmt.ScaleWorkers(pb.ScaleWorkersRequest(name="echo", num_workers=1), timeout=t,
                                                     metadata=md),
        "UnregisterModel": lambda md: mgmt.UnregisterModel(pb.UnregisterModelRequest(name="echo"), timeout=t,
                                                           metadata=md),
        "UpdateModel": lambda md: mgmt.UpdateModel(pb.UpdateModelRequest(name="echo", batch_size=1), timeout=t,
                                                   metadata=md),
        "UpdateModel(min_worker)": lambda md: mgmt.UpdateModel(pb.UpdateModelRequest(name="echo", min_worker=1),
                                                               timeout=t, metadata=md),
        "RepositoryIndex": lambda md: oip.RepositoryIndex(oip_pb.RepositoryIndexRequest(), timeout=t, metadata=md),
        "RepositoryModelLoad": lambda md: oip.RepositoryModelLoad(oip_pb.RepositoryModelLoadRequest(
            model_name="echo"), timeout=t, metadata=md),
        "RepositoryModelUnload": lambda md: oip.RepositoryModelUnload(oip_pb.RepositoryModelUnloadRequest(
            model_name="echo"), timeout=t, metadata=md),
        "ModelInfer": lambda md: oip.ModelInfer(oip_request("echo", "hi", "{}"), timeout=t, metadata=md),
        "ModelStreamInfer": lambda md: list(oip.ModelStreamInfer(iter([oip_request("echo", "hi", "{}")]), timeout=t,
                                                                 metadata=md)),
        "ModelMetadata": lambda md: oip.ModelMetadata(oip_pb.ModelMetadataRequest(name="echo"), timeout=t,
                                                      metadata=md),
        "Generate": lambda md: gen.Generate(pb.GenerateRequest(model="echo", prompt="hi"), timeout=t, metadata=md),
    }


MODEL_API_RPCS = {"RegisterModel", "ScaleWorkers", "UnregisterModel", "RepositoryModelLoad", "RepositoryModelUnload",
                  "UpdateModel(min_worker)"}
MANAGEMENT_RPCS = MODEL_API_RPCS | {"ListModels", "DescribeModel", "RepositoryIndex", "UpdateModel"}


def code_of(call: Callable[[Any], Any], metadata: Any) -> grpc.StatusCode:
    try:
        call(metadata)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_every_rpc_needs_its_token(server: ServerProcess) -> None:
    m, i = server.tokens["management"], server.tokens["inference"]
    with grpc.insecure_channel(server.grpc_target) as channel:
        for name, call in grpc_calls(channel).items():
            own = m if name in MANAGEMENT_RPCS else i
            other = i if name in MANAGEMENT_RPCS else m
            for md in ((), (("authorization", f"Bearer {own}x"),), (("authorization", f"Bearer {other}"),)):
                assert code_of(call, md) == grpc.StatusCode.UNAUTHENTICATED, (name, md)
            expected = grpc.StatusCode.PERMISSION_DENIED if name in MODEL_API_RPCS else grpc.StatusCode.OK
            assert code_of(call, (("authorization", f"Bearer {own}"),)) == expected, name
        oip = oip_grpc.GRPCInferenceServiceStub(channel)  # probes stay open
        assert oip.ServerLive(oip_pb.ServerLiveRequest(), timeout=5).live
        assert oip.ServerReady(oip_pb.ServerReadyRequest(), timeout=5).ready


def test_model_api_on_and_management_off(tmp_path_factory: pytest.TempPathFactory) -> None:
    on = ServerProcess.start(tmp_path_factory.mktemp("api-on"), models={"echo": ECHO},
                             config={"enable_model_api": "true"})
    try:
        r = httpx.post(f"{on.mgmt}/models", params={"url": "echo", "model_name": "e2"}, headers=on.mgmt_headers,
                       timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.post(f"{on.url}/predictions/e2", json={"inputs": "hi"}, timeout=30).status_code == 200
        # readiness (ping_requires=all) waits for load_models only: a model registered later that fails to
        # load does not make an orchestrator restart a server whose models serve
        bad = on.workdir / "model_store" / "bad"
        bad.mkdir()
        (bad / "model.py").write_text("def initialize(ctx):\n    raise RuntimeError('no')\n\n\n"
                                      "def handle(inputs):\n    return []\n")
        r = httpx.post(f"{on.mgmt}/models", params={"url": "bad"}, headers=on.mgmt_headers, timeout=120)
        assert r.status_code == 503 and on.describe("bad")["state"] == "FAILED", r.text
        assert httpx.get(f"{on.url}/ping", timeout=5).status_code == 200
        assert httpx.get(f"{on.url}/health/ready", timeout=5).status_code == 200
    finally:
        on.stop()
    off = ServerProcess.start(tmp_path_factory.mktemp("mgmt-off"), models={"echo": ECHO},
                              config={"management_address": "off"})
    try:
        assert "management" not in off.ports
        assert httpx.post(f"{off.url}/predictions/echo", json={"inputs": "hi"}, timeout=30).status_code == 200
        with grpc.insecure_channel(off.grpc_target) as channel:
            for name, call in grpc_calls(channel).items():
                if name in MANAGEMENT_RPCS:
                    md = (("authorization", f"Bearer {off.tokens['management']}"),)
                    assert code_of(call, md) == grpc.StatusCode.UNIMPLEMENTED, name
    finally:
        off.stop()


def test_disabled_authorization_and_tokens_from_the_environment(tmp_path_factory: pytest.TempPathFactory) -> None:
    s = ServerProcess.start(tmp_path_factory.mktemp("auth-off"), models={"echo": ECHO},
                            config={"disable_token_authorization": "true"})
    try:
        assert not (s.workdir / "key_file.json").exists()
        assert httpx.get(f"{s.mgmt}/models", timeout=10).status_code == 200
        assert "token authorization is DISABLED" in s.log()
    finally:
        s.stop()
    token = "env-management-token-123"
    e = ServerProcess.start(tmp_path_factory.mktemp("auth-env"), models={"echo": ECHO},
                            env={"SERVING_MANAGEMENT_TOKEN": token})
    try:
        assert e.tokens["management"] == token
        r = httpx.get(f"{e.mgmt}/models", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert r.status_code == 200
        assert token not in e.log()
    finally:
        e.stop()
    assert not (e.workdir / "key_file.json").exists()  # the default key file goes with the server
