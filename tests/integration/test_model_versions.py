"""Model versions against a real server: ``model_store/NAME/1`` and ``NAME/2`` hold two models that answer
differently; each answers on its route (LMI ``/predictions/NAME/VERSION``, OpenAI ``model: NAME:VERSION``, the
OIP ``model_version``), the name alone reaches the highest; ``GET /models/NAME/all`` lists both; ``PUT
/models/NAME/1/set-default`` switches the name under concurrent load with no failed request; metrics carry the
version."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.bench.launch import wait_for
from serving.frontends.proto.gen.inference import grpc_service_pb2 as pb
from serving.frontends.proto.gen.inference import grpc_service_pb2_grpc as pb_grpc
from tests.integration.harness import ServerProcess, greedy_references
from tests.integration.store_models import NEW_TOKENS, PROMPT, TINY, Load, build_pair, copy_model, greedy


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[int], list[int]]:
    a, b = build_pair(tmp_path_factory.mktemp("weights"))
    ref = [greedy_references([PROMPT], NEW_TOKENS, model_dir=d)[PROMPT] for d in (a, b)]
    assert ref[0] != ref[1]
    return a, b, ref[0], ref[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, refs: tuple[Path, Path, list[int], list[int]]
           ) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("versions")
    copy_model(refs[0], workdir / "model_store" / "multi" / "1", TINY)
    copy_model(refs[1], workdir / "model_store" / "multi" / "2", TINY)
    s = ServerProcess.start(workdir)
    wait_for(lambda: all(w["state"] == "READY" for w in _all(s)), "both versions READY", 120, step_s=0.1)
    yield s
    s.stop()


def _all(server: ServerProcess) -> list[dict]:
    r = httpx.get(f"{server.mgmt}/models/multi/all", headers=server.mgmt_headers, timeout=10)
    assert r.status_code == 200, r.text
    return [w["models"][0] for w in r.json()]


def test_each_version_answers_on_its_route_and_the_name_reaches_the_highest(
        server: ServerProcess, refs: tuple[Path, Path, list[int], list[int]]) -> None:
    _, _, ref1, ref2 = refs
    assert greedy(server, "/predictions/multi/1") == ref1
    assert greedy(server, "/predictions/multi/2") == ref2
    assert greedy(server, "/predictions/multi") == ref2  # no default pinned: the highest version
    assert [(m["version"], m["is_default"]) for m in _all(server)] == [("1", False), ("2", True)]
    assert server.describe("multi")["versions"] == ["1", "2"]
    r = httpx.post(f"{server.url}/predictions/multi/3", json={"inputs": PROMPT}, timeout=10)
    assert r.status_code == 404 and "version 3" in r.json()["error"]
    # OpenAI's model field names a version as NAME:VERSION
    for version, ref in (("1", ref1), ("2", ref2)):
        r = httpx.post(f"{server.url}/v1/completions", json={"model": f"multi:{version}", "prompt": PROMPT,
                                                            "max_tokens": NEW_TOKENS, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        lmi = httpx.post(f"{server.url}/predictions/multi/{version}",
                         json={"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS}}, timeout=60).json()
        assert r.json()["choices"][0]["text"] == lmi["generated_text"], (version, ref)
    # the Open Inference Protocol's model_version is the real version
    with grpc.insecure_channel(f"127.0.0.1:{server.ports['grpc']}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="multi"), timeout=30)
        assert list(meta.versions) == ["1", "2"]
        for version in ("1", "2", ""):
            request = pb.ModelInferRequest(model_name="multi", model_version=version)
            text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
            text.contents.bytes_contents.append(PROMPT.encode())
            reply = stub.ModelInfer(request, timeout=60)
            assert reply.model_version == (version or "2")
        assert stub.ModelReady(pb.ModelReadyRequest(name="multi", version="1"), timeout=10).ready
        assert not stub.ModelReady(pb.ModelReadyRequest(name="multi", version="9"), timeout=10).ready


def test_set_default_switches_the_name_under_load_without_a_failed_request(
        server: ServerProcess, refs: tuple[Path, Path, list[int], list[int]]) -> None:
    _, _, ref1, ref2 = refs
    load = Load(f"{server.url}/predictions/multi", minimum=60, concurrency=8)
    load.start()
    wait_for(lambda: len(load.outcomes) >= 10, "requests flowing", 60, step_s=0.05)
    asked = time.monotonic()
    r = httpx.put(f"{server.mgmt}/models/multi/1/set-default", headers=server.mgmt_headers, timeout=30)
    switched = time.monotonic()
    assert r.status_code == 200, r.text
    assert r.json()["default_version"] == "1" and r.json()["previous_default"] == "2"
    load.finish()
    load.join(120)
    assert [o for o in load.outcomes if not o.ok] == []
    whole = [o for o in load.outcomes if not o.stream]
    before = [o for o in whole if o.ended < asked]  # started before it is not enough: it may reach the server after
    assert before and all(o.tokens == ref2 for o in before)
    after = [o for o in whole if o.started > switched]
    assert after and all(o.tokens == ref1 for o in after)
    assert greedy(server, "/predictions/multi") == ref1
    assert [(m["version"], m["is_default"], m["pinned_default"]) for m in _all(server)] == \
        [("1", True, "1"), ("2", False, "1")]
    # a version that is not registered cannot be the default
    r = httpx.put(f"{server.mgmt}/models/multi/5/set-default", headers=server.mgmt_headers, timeout=10)
    assert r.status_code == 404
    assert httpx.put(f"{server.mgmt}/models/multi/2/set-default", timeout=10).status_code == 401


def test_metrics_carry_the_version(server: ServerProcess) -> None:
    text = httpx.get(f"{server.mgmt}/metrics", headers=server.mgmt_headers, timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    served = {s.labels["version"] for s in samples
              if s.name == "rollserve_requests_total" and s.labels.get("model") == "multi"}
    assert served == {"1", "2"}
    states = {(s.labels["version"], s.labels["state"]) for s in samples
              if s.name == "rollserve_model_state" and s.labels.get("model") == "multi" and s.value == 1}
    assert states == {("1", "READY"), ("2", "READY")}
    tokens = {s.labels["version"] for s in samples
              if s.name == "rollserve_generation_tokens_total" and s.labels.get("model") == "multi" and s.value}
    assert tokens == {"1", "2"}
