"""Test settings: Triton kernels run under the interpreter on the CPU; nothing touches a hub."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session")
def minilm_encoder():
    """The bundled MiniLM encoder (torch), loaded once for every test that only reads from it."""
    from ragfast.encoders.encoder import Encoder

    return Encoder("minilm", batch_size=16)


@pytest.fixture(scope="module")
def cluster():
    """A local 2-CPU Ray cluster for one test module (skipped without Ray)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()
