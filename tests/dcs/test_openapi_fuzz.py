"""Schemathesis over the coordinator's OpenAPI, against the real process: no generated input makes
it answer with a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from services.dcs.local import LocalDCS


pytestmark = pytest.mark.slow  # several processes end to end; ./dev test runs it


def test_no_input_causes_a_server_error(tmp_path):
    with LocalDCS(log_dir=str(tmp_path)) as dcs:
        schema = schemathesis.openapi.from_url(dcs.url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 15
        server_errors, statuses = [], []
        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def fuzz(case):
                if case.path == "/v1/runs/{run_id}/weights/next":
                    case.query = {**(case.query or {}), "wait_s": 0}  # do not long-poll
                response = case.call(base_url=dcs.url, timeout=10)
                statuses.append(response.status_code)
                if response.status_code >= 500:
                    server_errors.append((case.method, case.formatted_path, response.status_code, response.text[:200]))

            fuzz()
        assert server_errors == []
        assert len(statuses) >= 100 and any(400 <= s < 500 for s in statuses) and 200 in statuses
        assert dcs.proc.alive()
