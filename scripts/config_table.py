"""Print the TENSORBUS_* settings table for docs/operations.md from shared/config.py."""

from __future__ import annotations

import re
from pathlib import Path

from shared.config import Config

SRC = Path(__file__).resolve().parent.parent / "shared" / "config.py"


def rows() -> list[str]:
    out = ["| variable | default | meaning |", "|---|---|---|"]
    for line in SRC.read_text().splitlines():
        m = re.match(r"\s+(\w+): [\w.| ]+ = (.+?)(?:\s+#\s*(.+))?$", line)
        if m and m.group(1) in Config.__struct_fields__:
            meaning = (m.group(3) or "").replace("|", "/")
            out.append(f"| `TENSORBUS_{m.group(1).upper()}` | `{m.group(2)}` | {meaning} |")
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
