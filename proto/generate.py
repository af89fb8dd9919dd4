"""Regenerate the committed Python stubs from proto/.

    python proto/generate.py            # write stubs in place
    python proto/generate.py --out DIR  # write them under DIR instead (the staleness test does this)

Each .proto is mapped onto the Python package that holds its stubs, so the generated imports are
absolute (`from services.transferqueue.pb import ...`) while the .proto keeps a language-neutral
package name.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent

# proto source directory -> Python package directory of its stubs
STUB_PACKAGES = {
    "proto/sluice/transferqueue/v1": "services/transferqueue/pb",
}


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    written = []
    for src_dir, package_dir in STUB_PACKAGES.items():
        (out / package_dir).mkdir(parents=True, exist_ok=True)
        for proto in sorted((ROOT / src_dir).glob("*.proto")):
            args = [
                "protoc",
                f"-I{package_dir}={ROOT / src_dir}",
                f"-I{pathlib.Path(protoc.__file__).parent / '_proto'}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                f"{package_dir}/{proto.name}",
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {proto}")
            stem = proto.stem
            written += [out / package_dir / f"{stem}{suffix}" for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    args = parser.parse_args()
    for path in generate(args.out.resolve()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
