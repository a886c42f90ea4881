"""The documents of ``serving k8s`` (``serving.deploy.k8s``, the command): names, the model's ConfigMap, the
workload (Deployment, LeaderWorkerSet or KServe's objects), Service, autoscaling and monitoring, and the notes
that name what the user has to create."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from rollcore.errors import ConfigError
from serving.deploy import inference_pool, kserve, lws, monitoring
from serving.deploy.k8s import Request
from serving.deploy.model import ModelFolder, read_model_folder
from serving.deploy.pods import (
    CLAIM_RETENTION,
    CLUSTER_SECRET_KEY,
    TOKEN_KEYS,
    PodContext,
    cache_claim_templates,
    pod_template,
    server_ports,
)
from serving.deploy.resources import QUANTITY, SIZE_FACTOR, size_pods


class _Dumper(yaml.SafeDumper):
    """Plain YAML for kubectl and people: no anchors for repeated label maps, files as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _text)

MAX_NAME = 40  # room for the longest suffix ("-prometheus-adapter") within a 63-character name
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def dns_name(text: str) -> str:
    """``text`` as a DNS-1035 label of at most ``MAX_NAME`` characters (Service names start with a letter)."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"rollserve-{name}".strip("-")
    return name[:MAX_NAME].rstrip("-")


@dataclass(frozen=True, slots=True)
class Manifests:
    documents: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    context: PodContext | None = None

    def yaml(self) -> str:
        return yaml.dump_all(self.documents, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=120)


def _check(req: Request) -> None:
    if req.replicas < 1:
        raise ConfigError(f"--replicas {req.replicas}: expected at least 1")
    if req.max_replicas is not None and req.max_replicas < req.replicas:
        raise ConfigError(f"--max-replicas {req.max_replicas}: expected at least --replicas ({req.replicas})")
    if req.kserve and req.nodes > 1:
        raise ConfigError("--kserve with --nodes: a model over several pods is a LeaderWorkerSet here; KServe's "
                          "multi-node workerSpec is not generated")
    if req.kserve and req.inference_pool:
        raise ConfigError("--kserve with --inference-pool: KServe's objects bring their own pods and routing (its "
                          "LLMInferenceService makes its own InferencePool)")
    if req.name is not None and (len(req.name) > MAX_NAME or not _DNS_LABEL.match(req.name)):
        raise ConfigError(f"--name {req.name!r}: expected lowercase letters, digits and '-', starting with a letter, "
                          f"at most {MAX_NAME} characters")
    if req.namespace is not None and (len(req.namespace) > 63 or not _NAMESPACE.match(req.namespace)):
        raise ConfigError(f"--namespace {req.namespace!r}: not a DNS-1123 label")
    if req.cache_claim is not None and (len(req.cache_claim) > 253 or not _NAMESPACE.match(req.cache_claim)):
        raise ConfigError(f"--cache-claim {req.cache_claim!r}: not a PersistentVolumeClaim name (lowercase letters, "
                          "digits and '-')")
    if req.cache_claim_per_pod is not None:
        quantity = QUANTITY.match(req.cache_claim_per_pod)
        if quantity is None or int(quantity.group(1)) == 0:
            raise ConfigError(f"--cache-claim-per-pod {req.cache_claim_per_pod!r}: expected a size such as 50Gi or "
                              "500Mi")
        if req.cache_claim is not None:
            raise ConfigError("--cache-claim with --cache-claim-per-pod: one shared cache or one per pod, not both")
        if req.kserve:
            raise ConfigError("--kserve with --cache-claim-per-pod: KServe's InferenceService has no claim templates "
                              "(use --cache-claim, or --storage-uri)")
    if req.storage_uri and not req.kserve:
        raise ConfigError("--storage-uri needs --kserve: it hands option.model_id to KServe's storage initializer")


def _storage_uri(req: Request, model: ModelFolder) -> str | None:
    """The storageUri for ``--storage-uri``; a ConfigError for a model KServe's storage initializer cannot fetch."""
    if not req.storage_uri:
        return None
    uri = kserve.storage_uri(model.fetched_model_id)
    if uri is None:
        what = model.fetched_model_id or "a local checkpoint (its claim is the storageUri already)"
        raise ConfigError(f"--storage-uri: option.model_id={what} is not something KServe's storage initializer "
                          "fetches (s3:// or a hub id)")
    return uri


