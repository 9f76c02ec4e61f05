"""Fixtures: a tiny tokenizer with a chat template and tiny random HF models, all built offline."""

from __future__ import annotations

import os

import pytest

# The builders live in rlpipe (the e2e bench builds the same tiny model); re-exported for the tests.
from rlpipe.tiny_model import CHATML, SPECIALS, build_tiny_model, build_tokenizer

__all__ = ["CHATML", "SPECIALS", "build_tiny_model", "build_tokenizer"]


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(autouse=True, scope="session")
def _offline():
    # Tests never reach a model hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe")
