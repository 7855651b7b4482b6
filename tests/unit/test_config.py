"""kvstore_server.config: sizes (kvstore.sizes, which it reads them with), TOML, overrides,
validation."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import tomllib

from kvstore.sizes import SIZE_FORMS, attach_values, format_size, parse_size
from kvstore_server import config as config_module
from kvstore_server.config import SIZE_SETTINGS, ServerConfig, auto_capacity, auto_memory


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 << 20),
        ("64GiB", 64 << 30),
        ("10GB", 10 * 1000**3),
        ("1TiB", 1 << 40),
        ("2TB", 2 * 1000**4),
        ("100KB", 100_000),
        ("4KiB", 4096),
        ("8k", 8192),
        ("3M", 3 << 20),
        ("2G", 2 << 30),
        ("1T", 1 << 40),
        ("1.5GiB", 3 << 29),
        ("12345", 12345),
        ("0", 0),
        ("77B", 77),
        ("  16 mib ", 16 << 20),
        ("1gIb", 1 << 30),
        (4096, 4096),
        (0, 0),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["", "GiB", "12 parsecs", "-5", "1e9", "1,000", "5 GiB extra", "0x10", "1.2.3MiB"]
)
def test_parse_size_rejects_bad_strings_naming_them(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(bad)
    assert repr(bad) in str(info.value)


def test_parse_size_rejects_negative_ints() -> None:
    with pytest.raises(ValueError, match="-1"):
        parse_size(-1)


@pytest.mark.parametrize(
    ("value", "what", "message"),
    [
        ("lots", "--memory", f"--memory: invalid size 'lots' ({SIZE_FORMS})"),
        ("-1GiB", "--memory", f"--memory: invalid size '-1GiB': a size must not be negative ({SIZE_FORMS})"),
        (-5, "capacity", f"capacity: invalid size -5: a size must not be negative ({SIZE_FORMS})"),
        ("2 parsecs", "", f"invalid size '2 parsecs' ({SIZE_FORMS})"),
    ],
)
def test_size_errors_name_the_setting_and_the_accepted_forms(
    value: str | int, what: str, message: str
) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(value, what)
    assert str(info.value) == message
    assert "512MiB, 16GiB" in SIZE_FORMS


def test_attach_values_joins_a_dash_value_to_its_flag_only() -> None:
    flags = ["--memory", "--capacity"]
    assert attach_values(["--memory", "-1GiB", "--sync"], flags) == ["--memory=-1GiB", "--sync"]
    assert attach_values(["--capacity", "-.5G"], flags) == ["--capacity=-.5G"]
    # an option after the flag stays an option; other flags and values are left alone
    assert attach_values(["--memory", "--sync"], flags) == ["--memory", "--sync"]
    assert attach_values(["--memory", "-h"], flags) == ["--memory", "-h"]
    assert attach_values(["--workers", "-1", "--memory"], flags) == ["--workers", "-1", "--memory"]
    assert attach_values(["--memory=1GiB", "-5"], flags) == ["--memory=1GiB", "-5"]


def test_size_settings_are_the_size_fields() -> None:
    assert set(SIZE_SETTINGS) == {
        "capacity", "max_put_bytes", "max_inflight_put_bytes", "max_partial_bytes", "memory",
        "write_behind_bytes", "fleet_queue_bytes",
    }  # fmt: skip


def test_a_bad_size_in_the_file_names_the_file_and_its_key(tmp_path: Path) -> None:
    path = write(tmp_path, 'memory = "lots"\n')
    with pytest.raises(ValueError) as info:
        ServerConfig.load(path)
    assert str(info.value) == f"{path}: memory: invalid size 'lots' ({SIZE_FORMS})"
    with pytest.raises(ValueError) as info:
        ServerConfig.load(write(tmp_path, "write-behind-bytes = -1\n"))
    assert str(info.value).startswith(
        f"{path}: write-behind-bytes: invalid size -1: a size must not be negative"
    )


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3 << 29, "1.5 GiB"), (5 << 50, "5120.0 TiB")],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    # the free space held still: other tests writing beside this one changed it between
    # ServerConfig() and auto_capacity() (a flaky failure under the parallel pass)
    monkeypatch.setattr(config_module, "_free_space", lambda _path: 100 << 30)
    config = ServerConfig()
    assert config.listen == "127.0.0.1:50051"
    assert config.backend == "lmdb"
    assert config.capacity_auto and config.capacity == auto_capacity(config.data_dir)
    assert config.sync is False
    assert config.data_dir.is_absolute()
    assert config.data_dir.name == "kvstore"


def test_default_data_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert ServerConfig().data_dir == tmp_path / "kvstore"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    return path


def test_toml_with_dash_and_underscore_keys(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
listen = "0.0.0.0:6000"
data-dir = "~/kv"
backend = "disk"
capacity = "512MiB"
sync = true
max_put_bytes = "1GiB"
max-inflight-put-bytes = 3221225472
max-waiting-drop-selects = 4
grace_seconds = 2.5
log-level = "debug"
""",
    )
    config = ServerConfig.load(path)
    assert config.listen == "0.0.0.0:6000"
    assert config.data_dir == Path("~/kv").expanduser()
    assert config.backend == "disk"
    assert config.capacity == 512 << 20
    assert config.sync is True
    assert config.max_put_bytes == 1 << 30
    assert config.max_inflight_put_bytes == 3 << 30
    assert config.max_waiting_drop_selects == 4
    assert config.grace_seconds == 2.5
    assert config.log_level == "debug"
    assert config.workers == 64  # untouched default


