"""kvstore_server.main's command line before anything starts: size flags, the listen probe
(no daemon: main returns before it opens the store)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvstore.sizes import SIZE_FORMS
from kvstore_server.main import listen_problem, main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--memory", "-1GiB"],
            f"--memory: invalid size '-1GiB': a size must not be negative ({SIZE_FORMS})",
        ),
        (["--memory=-1GiB"], f"--memory: invalid size '-1GiB': a size must not be negative ({SIZE_FORMS})"),
        (["--capacity", "lots"], f"--capacity: invalid size 'lots' ({SIZE_FORMS})"),
        (["--max-put-bytes", "-5"], "--max-put-bytes: invalid size '-5': a size must not be negative"),
        (["--fleet-queue-bytes", "1.2.3MiB"], "--fleet-queue-bytes: invalid size '1.2.3MiB'"),
    ],
)
def test_a_bad_size_flag_is_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code = main(["--data-dir", str(tmp_path / "data"), "--memory-dir", str(tmp_path / "shm"), *args])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith(f"kvstore-server: {message}") and err.count("\n") == 1
    assert "usage:" not in err
    assert not (tmp_path / "data").exists()  # refused before anything was made


def test_size_flags_are_parsed_for_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--data-dir", str(tmp_path), "--memory", "0", "--capacity", "2GiB", "--print-config"])
    out = capsys.readouterr().out
    assert code == 0 and "capacity = 2147483648\n" in out and "memory = 0\n" in out


def test_the_listen_probe_names_a_taken_address() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        assert listen_problem(listen) == (
            f"cannot listen on {listen}: the address is already in use (another kvstore-server?); "
            "choose another with --listen"
        )
    assert listen_problem(listen) is None  # free again
    assert listen_problem("127.0.0.1:0") is None
    assert "does not resolve" in (listen_problem("no-such-host.invalid:50051") or "")
