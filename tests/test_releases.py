"""`conformance/releases.py pins`: the conformance venv installs vLLM with --no-deps, then
each package it needs at the versions vLLM's own requirements allow."""

from __future__ import annotations

from conformance.releases import pins

VLLM_LIKE = [
    "transformers<5.21.0,>=5.16.1",
    "fastapi[standard]<0.137.0,>=0.133.0",
    "regex",
    'llguidance<1.8.0,>=1.7.0; platform_machine == "no-such-machine"',
    'zentorch==2.14.0.1; extra == "zen"',
    "prometheus_client>=0.18.0",
]


def test_a_package_vllm_bounds_gets_vllms_range_and_the_others_stay_bare() -> None:
    assert pins(["transformers", "fastapi", "regex", "uvloop"], VLLM_LIKE) == [
        "transformers<5.21.0,>=5.16.1", "fastapi<0.137.0,>=0.133.0", "regex", "uvloop"]


def test_names_match_as_pip_matches_them_and_markers_are_evaluated() -> None:
    # prometheus-client is vLLM's prometheus_client; a requirement for another machine or
    # for an extra does not bound the package here
    assert pins(["prometheus-client", "llguidance", "zentorch"], VLLM_LIKE) == [
        "prometheus-client>=0.18.0", "llguidance", "zentorch"]