def test_unknown_key_is_an_error_naming_it(tmp_path: Path) -> None:
    path = write(tmp_path, 'listen = "127.0.0.1:1"\ncapacty = "1GiB"\n')
    with pytest.raises(ValueError, match="unknown setting 'capacty'") as info:
        ServerConfig.load(path)
    assert str(path) in str(info.value)
    assert "capacity" in str(info.value), "the message lists the known settings"


def test_bad_toml_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(tomllib.TOMLDecodeError):
        ServerConfig.load(write(tmp_path, "capacity = \n"))
    assert issubclass(tomllib.TOMLDecodeError, ValueError)  # main() reports ValueErrors cleanly


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'backend = "disk"\ncapacity = "1GiB"\nworkers = 8\n')
    config = ServerConfig.load(path, {"capacity": "2GiB", "listen": "127.0.0.1:0", "sync": True})
    assert config.capacity == 2 << 30
    assert config.listen == "127.0.0.1:0"
    assert config.sync is True
    assert config.backend == "disk"  # from the file
    assert config.workers == 8
    assert ServerConfig.load(None, {"backend": "disk"}).backend == "disk"
    # nothing given: the defaults (capacity given here: its default is a share of the free
    # space at that moment, which other writers on the filesystem move between the two)
    assert ServerConfig.load(None, {"capacity": "4GiB"}) == ServerConfig(capacity="4GiB")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"backend": "rocksdb"}, "backend must be one of lmdb, disk, not 'rocksdb'"),
        ({"persist": "twice"}, "persist must be one of every, reused, not 'twice'"),
        ({"listen": "localhost"}, "listen must be HOST:PORT"),
        ({"listen": ":50051"}, "listen must be HOST:PORT"),
        ({"listen": "localhost:"}, "listen must be HOST:PORT"),
        ({"listen": "localhost:http"}, "listen must be HOST:PORT"),
        ({"listen": "localhost:65536"}, "listen must be HOST:PORT"),
        ({"capacity": 0}, "capacity must be positive"),
        ({"capacity": "lots"}, "invalid size 'lots'"),
        ({"max_put_bytes": "2 parsecs"}, "invalid size"),
        ({"workers": 0}, "workers must be at least 1"),
        ({"max_concurrent_rpcs": 0}, "max_concurrent_rpcs"),
        ({"max_waiting_drop_selects": 0}, "max_waiting_drop_selects"),
        ({"grace_seconds": -1.0}, "grace_seconds"),
        ({"log_level": "chatty"}, "log_level"),
        ({"metrics_port": 65536}, "metrics_port must be 0..65535"),
        ({"metrics_port": -1}, "metrics_port must be 0..65535"),
        ({"metrics_host": ""}, "metrics_host must not be empty"),
        ({"event_window": 0}, "event_window must be at least 1"),
        ({"max_watchers": 0}, "max_watchers must be at least 1"),
    ],
)
def test_validation_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ServerConfig.load(None, overrides)


@pytest.mark.parametrize("listen", ["[::1]:50051", "0.0.0.0:0", "unix-host:65535"])
def test_valid_listen_addresses(listen: str) -> None:
    assert ServerConfig(listen=listen).listen == listen


def test_to_toml_round_trips(tmp_path: Path) -> None:
    config = ServerConfig(
        listen="[::]:7000",
        data_dir=tmp_path / 'odd "dir" \\ with spaces',
        backend="disk",
        capacity=parse_size("3GiB"),
        sync=True,
        workers=3,
        grace_seconds=0.25,
        log_level="WARNING",
        metrics_port=9400,
        metrics_host="0.0.0.0",
        event_window=50,
        max_watchers=2,
        token_file=tmp_path / "tokens.toml",
        insecure=True,
    )
    text = config.to_toml()
    doc = tomllib.loads(text)
    assert set(doc) == {k for k, v in asdict(config).items() if v is not None}  # TOML has no null
    assert doc["data_dir"] == str(config.data_dir)
    assert doc["sync"] is True
    assert ServerConfig(**doc) == config
    # and the printed file loads back through --config
    assert ServerConfig.load(write(tmp_path, text)) == config


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('workers = "8"', "workers must be an integer, not '8'"),
        ("workers = 2.0", "workers must be an integer"),
        ("capacity = 1.5e9", "capacity must be a byte count or a size string"),
        ("capacity = true", "capacity must be a byte count"),
        ('sync = "yes"', "sync must be true or false, not 'yes'"),
        ("sync = 1", "sync must be true or false"),
        ("listen = 5", "listen must be a string"),
        ('grace-seconds = "2"', "grace-seconds must be a number"),
        ("data_dir = [1, 2]", "data_dir must be a string"),
    ],
)
def test_toml_values_of_the_wrong_type_are_value_errors(tmp_path: Path, line: str, message: str) -> None:
    # not TypeError/AttributeError tracebacks: main() reports ValueErrors as usage errors
    with pytest.raises(ValueError, match=message) as info:
        ServerConfig.load(write(tmp_path, line + "\n"))
    assert str(tmp_path) in str(info.value)


