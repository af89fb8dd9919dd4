"""The stack's Redis password: read from env SLUICE_REDIS_PASSWORD_FILE (wins) or SLUICE_REDIS_PASSWORD, never
from argv; a private redis-server started with one requires it, has it in no process's argv, and (with a
data dir) comes back from kill -9 with its data and the same password."""

from __future__ import annotations

import os
import stat

import pytest
import redis

from services.runtime.processes import free_port, start_redis
from services.runtime.redis_clients import async_redis, sync_redis
from services.runtime.redis_password import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    RedisPasswordError,
    redis_conf_line,
    redis_password_env,
    resolve_redis_password,
)


def test_the_file_wins_over_the_env_and_both_empty_is_no_password(tmp_path):
    path = tmp_path / "pw"
    path.write_text("from-file\n")
    assert resolve_redis_password({PASSWORD_FILE_ENV: str(path), PASSWORD_ENV: "from-env"}) == "from-file"
    assert resolve_redis_password({PASSWORD_FILE_ENV: "", PASSWORD_ENV: " from-env "}) == "from-env"
    assert resolve_redis_password({}) == ""


def test_a_missing_or_empty_password_file_is_an_error_naming_the_file(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(RedisPasswordError, match=f"{PASSWORD_FILE_ENV} {empty}: the file is empty"):
        resolve_redis_password({PASSWORD_FILE_ENV: str(empty)})
    with pytest.raises(RedisPasswordError, match="cannot read it"):
        resolve_redis_password({PASSWORD_FILE_ENV: str(tmp_path / "absent")})


def test_a_child_gets_exactly_the_launchers_password_whatever_its_own_env_says():
    env = {PASSWORD_FILE_ENV: "/elsewhere", PASSWORD_ENV: "old", **redis_password_env("new")}
    assert resolve_redis_password(env) == "new"


@pytest.mark.parametrize("bad", ["", "two words", 'quo"te', "new\nline", "back\\slash"])
def test_a_password_a_config_line_cannot_hold_is_refused(bad):
    with pytest.raises(RedisPasswordError, match="Redis password"):
        redis_conf_line(bad)


def _argv(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().replace("\0", " ")


def test_a_private_redis_requires_its_password_which_is_in_no_argv(tmp_path, monkeypatch):
    password = "s3cret-" + "ab" * 16
    proc, url = start_redis(log_dir=str(tmp_path), password=password)
    try:
        assert password not in _argv(proc.proc.pid) and password not in url
        conf = [a for a in proc.argv if a.endswith("redis.conf")][0]
        assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600
        with redis.Redis.from_url(url) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.set("k", "v")
        with sync_redis(url, password=password) as r:
            r.set("k", "v")
        monkeypatch.setenv(PASSWORD_ENV, password)  # what every service gets from its launcher
        with sync_redis(url) as r:
            assert r.get("k") == "v"
        monkeypatch.setenv(PASSWORD_ENV, "wrong")
        with sync_redis(url) as r, pytest.raises(redis.AuthenticationError):
            r.get("k")
    finally:
        proc.stop()


async def test_async_clients_take_the_password_from_the_env(tmp_path, monkeypatch):
    proc, url = start_redis(log_dir=str(tmp_path), password="pw-async")
    try:
        monkeypatch.setenv(PASSWORD_ENV, "pw-async")
        client = async_redis(url)
        try:
            await client.set("a", "1")
            assert await client.get("a") == "1"
        finally:
            await client.aclose()
    finally:
        proc.stop()


def test_a_killed_redis_with_a_data_dir_comes_back_with_its_data_and_password(tmp_path):
    port, data = free_port(), str(tmp_path / "redis")
    proc, url = start_redis(port, log_dir=str(tmp_path), data_dir=data, password="pw-aof")
    try:
        assert "everysec" in proc.argv  # the default: fsync every second
        with sync_redis(url, password="pw-aof") as r:
            for i in range(100):
                r.rpush("log", i)
        proc.kill()
        proc, _ = start_redis(port, log_dir=str(tmp_path), data_dir=data, password="pw-aof")
        with sync_redis(url, password="pw-aof") as r:
            assert r.lrange("log", 0, -1) == [str(i) for i in range(100)]
        with redis.Redis.from_url(url) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.get("log")
    finally:
        proc.stop()
