"""The embedded Redis: reached through its Unix socket where the path fits, else over TCP."""

from __future__ import annotations

from pathlib import Path

import redis

from slogate.local_redis import LocalRedis


def test_the_url_is_the_unix_socket_and_tcp_stays_open(tmp_path: Path) -> None:
    server = LocalRedis(tmp_path / "r").start()
    try:
        assert server.url.startswith("unix://") and server.socket_path.is_socket()
        assert oct(server.socket_path.stat().st_mode & 0o777) == "0o700"
        for url in (server.url, server.tcp_url):
            client = redis.Redis.from_url(url)
            client.set("k", url)
            assert client.get("k") == url.encode()
            client.close()
    finally:
        server.stop()


def test_a_socket_path_too_long_for_the_os_falls_back_to_tcp(tmp_path: Path) -> None:
    server = LocalRedis(tmp_path / ("d" * 120)).start()
    try:
        assert server.url == server.tcp_url
        assert not server.socket_path.exists()
        assert redis.Redis.from_url(server.url).ping()
    finally:
        server.stop()
