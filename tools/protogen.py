"""Regenerate the Python stubs in ``kvgrid/v1`` from ``protos/kvgrid/v1/*.proto``.

The stubs are committed so that images and clients need no code generator;
``tests/test_protos.py`` fails when they are stale. Run ``make protos`` after
editing a .proto file.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc  # build-time dependency only

    sources = sorted((PROTO_DIR / "kvgrid" / "v1").glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ]
    if protoc.main(args + [str(s.relative_to(PROTO_DIR)) for s in sources]) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "kvgrid" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    written = generate(ROOT)
    print("\n".join(str(p.relative_to(ROOT)) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
