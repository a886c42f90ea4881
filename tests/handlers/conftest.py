"""Shared fixtures for handler tests that need a real (synthetic, local) transformers model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handlers.synthetic_model import build_model


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-initialised small Llama with a trained tokenizer and chat template (built once)."""
    torch.set_num_threads(1)
    return build_model(tmp_path_factory.mktemp("llama_small"), arch="llama", size="small", seed=0)
