"""DJL Serving's answer shapes where its clients read them: ``GET /models/{name}``.

Design note: DJL describes a model as a one-element list of workflows, each with ``models`` holding DJL's fields
(``modelName``, ``batchSize``, ``queueSize``, ``status`` = Healthy/Unhealthy/the state, ``workerGroups`` of
``{device, minWorkers, maxWorkers, workers: [{id, startTime, status, device}]}``); DJL's own clients and tests
count ``models[0].workerGroups[0].workers``. rollserve's description of the model (``ModelEndpoint.describe``)
goes inside the same model object, its state as ``state`` (DJL's ``status`` keeps DJL's words). ``model_entry``
reads the model object back out of an answer (rollserve's own clients). The workflow's ``version`` is the
model version described; ``versions`` adds the version's place among the model's (``serving.models.versions``).
"""

from __future__ import annotations

import datetime
from typing import Any

from serving.models.endpoint_protocol import Endpoint


def describe_model(ep: Endpoint, loaded_at_startup: bool, versions: dict[str, Any] | None = None
                   ) -> list[dict[str, Any]]:
    """DJL's ``GET /models/{name}`` answer for one endpoint (a ``ModelEndpoint`` or a ``FailedEndpoint``);
    ``versions``: ``ModelVersions.describe`` of its version (merged into the model object)."""
    ours = dict(ep.describe())
    state = ours.pop("status")
    workers = ours.get("workers") or []
    model: dict[str, Any] = {"modelName": ep.name, "modelUrl": ours.get("model_dir", ep.name),
                             "batchSize": ours.get("batch_size", 1),
                             "maxBatchDelayMillis": ours.get("max_batch_delay", 0),
                             "maxIdleSeconds": int(ep.config.max_idle_time_s) if ep.config is not None else 0,
                             "queueSize": ours.get("job_queue_size", 0),
                             "requestInQueue": ep.batcher.num_queued() if ep.batcher is not None else 0,
                             "status": _status(state, workers, ours.get("min_workers", 1)),
                             "loadedAtStartup": loaded_at_startup,
                             "workerGroups": _groups(workers, ours.get("min_workers", 0), ours.get("max_workers", 0)),
                             "state": state, **ours, **(versions or {})}
    return [{"workflowName": ep.name, "version": ep.version, "models": [model]}]


def model_entry(body: Any) -> dict[str, Any]:
    """The model object of a ``GET /models/{name}`` answer."""
    return dict(body[0]["models"][0])


def _status(state: str, workers: list[dict[str, Any]], min_workers: int) -> str:
    if state != "READY":
        return state
    ready = sum(1 for w in workers if w.get("status") == "READY")
    return "Healthy" if ready >= max(1, min_workers) else "Unhealthy"


def _device(devices: list[str]) -> dict[str, Any]:
    """DJL's device object: ``{"deviceType": "cpu", "deviceId": -1}`` or a GPU's index (a tensor-parallel
    worker's first device, all of them in ``devices``)."""
    if not devices or devices == ["cpu"]:
        return {"deviceType": "cpu", "deviceId": -1}
    ids = [int(d.removeprefix("gpu")) for d in devices]
    return {"deviceType": "gpu", "deviceId": ids[0], **({"devices": ids} if len(ids) > 1 else {})}


def _groups(workers: list[dict[str, Any]], min_workers: int, max_workers: int) -> list[dict[str, Any]]:
    """One group per device (DJL's worker groups), each listing its workers."""
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    for w in workers:
        key = tuple(w.get("devices") or ["cpu"])
        group = groups.setdefault(key, {"device": _device(list(key)), "minWorkers": min_workers,
                                        "maxWorkers": max_workers, "workers": []})
        started = datetime.datetime.fromtimestamp(w.get("started_at", 0.0), datetime.UTC)
        group["workers"].append({"id": w["id"], "startTime": started.isoformat(timespec="milliseconds").replace(
            "+00:00", "Z"), "status": "READY" if w.get("status") == "READY" else "UNLOADING",
            "device": group["device"]})
    if not groups:  # no worker yet: DJL still lists the (empty) group of the model's device
        groups[("cpu",)] = {"device": _device([]), "minWorkers": min_workers, "maxWorkers": max_workers,
                            "workers": []}
    return list(groups.values())
