"""``serving k8s --nodes N``: one model's tensor-parallel ranks over N pods, as a LeaderWorkerSet group.

The leader pod runs ``serving`` (the frontend and rank 0's host: it learns the group's size from the
``LWS_GROUP_SIZE`` LeaderWorkerSet sets and listens for the other hosts on ``MASTER_PORT``); each worker pod runs
``serving worker --leader $(LWS_LEADER_ADDRESS):29500`` over the same model store. Both hold the group's secret
(``ROLLSERVE_CLUSTER_SECRET``, from a Secret); each pod asks for its share of the ranks' resources. A failed pod
recreates the whole group (``RecreateGroupOnPodRestart``: the ranks cannot rejoin a running group), and workers
start once the leader is created.
"""

from __future__ import annotations

from typing import Any

from serving.deploy.monitoring import metadata
from serving.deploy.pods import CLAIM_RETENTION, PodContext, cache_claim_templates, pod_template


def leader_worker_set(ctx: PodContext, namespace: str | None, replicas: int) -> dict[str, Any]:
    s = ctx.sizing
    assert s.worker is not None
    group: dict[str, Any] = {"size": s.nodes, "restartPolicy": "RecreateGroupOnPodRestart",
                             "leaderTemplate": pod_template(ctx, "leader", s.leader),
                             "workerTemplate": pod_template(ctx, "worker", s.worker)}
    if ctx.cache_per_pod is not None:  # every pod of every group its own cache claim
        group |= {"volumeClaimTemplates": cache_claim_templates(ctx),
                  "persistentVolumeClaimRetentionPolicy": CLAIM_RETENTION}
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": metadata(ctx.name, namespace, "server", ctx.name),
            "spec": {"replicas": replicas, "startupPolicy": "LeaderCreated", "leaderWorkerTemplate": group}}
