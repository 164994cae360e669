"""A bounded property-based fuzz of the server's published OpenAPI schema: no input may cause a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from specdec.server import create_app
from test_server import MODEL, make_decoder


@pytest.fixture(scope="module")
def api_schema(model_dirs):
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(make_decoder(model_dirs), MODEL))


schema = schemathesis.pytest.from_fixture("api_schema")


STATUSES: dict[str, set[int]] = {}


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_input_causes_a_server_error(case):
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL  # reach the generation paths; unknown models are tested on their own
    response = case.call()
    STATUSES.setdefault(case.path, set()).add(response.status_code)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:300]}"


def test_the_fuzz_reached_generation():
    """Not only rejections: generated bodies were valid often enough to generate text."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert 200 in STATUSES.get(path, set()), STATUSES
