"""`python -m skyrl_trainer.server`: serve the backend over the Tinker HTTP protocol.

python -m skyrl_trainer.server --base-model SmolLM2-135M-Instruct --port 8000
TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python my_tinker_program.py
"""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from skyrl_trainer.allocator import tune_malloc
from skyrl_trainer.backend.config import BackendConfig, SamplingConfig, TrainingConfig
from skyrl_trainer.server.app import create_app
from skyrl_trainer.server.config import ServerConfig, ServerLimits


def parse_args(argv: list[str] | None = None) -> tuple[ServerConfig, str]:
    defaults, limits = ServerConfig(), ServerLimits()
    p = argparse.ArgumentParser(prog="python -m skyrl_trainer.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--base-model",
        action="append",
        dest="base_models",
        help="a model to serve (repeatable): a packaged name, hub id or Hugging Face folder, "
        "optionally as NAME=SOURCE; clients use its name (a folder's is its last component); "
        "no other model can be used",
    )
    p.add_argument("--host", default=defaults.host, help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        default=[],
        help="accepted key, 'tml-...' (repeatable; also SKYRL_SERVER_API_KEYS, "
        "comma-separated). None: any tml- key, loopback only",
    )
    p.add_argument("--allow-unauthenticated-remote", action="store_true")
    p.add_argument("--storage-dir", help="where checkpoints live")
    p.add_argument("--database", help="SQLite file (default <storage-dir>/server.sqlite3)")
    p.add_argument("--sampling-engine", default="auto", choices=["auto", "vllm", "torch"])
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=SamplingConfig.max_batch_size,
        help="most sequences an engine decodes at once",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-request-bytes", type=int, default=limits.max_request_bytes)
    p.add_argument("--max-batch-datums", type=int, default=limits.max_batch_datums)
    p.add_argument("--max-num-samples", type=int, default=limits.max_num_samples)
    p.add_argument("--max-tokens", type=int, default=limits.max_tokens)
    p.add_argument("--max-pending-futures", type=int, default=limits.max_pending_futures)
    p.add_argument(
        "--housekeeping-interval",
        type=float,
        default=defaults.housekeeping_interval_s,
        help="seconds between removals of expired checkpoints and old results, and checks "
        "for silent sessions",
    )
    p.add_argument(
        "--session-expiry",
        type=float,
        default=defaults.session_expiry_s,
        help="seconds without a heartbeat after which a session's sampling requests are "
        "cancelled (the SDK beats every 10 s)",
    )
    p.add_argument(
        "--sequencer-gap-timeout",
        type=float,
        default=defaults.sequencer_gap_timeout_s,
        help="seconds a training request waits for a missing lower seq_id before it runs",
    )
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    keys = list(args.api_keys)
    keys += [k for k in os.environ.get("SKYRL_SERVER_API_KEYS", "").split(",") if k.strip()]
    backend = BackendConfig(
        storage_dir=args.storage_dir,
        training=TrainingConfig(dtype=args.dtype, device=args.device),
        sampling=SamplingConfig(
            engine=args.sampling_engine,
            dtype=args.dtype,
            device=args.device,
            max_num_samples=args.max_num_samples,
            max_tokens=args.max_tokens,
            max_batch_size=args.max_batch_size,
        ),
    )
    if args.base_models:
        backend.base_models = args.base_models
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_keys=[k.strip() for k in keys],
        allow_unauthenticated_remote=args.allow_unauthenticated_remote,
        housekeeping_interval_s=args.housekeeping_interval,
        session_expiry_s=args.session_expiry,
        sequencer_gap_timeout_s=args.sequencer_gap_timeout,
        database=args.database,
        limits=ServerLimits(
            max_request_bytes=args.max_request_bytes,
            max_batch_datums=args.max_batch_datums,
            max_num_samples=args.max_num_samples,
            max_tokens=args.max_tokens,
            max_pending_futures=args.max_pending_futures,
        ),
        backend=backend,
    ), args.log_level


def main(argv: list[str] | None = None) -> None:
    tune_malloc()  # before any thread starts: freed tensors go back to the OS
    config, log_level = parse_args(argv)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = create_app(config)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level)


if __name__ == "__main__":
    main()
