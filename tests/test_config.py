"""Settings parse the way docs/operations.md says, and bad ones stop the process with 78."""

from __future__ import annotations

import pytest

from shared.config import EX_CONFIG, Config, parse_fleet, per_model


def test_per_model_values_fall_back_to_the_default():
    assert per_model("jax,smollm2-135m-instruct=torch", "smollm2-135m-instruct") == "torch"
    assert per_model("jax,smollm2-135m-instruct=torch", "all-MiniLM-L6-v2") == "jax"
    assert per_model("bfloat16", "anything") == "bfloat16"
    with pytest.raises(ValueError):
        per_model("jax,torch", "m")


def test_fleet_bounds_per_model_and_global():
    cfg = Config.from_env({}, fleet="all-MiniLM-L6-v2=2:4,smollm2-135m-instruct=0:1",
                          min_workers=0, max_workers=3)
    assert cfg.fleet_bounds("all-MiniLM-L6-v2") == (2, 4)
    assert cfg.fleet_bounds("smollm2-135m-instruct") == (0, 1)
    assert cfg.fleet_bounds("tensorbus-demo-lm") == (0, 3)
    assert list(parse_fleet("b=1:1,a=0:0")) == ["b", "a"]  # order kept: it is a priority


@pytest.mark.parametrize("bad", ["m=2", "m=3:1", "m=-1:2", "=1:2", "m=a:b", "m=1:1,m=0:1"])
def test_malformed_fleet_entries_are_refused(bad):
    with pytest.raises(ValueError):
        parse_fleet(bad)


def test_a_bad_setting_exits_with_ex_config(capsys):
    with pytest.raises(SystemExit) as exc:
        Config.from_env({"TENSORBUS_HTTP_PORT": "eighty"})
    assert exc.value.code == EX_CONFIG == 78
    assert "http_port" in capsys.readouterr().err
