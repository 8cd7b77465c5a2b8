"""A throwaway PostgreSQL server for the turn store's tests, from the system's own packages.

`scripts/setup.sh --dev` installs Debian's `postgresql`; its server binaries are not on PATH, so
they are found under /usr/lib/postgresql/<version>/bin. PostgreSQL refuses to run as root (CI runs
as root): then the data directory belongs to the `postgres` user and every server command runs
as that user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg

from tests.voiceagent.server_proc import free_port

START_TIMEOUT_S = 60


def pg_bin() -> Path | None:
    """The directory holding initdb and pg_ctl; None when PostgreSQL is not installed."""
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """One server in a temporary directory, on a free loopback port, trusting local users."""

    def __init__(self, bin_dir: Path):
        self.bin = bin_dir
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="voiceagent-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "log"
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")  # created by Debian's package
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return self.url_of("postgres")

    def url_of(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self._as, str(self.bin / tool), *args], capture_output=True,
                              text=True, timeout=START_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip()}\n"
                               f"{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def start(self) -> None:
        """Start the server, creating its cluster the first time."""
        if not self.data.exists():
            self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres",
                      "--no-sync")
        # fsync off: a test server's data need not survive a power cut, and 2 cores are slow.
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log),
                  "-w", "-t", str(START_TIMEOUT_S), "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def create_database(self, name: str) -> str:
        """A fresh, empty database; its URL."""
        with psycopg.connect(self.url, autocommit=True) as db:
            db.execute(f'CREATE DATABASE "{name}"')
        return self.url_of(name)

    def remove(self) -> None:
        """Stop the server if it runs, and delete its directory."""
        try:
            if self.running:
                self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
