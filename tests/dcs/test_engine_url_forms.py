"""An engine's URL in the coordinator's one form, IPv6 hosts included (services/dcs/models.py)."""

from __future__ import annotations

import pytest

from services.dcs.models import NodeRegistration, engine_url


@pytest.mark.parametrize(
    "given, canonical",
    [
        ("http://Engine-0:30000/", "http://engine-0:30000"),
        ("https://10.0.0.7", "https://10.0.0.7:443"),
        ("http://[::1]:30000", "http://[::1]:30000"),
        ("http://[FE80::1]", "http://[fe80::1]:80"),
    ],
)
def test_engine_urls_take_one_form(given, canonical):
    assert engine_url(given) == canonical
    assert engine_url(canonical) == canonical


def test_a_registration_on_an_ipv6_host_gives_a_url_that_parses_back():
    node = NodeRegistration(role="engine", host="::1", ports={"http": 30000})
    assert node.url() == "http://[::1]:30000"
    assert engine_url(node.url()) == node.url()
    assert NodeRegistration(role="engine", host="10.0.0.7", ports={"https": 8443}).url() == "https://10.0.0.7:8443"


def test_a_url_with_a_path_is_refused():
    with pytest.raises(ValueError, match="only scheme://host"):
        engine_url("http://[::1]:30000/generate")
