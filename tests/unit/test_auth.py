"""Token file parsing, constant-time resolution, roles."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore_server.auth import ROLES, TENANT_PATTERN, Principal, TokenTable, bearer_token, tenant_prefix


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    return path


def test_tokens_resolve_to_their_tenant_and_role(tmp_path: Path) -> None:
    hashed = hashlib.sha256(b"admin-token-0123456789").hexdigest()
    table = TokenTable.load(
        write(
            tmp_path,
            f"""
[[tokens]]
token = "reader-token-0123456789"
tenant = "team-a"
role = "reader"

[[tokens]]
token_sha256 = "{hashed}"
tenant = "ops"
role = "admin"
""",
        )
    )
    assert table.resolve("reader-token-0123456789") == Principal("team-a", "reader")
    assert table.resolve("admin-token-0123456789") == Principal("ops", "admin")
    assert table.resolve("reader-token-012345678") is None
    assert table.resolve("") is None


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('token = "short"\ntenant = "a"\nrole = "reader"', "at least 16"),
        ('token = "long-enough-token-123"\ntenant = "a"\nrole = "root"', "role must be"),
        ('token = "long-enough-token-123"\ntenant = ""\nrole = "reader"', "tenant"),
        ('token_sha256 = "zz"\ntenant = "a"\nrole = "reader"', "64 hex"),
        ('tenant = "a"\nrole = "reader"', "exactly one of"),
        ('token = "long-enough-token-123"\ntenant = "a"\nrole = "reader"\nexpires = 1', "unknown keys"),
    ],
)
def test_bad_token_files_are_refused_with_a_reason(tmp_path: Path, entry: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenTable.load(write(tmp_path, "[[tokens]]\n" + entry + "\n"))


@pytest.mark.parametrize(
    "tenant",
    ["a\\u0000b", "team a", "team/a", "x" * 65, "caf\\u00e9", "a\\nb"],
    ids=["nul", "space", "slash", "too-long", "non-ascii", "newline"],
)
def test_tenant_names_outside_the_documented_set_are_refused_naming_the_entry(
    tmp_path: Path, tenant: str
) -> None:
    text = (
        '[[tokens]]\ntoken = "a-token-0123456789abcdef"\ntenant = "a"\nrole = "writer"\n\n'
        f'[[tokens]]\ntoken = "b-token-0123456789abcdef"\ntenant = "{tenant}"\nrole = "writer"\n'
    )
    with pytest.raises(ValueError, match=r"tokens\[1\]: tenant .* must match") as info:
        TokenTable.load(write(tmp_path, text))
    assert TENANT_PATTERN in str(info.value)


def test_tenant_names_of_the_documented_set_are_accepted(tmp_path: Path) -> None:
    name = "Team-A_1.prod" + "x" * 51  # 64 characters
    text = f'[[tokens]]\ntoken = "a-token-0123456789abcdef"\ntenant = "{name}"\nrole = "reader"\n'
    assert TokenTable.load(write(tmp_path, text)).resolve("a-token-0123456789abcdef") == Principal(
        name, "reader"
    )


TENANTS = st.from_regex(f"\\A{TENANT_PATTERN}\\Z")
NAMESPACES = st.binary(min_size=1, max_size=16)


@given(TENANTS, NAMESPACES, TENANTS, NAMESPACES)
def test_no_two_tenant_namespace_pairs_store_as_the_same_namespace(
    t1: str, n1: bytes, t2: str, n2: bytes
) -> None:
    if (t1, n1) != (t2, n2):
        assert tenant_prefix(t1) + n1 != tenant_prefix(t2) + n2


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokens"):
        TokenTable.load(write(tmp_path, ""))


def test_roles_nest() -> None:
    assert [Principal("t", r).may("writer") for r in ROLES] == [False, True, True]
    assert [Principal("t", r).may("admin") for r in ROLES] == [False, False, True]
    assert all(Principal("t", r).may("reader") for r in ROLES)


def test_bearer_token_is_read_from_the_authorization_header() -> None:
    assert bearer_token([("x-other", "1"), ("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token(None) is None