def config_map(ctx: PodContext, model: ModelFolder, namespace: str | None) -> dict[str, Any]:
    """The model folder's configuration files, mounted as the model folder in the pod."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": monitoring.metadata(ctx.config_map, namespace, "config", ctx.name),
            "data": dict(sorted(model.files.items()))}


def deployment(ctx: PodContext, namespace: str | None, replicas: int) -> dict[str, Any]:
    template = pod_template(ctx, "server", ctx.sizing.leader)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": monitoring.metadata(ctx.name, namespace, "server", ctx.name),
            "spec": {"replicas": replicas,
                     "selector": {"matchLabels": template["metadata"]["labels"]},
                     # a new pod is ready before an old one goes (no capacity lost while a model loads)
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "progressDeadlineSeconds": max(600, ctx.sizing.startup_s + 120),
                     "template": template}}


def stateful_set(ctx: PodContext, namespace: str | None, replicas: int) -> dict[str, Any]:
    """The Deployment's pods, each with its own cache claim (``--cache-claim-per-pod``): started together, not one
    by one, since each loads a model; replaced one at a time on a change."""
    template = pod_template(ctx, "server", ctx.sizing.leader)
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": monitoring.metadata(ctx.name, namespace, "server", ctx.name),
            "spec": {"replicas": replicas, "serviceName": ctx.name, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": template["metadata"]["labels"]},
                     "updateStrategy": {"type": "RollingUpdate"},
                     "persistentVolumeClaimRetentionPolicy": CLAIM_RETENTION,
                     "template": template, "volumeClaimTemplates": cache_claim_templates(ctx)}}


def _notes(ctx: PodContext, req: Request) -> list[str]:
    s, m, ns = ctx.sizing, ctx.model, f" -n {req.namespace}" if req.namespace else ""
    tokens = " ".join(f"--from-literal={key}=$(openssl rand -hex 24)" for key in TOKEN_KEYS.values())
    notes = [f"create the tokens first: kubectl create secret generic {ctx.tokens_secret}{ns} {tokens}"]
    if req.nodes > 1:
        notes.append(f"and the group's secret: kubectl create secret generic {ctx.cluster_secret}{ns} "
                     f"--from-literal={CLUSTER_SECRET_KEY}=$(openssl rand -hex 32)")
    if m.weights is not None:
        notes.append(f"the PersistentVolumeClaim {ctx.weights_claim} must hold {m.claim_root} (its files at the "
                     "claim's root)")
    if ctx.storage_uri is not None:
        notes.append(f"KServe's storage initializer fetches {ctx.storage_uri} into /mnt/models before the server "
                     "starts (give it the credentials it needs, e.g. a ServiceAccount with the storage secret)")
    elif m.fetched_model_id is not None:
        notes.append(f"the pod fetches option.model_id={m.fetched_model_id} when it starts (network access needed)")
    if ctx.cache_claim is not None:
        notes.append(f"the PersistentVolumeClaim {ctx.cache_claim} (ReadWriteMany) is every pod's model cache: "
                     "create it first; a fetched model is downloaded into it once")
    if ctx.cache_per_pod is not None:
        notes.append(f"each pod's model cache is a PersistentVolumeClaim of its own (cache-<pod name>, "
                     f"{ctx.cache_per_pod}, ReadWriteOnce, the cluster's default StorageClass), made by Kubernetes: "
                     "a fetched model is downloaded once per pod and kept across its restarts; the claims stay when "
                     "the workload scales down and go when it is deleted")
    if s.memory_source == "fallback":
        notes.append(f"memory: {s.memory_basis}; {s.leader.memory} assumed (the stated default of 4 GiB a rank + "
                     "overheads): pass --memory to set it")
    elif s.memory_source == "size":
        notes.append(f"memory: from {s.memory_basis}: {SIZE_FACTOR} x a rank's share of the weights + overheads "
                     "(no memory plan without the model's config): pass --memory to set it")
    elif m.fetched_model_id is not None:
        notes.append(f"memory: the engine's memory plan from {s.memory_basis}")
    notes.append(f"layout: {s.layout_reason}; {s.leader.cpus} CPUs, {s.leader.memory} memory"
                 f"{f', {s.leader.gpus} GPUs' if s.leader.gpus else ''} a pod; startupProbe allows {s.startup_s} s")
    return notes


def build(req: Request) -> Manifests:
    """The manifests for ``req``. Raises ``ConfigError``."""
    _check(req)
    model = read_model_folder(req.model_dir)
    storage_uri = _storage_uri(req, model)  # refused before the source is asked for its size
    sizing = size_pods(model, cpus=req.cpus, nodes=req.nodes, gpu=req.gpu, memory=req.memory)
    name = req.name or dns_name(model.name)
    ctx = PodContext(name=name, model=model, sizing=sizing, image=req.image,
                     weights_claim=req.weights_claim or f"{name}-weights", ports=server_ports(),
                     cache_claim=req.cache_claim, cache_per_pod=req.cache_claim_per_pod, storage_uri=storage_uri)
    ns, max_replicas = req.namespace, req.max_replicas or 4 * req.replicas
    docs = [config_map(ctx, model, ns)]
    if req.kserve:
        docs += [kserve.serving_runtime(ctx, ns), kserve.inference_service(ctx, ns, req.replicas, max_replicas)]
        return Manifests(docs, _notes(ctx, req), ctx)
    if req.nodes > 1:
        component = "leader"
        workload = lws.leader_worker_set(ctx, ns, req.replicas)
    else:
        component = "server"
        workload = (deployment if req.cache_claim_per_pod is None else stateful_set)(ctx, ns, req.replicas)
    target = {"apiVersion": workload["apiVersion"], "kind": workload["kind"], "name": name}
    docs += [workload, monitoring.service(ctx, ns, component),
             monitoring.autoscaler(ctx, ns, target, req.replicas, max_replicas),
             monitoring.service_monitor(ctx, ns, component), monitoring.adapter_config_map(ctx, ns)]
    notes = _notes(ctx, req)
    if req.inference_pool:
        docs.append(inference_pool.inference_pool(ctx, ns, component))
        notes.append(inference_pool.note(ctx))
    return Manifests(docs, notes, ctx)


