"""A live server for the SDK tests: `python -m skyrl_trainer.server` started as a user would,
as a subprocess on a free loopback port, serving the tiny test model (float32, torch engine)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")

API_KEY = "tml-conformance-tests"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    """One server process; `stop()` and `start()` again keep its storage and database."""

    model_dir: Path
    storage_dir: Path
    extra_args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.storage_dir / "server.log"

    def start(self, timeout: float = 180.0) -> LiveServer:
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "skyrl_trainer.server",
            "--base-model", str(self.model_dir), "--port", str(self.port),
            "--storage-dir", str(self.storage_dir),
            "--sampling-engine", "torch", "--dtype", "float32", "--device", "cpu",
            "--log-level", "warning", *self.extra_args,
        ]  # fmt: skip
        log = self.log_path.open("a")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited at start-up:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.base_url}/api/v1/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not start in {timeout} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def service_client(self, api_key: str = API_KEY):
        import tinker

        return tinker.ServiceClient(base_url=self.base_url, api_key=api_key)


@pytest.fixture(scope="session")
def live_server(tiny_model_dir, tmp_path_factory):
    """The shared server for conformance tests (64-datum chunks, so the SDK chunks requests)."""
    server = LiveServer(
        tiny_model_dir,
        tmp_path_factory.mktemp("server"),
        ["--max-batch-datums", "64", "--max-num-samples", "64", "--max-tokens", "256"],
    ).start()
    yield server
    server.stop()
