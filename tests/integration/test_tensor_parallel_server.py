"""A rolling model with option.tensor_parallel_degree=2 served end to end: its two ranks answer like the
single-rank model, and shutdown leaves no rank process behind."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.integration.harness import ServerProcess


def test_tp2_model_serves_like_tp1_and_exits_cleanly(tmp_path: Path) -> None:
    rolling = {"option.rolling_batch": "auto", "option.num_kv_blocks": "256"}
    server = ServerProcess.start(tmp_path, models={"tp1": rolling,
                                                   "tp2": {**rolling, "option.tensor_parallel_degree": "2"}})
    try:
        body = {"inputs": "Tensor parallel serving", "parameters": {"max_new_tokens": 12, "details": True}}
        answers = {}
        for model in ("tp1", "tp2"):
            r = httpx.post(f"{server.url}/predictions/{model}", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers[model] = [t["id"] for t in r.json()["details"]["tokens"]]
        assert answers["tp1"] == answers["tp2"]
        assert len(server.worker_pids()) == 2  # one worker per model; rank 1 is the tp2 worker's child
    finally:
        server.stop()
