"""Start our Tinker-compatible server as a user would (`python -m skyrl_trainer.server`), for the
benchmarks that measure through it; wait until it answers its health check."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx


def start_server(model: str, port: int, storage: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    command = [
        sys.executable, "-m", "skyrl_trainer.server", "--base-model", model, "--port", str(port),
        "--storage-dir", storage, "--sampling-engine", "torch", "--log-level", "warning", *extra,
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("server did not start")
