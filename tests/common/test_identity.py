"""Identities named in certificates: the URI SAN they are written as and read back from."""

from __future__ import annotations

import pytest

from services.common.security.identity import Identity, Role, identity_of, parse_uri, sans_of


def test_an_identity_round_trips_through_its_uri() -> None:
    for identity in (Identity(Role.MESSENGER, "node-0"), Identity(Role.ADMIN, "ops.team_1")):
        assert parse_uri(identity.uri) == identity
    assert Identity(Role.ROUTER, "router-0").uri == "spiffe://kvsched/router/router-0"


@pytest.mark.parametrize(
    "uri",
    [
        "spiffe://other/router/router-0",  # another trust domain
        "spiffe://kvsched/engine/e0",  # no such role
        "spiffe://kvsched/router",  # no name
        "spiffe://kvsched/router/a/b",  # a name with a slash
        "spiffe://kvsched/router/",  # an empty name
        "https://kvsched/router/router-0",
        "localhost",
    ],
)
def test_other_uris_name_no_identity(uri: str) -> None:
    assert parse_uri(uri) is None


def test_a_certificate_names_exactly_one_identity() -> None:
    router = Identity(Role.ROUTER, "r")
    assert identity_of([router.uri, "localhost", "127.0.0.1"]) == router
    assert identity_of([router.uri, router.uri]) == router  # the same one twice
    assert identity_of(["localhost"]) is None
    assert identity_of([router.uri, Identity(Role.ADMIN, "r").uri]) is None  # two: ambiguous


def test_names_are_checked() -> None:
    with pytest.raises(ValueError, match="identity name"):
        Identity(Role.MESSENGER, "node/0")
    with pytest.raises(ValueError):
        Identity(Role.MESSENGER, "")


def test_the_sans_come_from_grpcs_auth_context() -> None:
    context = {"x509_subject_alternative_name": [b"spiffe://kvsched/admin/a", b"localhost"]}
    assert sans_of(context) == ["spiffe://kvsched/admin/a", "localhost"]
    assert sans_of({}) == []  # plaintext peer
