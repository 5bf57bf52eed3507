"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The embedded SmolLM2 tokenizer (converted once, then read from the cache)."""
    from worldcup_core.models import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """Human text from ../shared/data; missing data is a failure, never a skip."""
    env = os.environ.get("WORLDCUP_DATA_DIR")
    path = (Path(env) if env else Path(__file__).parents[2] / "shared" / "data").resolve()
    needed = ["cnn_dailymail_test.jsonl", "eli5_longform_qa.jsonl"]
    missing = [name for name in needed if not (path / name).is_file()]
    if missing:
        pytest.fail(
            f"human text not found: {missing} missing in {path}. "
            "Set WORLDCUP_DATA_DIR to the folder holding the evaluation data.",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Async tests (``@pytest.mark.anyio``) run on asyncio only; trio is not a target."""
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Llama over the real tokenizer, saved as an HF directory."""
    from worldcup_core.models import load_tokenizer, tiny_random_model

    path = tmp_path_factory.mktemp("tiny-model")
    lm = tiny_random_model(load_tokenizer())
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def redis_cluster() -> Any:
    """A real six-node Redis Cluster (tests/redis_cluster.py), for `-m cluster` tests."""
    from redis_cluster import RedisClusterProcs

    cluster = RedisClusterProcs().start()
    try:
        yield cluster
    finally:
        cluster.stop()
