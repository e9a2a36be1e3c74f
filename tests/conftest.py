"""Test settings: Triton kernels run under the interpreter on the CPU; nothing touches a hub."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Speed tables: a CPU without a shipped table would calibrate topk_ip's path and gemv's rows at
# its first default call in every test process (seconds each); tests of the calibration set it.
os.environ.setdefault("RAGFAST_CALIBRATE", "0")

import pytest


@pytest.fixture(scope="session")
def minilm_encoder():
    """The bundled MiniLM encoder (torch), loaded once for every test that only reads from it."""
    from ragfast.encoders.encoder import Encoder

    return Encoder("minilm", batch_size=16)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): tiny
    matmuls on a shared, loaded 2-core box spin two OpenMP threads on each other (a 3x64 @ 64x128
    linear measured 20 ms with 2 threads vs 0.1 ms with 1)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cluster():
    """A local 2-CPU Ray cluster for one test module (skipped without Ray)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def random_lm():
    """``random_lm(config_cls, out, seed, spread=0.3, **config)``: a random-weight causal LM with the
    tiny Qwen2's tokenizer and chat template written to ``out``, its matrices drawn wider than the
    init's (N(0, spread)) so greedy argmaxes are clear and free of near-ties."""
    def write(config_cls, out, seed, spread=0.3, **config):
        import shutil

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ragfast.models.tiny import tiny_path

        src = tiny_path("qwen2")
        tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
        cfg = config_cls(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **config)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.normal_(0, spread)
        model.save_pretrained(out)
        tok.save_pretrained(out)
        shutil.copy(src / "chat_template.jinja", out / "chat_template.jinja")
        return out

    return write


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, random_lm):
    """A random-weight two-layer Qwen2 (4 query / 2 key-value heads, head dim 16) for generator tests."""
    from transformers import Qwen2Config

    return random_lm(Qwen2Config, tmp_path_factory.mktemp("qwen"), 5, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=8192)


# Every ISA level the C++ kernels know, in order (csrc/isa_levels.h).
ISA_LEVELS = ("generic", "avx2", "avx512", "avx512vnni", "avx512bf16", "amx")


@pytest.fixture(params=ISA_LEVELS)
def isa_level(request):
    """Run a test at each ISA level this build carries and this CPU runs, the others skipped visibly
    with the reason; the level in use before is restored after."""
    try:
        from ragfast import _C
    except ImportError:
        pytest.skip("ragfast._C not built")
    info = _C.isa_info()
    level = request.param
    if level not in info["compiled"]:
        pytest.skip(f"ISA level {level} is not compiled into this build")
    if level not in info["supported"]:
        pytest.skip(f"ISA level {level} cannot run on this CPU: it lacks {', '.join(info['missing'].get(level, []))}")
    before = info["chosen"] or "auto"
    assert _C.set_isa(level) == level
    yield level
    _C.set_isa(before)
