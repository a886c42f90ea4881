"""Generate the Python stubs of the ``.proto`` sources into ``serving/frontends/proto/gen/``.

Run ``python -m serving.frontends.proto.generate`` after editing a ``.proto`` file and commit the result;
``tests/unit/test_grpc_stubs.py`` regenerates into a temporary folder and fails when the committed stubs
differ. The proto folder is mapped onto the virtual path ``serving/frontends/proto/gen`` (``-I`` with
``virtual=disk``), so the generated modules import each other as ``serving.frontends.proto.gen.*``.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE = "serving/frontends/proto/gen"
SOURCES = ("inference/grpc_service.proto", "rollserve/v1/generate.proto")
HEADER = '"""Generated from serving/frontends/proto/*.proto by generate.py (grpcio-tools {version}). Do not edit."""\n'


def tools_version() -> str:
    return metadata.version("grpcio-tools")


def generate(out_root: Path) -> Path:
    """Write the stubs under ``out_root / PACKAGE`` and return that folder. Raises RuntimeError on failure."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PACKAGE}={PROTO_DIR}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
            *(str(PROTO_DIR / s) for s in SOURCES)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    gen = out_root / PACKAGE
    for folder in [gen, *(p for p in gen.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").write_text(HEADER.format(version=tools_version()) if folder == gen else "")
    return gen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-root", type=Path, default=PROTO_DIR.parents[2],
                    help="folder that receives serving/frontends/proto/gen (default: the repository)")
    args = ap.parse_args(argv)
    print(generate(args.out_root), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
