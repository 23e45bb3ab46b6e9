"""Shared fixtures of the Kimi K3 tests: the tiny release-format config and a written checkpoint."""

from typing import NamedTuple

import pytest
import torch

from .release_format import tiny_k3_config, write_k3_checkpoint


class K3Checkpoint(NamedTuple):
    folder: str
    config: dict  # the dict passed to the writer (config.json on disk differs only in "dtype")
    tensors: dict  # logical fp32 tensors by official name, as write_k3_checkpoint returns them


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """The fp64 reference runs thousands of tiny ops; thread hand-offs cost more than they save. One thread also
    makes the reference bitwise reproducible (the dead-weight tests compare with torch.equal). Module scope, so
    module-scoped fixtures computing logits run under it too."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def k3_config() -> dict:
    return tiny_k3_config()


@pytest.fixture(scope="session")
def k3_checkpoint(tmp_path_factory, k3_config) -> K3Checkpoint:
    """The default tiny checkpoint: bf16, MXFP4 experts, 3 shards, seed 0."""
    folder = tmp_path_factory.mktemp("k3_tiny_mxfp4")
    tensors = write_k3_checkpoint(folder, k3_config, seed=0, mxfp4=True, shards=3, dtype="bfloat16")
    return K3Checkpoint(str(folder), k3_config, tensors)
