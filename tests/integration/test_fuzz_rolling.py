"""A bounded schemathesis run over the inference AND the management API of a server whose model is a rolling-
batch model, with tokens (inference authorization on): no 5xx, no traceback in the log, and afterwards the
model serves and no slot or KV block leaked."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import ServerProcess
from tests.integration.hostile import assert_no_leaks, lmi_body

SCHEMATHESIS = shutil.which("st") or str(Path(sys.executable).parent / "st")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("fuzz-rolling"),
                            # max_model_len bounds the work one fuzzed request can ask for (a 2048-token answer
                            # on a busy machine outlived the 120 s predict timeout: a 504 from load, not a bug)
                            models={"roll": {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "4",
                                             "option.max_model_len": "96"}},
                            config={"inference_auth": "true"})
    yield s
    s.stop()


@pytest.mark.parametrize("api", ["inference", "management"])
def test_schemathesis_finds_no_server_error(server: ServerProcess, api: str, tmp_path: Path) -> None:
    if not Path(SCHEMATHESIS).exists():
        pytest.fail("schemathesis is not installed (pip install -e '.[test]')")
    base = server.url if api == "inference" else server.mgmt
    headers = server.inference_headers if api == "inference" else server.mgmt_headers
    schema = tmp_path / "openapi.json"
    document = httpx.get(f"{base}/openapi.json", headers=headers, timeout=10).json()
    schema.write_text(json.dumps(document))
    token = headers["Authorization"]
    cmd = [SCHEMATHESIS, "run", str(schema), "--url", base, "-H", f"Authorization: {token}",
           "--checks", "not_a_server_error", "--max-examples", "12", "--seed", "11", "--request-timeout", "120",
           "--no-color", "--phases", "examples,fuzzing", "--workers", "2", "--report-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    print(proc.stdout[-1500:])
    assert "Traceback" not in server.log(), server.log()[-4000:]
    r = httpx.post(f"{server.url}/predictions/roll", json=lmi_body(max_new_tokens=4), headers=server.inference_headers,
                   timeout=60)
    assert r.status_code == 200, r.text
    assert server.describe("roll")["state"] == "READY"
    assert_no_leaks(server, "roll", timeout_s=120)
