"""The CUDA runtime end to end on a GPU (skipped without one; scripts/gpu_check.sh runs it): every mode and expert
policy on the tiny DeepSeek-V2 and MiniMax-M2 fixtures gives the CPU-only path's greedy tokens, decode does no
weight copies in all-device mode, decode CUDA graphs give the eager logits bit for bit, and copies slowed on the
copy stream itself (a spin kernel before each one) never race the kernels that read the slots; the final hidden
states embeddings pool come back to the host as the CPU path computes them.
"""

from __future__ import annotations

import pytest
import torch

from pocketmoe import native
from pocketmoe.engine.runner import ModelRunner, RunnerConfig
from pocketmoe.engine.step import SeqChunk, Step
from pocketmoe.experts.cost import Rates
from pocketmoe.gguf import open_bundle
from pocketmoe.ops import cuda
from pocketmoe.placement.run import RunPlacement
from pocketmoe.testing.synth import write_fixture

pytestmark = pytest.mark.skipif(not cuda.available(), reason=f"needs a CUDA GPU and CuPy ({cuda.unavailable_reason()})")

PROMPT = [(7 * i + 3) % 300 + 5 for i in range(40)]
GEN = 6
MIXED = Rates(copy_gbps=4.0, cpu_gbps=6.0, cpu_token_gbps=6.0, device_gbps=20.0, device_token_gbps=200.0)


@pytest.fixture(scope="module", params=["deepseek2", "minimax-m2"])
def bundle(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("cuda-runtime") / f"{request.param}.gguf"
    write_fixture(request.param, "tiny", "Q4_K_M", path, seed=3)
    with open_bundle(path) as b:
        yield b


def cpu_tokens(bundle) -> list[int]:  # noqa: ANN001
    backend = "native" if native.available() else "reference"
    return ModelRunner(bundle, RunnerConfig(n_ctx=128, backend=backend)).generate_greedy(PROMPT, GEN)


def gpu_runner(bundle, mode: str, policy: str = "auto", slots: int | None = None, delay=None) -> ModelRunner:  # noqa: ANN001
    rp = RunPlacement(device="cuda", mode=mode, expert_policy=policy, expert_cache_slots=slots)
    return ModelRunner(bundle, RunnerConfig(n_ctx=128, backend="auto", placement=rp, expert_rates=MIXED,
                                            copy_delay=delay))


def test_all_device_runs_on_cuda_and_decode_copies_no_weights(bundle) -> None:
    r = gpu_runner(bundle, "all-device")
    assert r.ops.name == "cuda" and r.cache.data.is_cuda
    assert r.generate_greedy(PROMPT, GEN) == cpu_tokens(bundle)
    # every weight is on the device after the first step: a further decode allocates no weight-sized buffer
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    r.decode(5, len(PROMPT))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 << 20


@pytest.mark.parametrize("policy", ["auto", "cache", "stage", "cpu"])
@pytest.mark.parametrize("slots", [None, 1], ids=["plan-slots", "one-slot"])
def test_heterogeneous_gives_the_cpu_tokens(bundle, policy: str, slots: int | None) -> None:
    r = gpu_runner(bundle, "heterogeneous", policy, slots)
    assert r.generate_greedy(PROMPT, GEN) == cpu_tokens(bundle)
    st = r.experts.stats
    assert st.hits + st.misses > 0
    if policy == "cpu":
        assert st.staged == 0 and st.hits == 0
    if policy in ("cache", "stage"):
        assert st.cpu_experts == 0 and st.staged == st.misses


def test_decode_graphs_match_eager_bitwise(bundle) -> None:
    eager = gpu_runner(bundle, "all-device")
    graphed = gpu_runner(bundle, "all-device")
    assert graphed.ops.enable_graphs()
    a, b = eager.forward(PROMPT, 0), graphed.forward(PROMPT, 0)
    assert torch.equal(a, b)
    pos, tok = len(PROMPT), int(a[-1].argmax())
    for step in range(4):  # eager warm-up, capture + checked replay, then plain replays
        la, lb = eager.decode(tok, pos), graphed.decode(tok, pos)
        assert torch.equal(la, lb), f"decode step {step}"
        tok, pos = int(la.argmax()), pos + 1
    assert graphed.ops.graphs.failures == {}, graphed.ops.graphs.failures
    assert any(v is not False for v in graphed.ops.graphs.graphs.values())


def test_copies_slowed_on_the_copy_stream_never_race(bundle) -> None:
    """A ~1 ms spin kernel on the copy stream before every copy: a kernel that did not wait for its slot's copy
    would read the previous expert, a copy that did not wait for the slot's readers would change it under them."""
    def slow(slot: int, expert: int) -> None:
        torch.cuda._sleep(2_000_000)  # enqueued on the copy stream (the engine calls this inside it)

    want = cpu_tokens(bundle)
    r = gpu_runner(bundle, "heterogeneous", "stage", slots=2, delay=slow)
    assert r.generate_greedy(PROMPT, GEN) == want
    assert r.experts.stats.staged > 0


def test_hidden_states_come_back_to_the_host(bundle) -> None:
    """The final hidden states of every prompt row (what embeddings pool) from an all-device step: on the host, the
    CPU path's up to the activations' quantization noise, and the same in the decode-graph runner (a step asking for
    them runs eagerly)."""
    def step() -> Step:
        return Step((SeqChunk("e", PROMPT, 0, "last", "all"),))

    backend = "native" if native.available() else "reference"
    _, want = ModelRunner(bundle, RunnerConfig(n_ctx=128, backend=backend)).run_step(step())
    gpu = gpu_runner(bundle, "all-device")
    assert gpu.ops.enable_graphs()
    _, got = gpu.run_step(step())
    assert got is not None and got.device.type == "cpu" and got.shape == want.shape
    assert float(torch.nn.functional.cosine_similarity(got, want, dim=-1).min()) > 0.9999
    _, again = gpu.run_step(step())
    assert torch.equal(got, again)
