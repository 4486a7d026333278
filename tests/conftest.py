"""Session fixtures: a per-session model cache and the tiny random policy (float32, exact-ish).

Heavy imports stay inside the fixtures so that infra tests that need no model do not pay for torch/transformers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the HF hub from tests
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if TYPE_CHECKING:
    from aepo_core.config import ModelConfig
    from infra.engines.hf import HFEngine


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache directory per test session: conversions happen here, never in the user's ~/.cache."""
    return tmp_path_factory.mktemp("aepo-models")


@pytest.fixture(scope="session")
def tiny_cfg(model_cache: Path) -> ModelConfig:
    from aepo_core.config import ModelConfig

    return ModelConfig(name="tiny-random", dtype="float32", cache_dir=str(model_cache), init_seed=0)


@pytest.fixture(scope="session")
def tiny_policy(tiny_cfg: ModelConfig) -> tuple[Any, Any]:
    """(model, tokenizer) of tiny-random; shared: tests that change weights must load their own."""
    from infra.models import load_policy

    return load_policy(tiny_cfg)


@pytest.fixture(scope="session")
def tiny_engine(tiny_policy: tuple[Any, Any]) -> HFEngine:
    from infra.engines.hf import HFEngine

    model, tokenizer = tiny_policy
    return HFEngine(model, tokenizer, seed=0)


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Any:
    """One Prefect test harness (ephemeral API on SQLite) for the whole session; ~10 s to start."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["AEPO_MODEL_CACHE"] = str(model_cache)
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def moto_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real S3 API on 127.0.0.1 (moto's threaded server, fresh and empty), with dummy credentials; its URL."""
    from moto.server import ThreadedMotoServer
    from server_stack import AWS

    for k, v in AWS.items():  # dummy credentials, as the server stack's processes get
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    import urllib.request

    # moto keeps its buckets in this process's memory, across servers: start each test from an empty S3
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=30).close()
    yield url
    server.stop()


@pytest.fixture
def s3_bucket(moto_s3: str) -> str:
    """A bucket ``aepo`` on :func:`moto_s3`; its URI ``s3://aepo``."""
    import boto3

    boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1").create_bucket(Bucket="aepo")
    return "s3://aepo"
