"""Token file parsing, constant-time resolution, roles."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvstore_server.auth import ROLES, Principal, TokenTable, bearer_token


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
