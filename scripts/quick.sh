#!/usr/bin/env bash
# The first thing to run after a change: the checks and unit tests that need no
# nats-server, no model and no compile (engine parts, gateway and worker stages,
# scheduling and admission logic, the house rules): 19 s on two quiet cores once
# mypy's cache is warm. Then the file of what you changed, then scripts/test.sh (the whole
# suite, CI's command). Extra arguments go to pytest. Needs .venv (scripts/test.sh
# or `scripts/bootstrap.sh dev` makes it).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/lint-imports --no-cache
.venv/bin/mypy
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@" \
    tests/engine/test_blocks.py tests/engine/test_buckets.py tests/engine/test_packing.py \
    tests/engine/test_slot_table.py \
    tests/services/batch/test_lines.py tests/services/test_batch_lane.py \
    tests/services/test_canary_guard.py \
    tests/services/test_chunk_order.py tests/services/test_decode_scheduler.py \
    tests/services/test_gateway_admission.py tests/services/test_gateway_fanout.py \
    tests/services/test_gateway_inbox.py tests/services/test_heartbeat_fields.py \
    tests/services/test_holds.py tests/services/test_reasoning.py \
    tests/services/test_registry_election.py tests/services/test_responses.py \
    tests/services/test_scheduler_admission.py tests/services/test_scheduler_links.py \
    tests/services/test_sketch.py tests/services/test_worker_batcher.py \
    tests/services/test_worker_outbox.py tests/services/test_worker_runner.py \
    tests/services/test_worker_warmup.py \
    tests/test_admission.py tests/test_generation_admission.py tests/test_house.py \
    tests/test_prefix.py
