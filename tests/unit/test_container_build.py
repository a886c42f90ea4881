"""The image's build steps that hadolint and the parsed-Dockerfile checks cannot judge (no container engine here):
the shell of each RUN is run by bash against stub commands on an empty PATH (nothing real is installed or removed),
so what pip and apt-get would be asked is asserted exactly: an offline build installs from ``WHEELS_DIR`` alone,
a base without Python gets the distribution's in both stages, and the runtime stage refuses a venv whose
interpreter it lacks."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.unit.dockerfile_parse import arg_defaults, ignored, parse

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = parse((ROOT / "Dockerfile").read_text(encoding="utf-8"))
BUILDER, RUNTIME = DOCKERFILE.stages[0], DOCKERFILE.final
MOUNT = "--mount=type=bind,source=${WHEELS_DIR:-docker},target=/wheels"


def run(script: str, tmp_path: Path, env: dict[str, str], present: tuple[str, ...] = ()) -> list[str]:
    """``script`` under bash with only stubs on PATH (apt-get, rm, python3 when ``present``, /opt/venv/bin/pip
    rewritten to a stub); returns each stub call, one line each."""
    stubs, log = tmp_path / "bin", tmp_path / "calls"
    stubs.mkdir(exist_ok=True)
    for name in ("apt-get", "rm", "pip", *present):
        (stubs / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {log}\n')
        (stubs / name).chmod(0o755)
    # apt-get installing python3 puts a python3 on PATH, as the real one would
    python3 = stubs / "python3"
    (stubs / "apt-get").write_text(f'#!/bin/bash\necho "apt-get $*" >> {log}\n'
                                   f'if [[ " $* " == *" python3 "* ]]; then /bin/cp {stubs / "rm"} {python3}; '
                                   f'/bin/sed -i s/rm/python3/ {python3}; fi\n')
    body = script.replace("/opt/venv/bin/pip", str(stubs / "pip"))
    done = subprocess.run(["/bin/bash", "-f", "-c", body], env={"PATH": str(stubs), **env}, capture_output=True,
                          text=True, timeout=30)  # -f: no glob expands against this machine's files
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines() if log.exists() else []


def install_step() -> str:
    (step,) = [i.args for i in BUILDER.all("RUN") if "pip install" in i.args]
    assert step.startswith(MOUNT + " "), step
    return step.removeprefix(MOUNT + " ")


def test_wheels_dir_is_a_build_argument_empty_by_default() -> None:
    assert arg_defaults(BUILDER.all("ARG"))["WHEELS_DIR"] == ""
    # unset, the mount's source is docker/: in the build context, holding no wheel
    assert (ROOT / "docker").is_dir() and not list((ROOT / "docker").glob("*.whl"))
    assert not ignored("docker/healthcheck.py", (ROOT / ".dockerignore").read_text(encoding="utf-8"))


@pytest.mark.parametrize(("wheels", "expected"), [
    ("", "pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cu128 "
         "-c constraints/cpu.txt ."),
    ("wheelhouse", "pip install --no-cache-dir --no-index --find-links /wheels -c constraints/cpu.txt ."),
])
def test_the_install_uses_the_wheels_folder_alone_when_given(tmp_path: Path, wheels: str, expected: str) -> None:
    calls = run(install_step(), tmp_path, {"WHEELS_DIR": wheels,
                                            "TORCH_INDEX": "https://download.pytorch.org/whl/cu128"})
    assert calls == [expected]


def python_step(stage_runs: list[str]) -> str:
    (step,) = [s for s in stage_runs if "command -v python3" in s]
    return step


@pytest.mark.parametrize(("has_python", "builder", "runtime"), [
    (True, ["python3 -m venv /opt/venv"],
     ["apt-get update", "apt-get install -y --no-install-recommends gcc libc6-dev", "rm -rf /var/lib/apt/lists/*"]),
    (False, ["apt-get update", "apt-get install -y --no-install-recommends python3 python3-venv",
             "rm -rf /var/lib/apt/lists/*", "python3 -m venv /opt/venv"],
     ["apt-get update", "apt-get install -y --no-install-recommends gcc libc6-dev",
      "apt-get install -y --no-install-recommends python3 python3-dev", "rm -rf /var/lib/apt/lists/*"]),
])
def test_a_base_without_python_gets_the_distributions_in_both_stages(tmp_path: Path, has_python: bool,
                                                                     builder: list[str], runtime: list[str]) -> None:
    """A CUDA base as BUILDER_IMAGE and BASE_IMAGE: python3 from apt in both stages, so the copied venv's
    interpreter is where it was built; a base with Python (the default python:3.11 image) installs none."""
    present = ("python3",) if has_python else ()
    (tmp_path / "builder").mkdir()
    (tmp_path / "runtime").mkdir()
    assert run(python_step([i.args for i in BUILDER.all("RUN")]), tmp_path / "builder", {}, present) == builder
    assert run(python_step([i.args for i in RUNTIME.all("RUN")]), tmp_path / "runtime", {}, present) == runtime


def test_the_runtime_stage_refuses_a_venv_its_base_cannot_run(tmp_path: Path) -> None:
    (check,) = [i.args for i in RUNTIME.all("RUN") if "/opt/venv/bin/python" in i.args]
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    os.symlink("/usr/local/bin/python3.11-absent", venv / "python")
    done = subprocess.run(["/bin/bash", "-c", check.replace("/opt/venv", str(tmp_path / "venv"))],
                          capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 1
    assert re.search(r"the venv's interpreter \(/usr/local/bin/python3\.11-absent\) does not run on BASE_IMAGE: "
                     r"build both stages from one image \(BUILDER_IMAGE = BASE_IMAGE\)", done.stderr), done.stderr
