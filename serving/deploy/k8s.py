"""``serving k8s MODEL_DIR``: Kubernetes manifests for serving a model folder, as multi-document YAML on stdout.

    serving k8s MODEL_DIR [--replicas N] [--max-replicas N] [--kserve] [--inference-pool] [--nodes N]
                          [--namespace NS]
                          [--image IMAGE] [--name NAME] [--cpus N] [--gpu] [--memory QTY] [--weights-claim NAME]
                          [--cache-claim NAME | --cache-claim-per-pod SIZE] [--storage-uri]

Emits a ConfigMap with the folder's serving.properties (the model folder in the pod), then a Deployment, a
Service, a HorizontalPodAutoscaler on the server's queue depth, a ServiceMonitor and the prometheus-adapter rule
for that metric; ``--nodes N`` a LeaderWorkerSet (one model's ranks over N pods) in place of the Deployment;
``--kserve`` a KServe ServingRuntime and InferenceService in place of the Deployment, Service and autoscaling.
``--inference-pool`` adds the Gateway API Inference Extension's InferencePool over the server pods.
``--cache-claim NAME`` mounts a PersistentVolumeClaim (ReadWriteMany) as the model cache of every pod, so a
fetched model is downloaded once per claim, not once per pod; ``--cache-claim-per-pod SIZE`` gives each pod a
claim of its own (a StatefulSet's, or the LeaderWorkerSet's, volumeClaimTemplates; ReadWriteOnce), so a pod's
cache outlives its restarts and rescheduling without a ReadWriteMany volume; ``--storage-uri`` with ``--kserve``
gives a fetched ``option.model_id`` (``s3://``, a hub id as ``hf://``) to KServe's storage initializer, which fills
``/mnt/models`` before the server starts, and the server serves that folder without fetching.
What the user creates: the Secret of tokens (and the cluster secret with ``--nodes``), the weights' claim when
the checkpoint is local, the cache's claim with ``--cache-claim``; the notes on stderr name them.
docs/deploying.md ("Kubernetes") has the rest.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from rollcore.errors import ConfigError
from serving.deploy import DEFAULT_CPUS

DEFAULT_IMAGE = "rollserve:latest"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model_dir", type=Path, help="the model folder (its serving.properties and weights)")
    ap.add_argument("--replicas", type=int, default=1, help="pods (groups with --nodes) to start with, and the "
                                                            "autoscaler's minimum (default 1)")
    ap.add_argument("--max-replicas", type=int, help="the autoscaler's maximum (default 4 x --replicas)")
    ap.add_argument("--kserve", action="store_true", help="a KServe ServingRuntime and InferenceService")
    ap.add_argument("--inference-pool", action="store_true", help="a Gateway API Inference Extension InferencePool "
                                                                  "over the server pods (for an inference gateway)")
    ap.add_argument("--nodes", type=int, default=1, help="pods one model's tensor-parallel ranks span (a "
                                                         "LeaderWorkerSet when more than 1)")
    ap.add_argument("--namespace", help="the objects' namespace (default: kubectl's)")
    ap.add_argument("--image", default=DEFAULT_IMAGE, help=f"the rollserve image (default {DEFAULT_IMAGE})")
    ap.add_argument("--name", help="prefix of the objects' names (default: from the model folder's name)")
    ap.add_argument("--cpus", type=int, default=DEFAULT_CPUS,
                    help=f"cores a pod gets where workers or threads are auto (default {DEFAULT_CPUS})")
    ap.add_argument("--gpu", action="store_true", help="workers on NVIDIA GPUs: tensor_parallel_degree GPUs each "
                                                       "(also when load_on_devices names devices)")
    ap.add_argument("--memory", help="a pod's memory (8Gi, 512Mi), in place of the memory preflight's figure")
    ap.add_argument("--weights-claim", help="the PersistentVolumeClaim holding a local checkpoint (default "
                                            "NAME-weights)")
    ap.add_argument("--cache-claim", help="a ReadWriteMany PersistentVolumeClaim as every pod's model cache (a "
                                          "fetched model is downloaded once per claim; default: a cache per pod)")
    ap.add_argument("--cache-claim-per-pod", metavar="SIZE",
                    help="each pod's own PersistentVolumeClaim of SIZE (50Gi) as its model cache, kept across "
                         "restarts: a StatefulSet in place of the Deployment")
    ap.add_argument("--storage-uri", action="store_true", help="with --kserve: KServe's storage initializer fetches "
                                                               "option.model_id (s3://, a hub id) into /mnt/models")


@dataclass(frozen=True, slots=True)
class Request:
    model_dir: Path
    replicas: int = 1
    max_replicas: int | None = None
    kserve: bool = False
    inference_pool: bool = False
    nodes: int = 1
    namespace: str | None = None
    image: str = DEFAULT_IMAGE
    name: str | None = None
    cpus: int = DEFAULT_CPUS
    gpu: bool = False
    memory: str | None = None
    weights_claim: str | None = None
    cache_claim: str | None = None
    cache_claim_per_pod: str | None = None  # the size of each pod's own cache claim
    storage_uri: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Request:
        return cls(**{f: getattr(args, f) for f in cls.__dataclass_fields__})


def cmd_k8s(args: argparse.Namespace) -> int:
    from serving.deploy.manifests import build  # the sizing reads the engine's planning modules: only when asked

    try:
        manifests = build(Request.from_args(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(manifests.yaml())
    for note in manifests.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