def test_toml_numbers_where_numbers_are_expected(tmp_path: Path) -> None:
    config = ServerConfig.load(write(tmp_path, "grace_seconds = 3\ncapacity = 1048576\nworkers = 2\n"))
    assert (config.grace_seconds, config.capacity, config.workers) == (3, 1 << 20, 2)


def test_service_settings_defaults_file_and_flags(tmp_path: Path) -> None:
    config = ServerConfig()
    assert (config.metrics_port, config.metrics_host) == (None, "127.0.0.1")
    assert (config.event_window, config.max_watchers) == (100_000, 16)
    path = write(tmp_path, 'metrics-port = 9400\nmetrics_host = "::"\nevent-window = 10\nmax_watchers = 3\n')
    config = ServerConfig.load(path, {"metrics_port": 0, "max_watchers": 5})
    assert (config.metrics_port, config.metrics_host, config.event_window, config.max_watchers) == (
        0,
        "::",
        10,
        5,
    )
    with pytest.raises(ValueError, match="metrics_port must be an integer"):
        ServerConfig.load(write(tmp_path, 'metrics_port = "9400"\n'))
    with pytest.raises(ValueError, match="event_window must be an integer"):
        ServerConfig.load(write(tmp_path, "event_window = true\n"))


def test_unset_metrics_port_prints_as_a_comment_and_round_trips(tmp_path: Path) -> None:
    config = ServerConfig(data_dir=tmp_path)
    text = config.to_toml()
    assert "# metrics_port is not set\n" in text
    assert "metrics_port" not in tomllib.loads(text)
    assert ServerConfig.load(write(tmp_path, text)) == config


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        ({"listen": "127.0.0.1:1"}, False),
        ({"listen": "[::1]:1"}, False),
        ({"listen": "localhost:1"}, False),
        ({"listen": "0.0.0.0:1"}, True),
        ({"listen": "[::]:1"}, True),
        ({"listen": "kvstore.internal:1"}, True),
        ({"listen": "0.0.0.0:1", "insecure": True}, False),
        ({"listen": "0.0.0.0:1", "token_file": "/etc/kv/tokens.toml"}, False),
        ({"listen": "0.0.0.0:1", "tls_cert": "c.pem", "tls_key": "k.pem"}, False),
    ],
)
def test_non_loopback_listen_needs_tokens_tls_or_insecure(overrides: dict, refused: bool) -> None:
    problem = ServerConfig(**overrides).exposure_problem()
    assert (problem is not None) == refused
    if refused:
        assert "--insecure" in problem


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tls_cert": "c.pem"}, "go together"),
        ({"tls_key": "k.pem"}, "go together"),
        ({"tls_client_ca": "ca.pem"}, "needs tls_cert"),
    ],
)
def test_tls_settings_are_checked(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(**overrides)


def test_automatic_sizes_follow_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--capacity and --memory by default: shares of the room there is, within bounds."""
    import os

    import kvstore_server.config

    assert auto_capacity(tmp_path / "not-yet" / "made") > 0  # the nearest existing parent counts
    # the shares of a free space held still (tests beside this one write to the disk)
    for free, capacity in ((300 << 30, 75 << 30), (10 << 30, 5 << 30), (8 << 40, 1 << 40), (0, 1 << 20)):
        monkeypatch.setattr(kvstore_server.config, "_free_space", lambda _path, free=free: free)
        assert (
            ServerConfig(capacity="auto", data_dir=tmp_path).capacity == auto_capacity(tmp_path) == capacity
        )
    monkeypatch.undo()
    assert ServerConfig(capacity="2GiB", data_dir=tmp_path).capacity_auto is False
    memory = auto_memory(tmp_path)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 1 << 30 <= memory <= max(1 << 30, min(64 << 30, ram // 10))
    assert ServerConfig(memory_dir=tmp_path).memory_bytes() == memory
    assert ServerConfig(memory=0).memory_bytes() == 0
