"""The documentation a newcomer relies on stays true to the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import msgspec

from shared.api import Usage
from shared.config import Config

ROOT = Path(__file__).resolve().parent.parent


def test_every_setting_is_documented_in_operations():
    text = (ROOT / "docs" / "operations.md").read_text()
    missing = [f for f in Config.__struct_fields__ if f"TENSORBUS_{f.upper()}" not in text]
    assert not missing, f"undocumented settings: {missing} (run scripts/config_table.py)"


def documented_defaults() -> dict[str, str]:
    """`TENSORBUS_NAME` -> the default column of its row in docs/operations.md."""
    text = (ROOT / "docs" / "operations.md").read_text()
    return dict(re.findall(r"^\| `TENSORBUS_(\w+)` \| `([^`]*)` \|", text, flags=re.M))


def test_every_documented_default_is_the_codes_default():
    documented = documented_defaults()
    code = Config()
    assert set(documented) == {f.upper() for f in Config.__struct_fields__}, \
        "the settings table lists other settings than shared/config.py (scripts/config_table.py)"
    wrong = {f"TENSORBUS_{name}": (text, getattr(code, name.lower()))
             for name, text in documented.items()
             if ast.literal_eval(text) != getattr(code, name.lower())}
    assert not wrong, f"documented default != code default: {wrong} (scripts/config_table.py)"


def test_embeddings_usage_has_openais_shape():
    # docs/protocol.md: {"prompt_tokens": 4, "total_tokens": 4}, no completion_tokens.
    assert msgspec.json.decode(msgspec.json.encode(Usage(prompt_tokens=4, total_tokens=4))) == \
        {"prompt_tokens": 4, "total_tokens": 4}


def test_readme_starts_with_the_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert [line.split("#")[0].strip() for line in block] == ["scripts/up.sh", "scripts/test.sh"]
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_procfile_holds_long_running_services_only():
    names = [line.split(":", 1)[0] for line in (ROOT / "Procfile").read_text().splitlines() if line.strip()]
    assert names == ["nats", "gateway", "scheduler", "orchestrator", "telemetry", "batch"]


def test_the_cluster_procfile_differs_only_in_its_nats_line():
    single = (ROOT / "Procfile").read_text().splitlines()
    cluster = (ROOT / "Procfile.cluster").read_text().splitlines()
    assert [x for x in single if not x.startswith("nats:")] == \
        [x for x in cluster if not x.startswith("nats:")]
    assert "nats: .venv/bin/tensorbus nats --cluster 3" in cluster
    assert "honcho start -f Procfile.cluster" in (ROOT / "docs" / "operations.md").read_text()
