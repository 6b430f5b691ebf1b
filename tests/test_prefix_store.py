"""The prefix cache's pages in files: a new pool (a restarted server) attaches the pages an earlier one computed,
bitwise; files of another model, backend or KV layout, or damaged ones, are misses; the files stay in their budget;
and end to end, a restarted server answers a repeated prompt from the files with the same tokens and logprobs."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from pocketmoe.engine.kv_cache import PagedKVCache
from pocketmoe.engine.prefix_store import PrefixStore, model_key
from pocketmoe.errors import PocketMoEError
from pocketmoe.gguf import open_bundle
from pocketmoe.testing.live_server import LiveServer
from pocketmoe.testing.synth import write_fixture

L, W, PAGE = 3, 8, 16


def pool(tmp: Path, pages: int = 16, key: bytes = b"k" * 16, dtype: torch.dtype = torch.float32,
         budget: int = 1 << 30) -> PagedKVCache:
    cache = PagedKVCache(L, W, pages, pages * PAGE, dtype)
    cache.store = PrefixStore(tmp, key, (L, PAGE, W), dtype, budget)
    return cache


def compute(cache: PagedKVCache, seq: object, tokens: list[int], seed: int = 0) -> torch.Tensor:
    """Reserve and 'compute' a sequence: random rows written where its positions live, then committed."""
    cache.reserve(seq, len(tokens))
    rows = torch.from_numpy(cache.rows(seq, 0, len(tokens))).long()
    values = torch.randn(L, len(tokens), W, generator=torch.Generator().manual_seed(seed)).to(cache.dtype)
    for layer in range(L):
        cache.layer_rows(layer)[rows] = values[layer]
    cache.commit(seq, tokens, len(tokens))
    return values


def rows_of(cache: PagedKVCache, seq: object, n: int) -> torch.Tensor:
    rows = torch.from_numpy(cache.rows(seq, 0, n)).long()
    return torch.stack([cache.layer_rows(layer)[rows] for layer in range(L)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_new_pool_attaches_the_pages_from_files_bitwise(tmp_path: Path, dtype: torch.dtype) -> None:
    tokens = list(range(100, 100 + 5 * PAGE + 3))
    first = pool(tmp_path, dtype=dtype)
    values = compute(first, "a", tokens)
    assert len(first.store) == 5 and first.store.saved == 5
    again = pool(tmp_path, dtype=dtype)  # a restart: an empty pool over the same directory
    assert again.attach("b", tokens[:-1]) == 5 * PAGE and again.store.loaded == 5
    assert torch.equal(rows_of(again, "b", 5 * PAGE).view(torch.uint8), values[:, :5 * PAGE].view(torch.uint8))
    # a prompt that shares three pages, then differs: three from the pool (no file read), then a miss
    other = tokens[:3 * PAGE] + [7] * (2 * PAGE)
    assert again.attach("c", other) == 3 * PAGE and again.store.loaded == 5
    # another key (model, backend or KV layout) sees none of them
    assert pool(tmp_path, key=b"x" * 16, dtype=dtype).attach("d", tokens) == 0


def test_damaged_files_are_misses_and_go(tmp_path: Path) -> None:
    tokens = list(range(3 * PAGE + 1))
    first = pool(tmp_path)
    compute(first, "a", tokens)
    files = sorted(first.store.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime)
    assert len(files) == 3
    second_page = PagedKVCache._digest(PagedKVCache._digest(b"", tokens[:PAGE]), tokens[PAGE:2 * PAGE]).hex()
    damaged = first.store.dir / f"{second_page}.kv"
    damaged.write_bytes(damaged.read_bytes()[:-5])  # cut short
    again = pool(tmp_path)
    assert again.attach("b", tokens) == PAGE  # the first page, then the damaged one is a miss
    assert not damaged.exists() and len(again.store) == 2
    (again.store.dir / f"{second_page}.kv").write_bytes(b"not a page")
    assert pool(tmp_path).attach("c", tokens) == PAGE


def test_files_stay_within_their_budget_oldest_first(tmp_path: Path) -> None:
    page_file = len(b"PMKVPAGE1\0") + 32 + L * PAGE * W * 4
    cache = pool(tmp_path, pages=32, budget=4 * page_file)
    compute(cache, "a", list(range(3 * PAGE)))
    compute(cache, "b", list(range(1000, 1000 + 3 * PAGE)), seed=1)
    assert cache.store.bytes <= 4 * page_file and len(cache.store) == 4
    fresh = pool(tmp_path, budget=4 * page_file)
    assert fresh.attach("c", list(range(3 * PAGE))) == 0  # its first page went first: the chain is broken
    assert fresh.attach("d", list(range(1000, 1000 + 3 * PAGE))) == 3 * PAGE


def test_reading_files_into_a_full_pool_never_takes_a_held_page(tmp_path: Path) -> None:
    tokens = list(range(6 * PAGE + 1))
    compute(pool(tmp_path, pages=8), "a", tokens)
    small = pool(tmp_path, pages=4)
    compute(small, "busy", list(range(500, 500 + 2 * PAGE)), seed=3)  # two pages held by a running sequence
    held = rows_of(small, "busy", 2 * PAGE).clone()
    assert small.attach("b", tokens) == 2 * PAGE  # the two free pages, then no page is left
    assert torch.equal(rows_of(small, "busy", 2 * PAGE), held)
    small.free("b")
    small.free("busy")  # its pages now only indexed: evictable, so a longer run fits
    assert small.attach("c", tokens) == 4 * PAGE


def test_model_key_tells_models_and_layouts_apart(tmp_path: Path) -> None:
    a = open_bundle(write_fixture("deepseek2", "tiny", "Q8_0", tmp_path / "a.gguf", seed=1)[0])
    b = open_bundle(write_fixture("deepseek2", "tiny", "Q8_0", tmp_path / "b.gguf", seed=2)[0])
    layout = (4, PAGE, 320, torch.float16)
    assert model_key(a, "NativeOps", layout) == model_key(a, "NativeOps", layout)
    assert len({model_key(a, "NativeOps", layout), model_key(b, "NativeOps", layout),
                model_key(a, "ReferenceOps", layout), model_key(a, "NativeOps", (*layout[:3], torch.float32))}) == 4


def test_a_restarted_server_answers_from_the_files(tmp_path: Path) -> None:
    model = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "m.gguf", seed=11)[0]
    store = tmp_path / "store"
    args = ["--model", str(model), "--served-model-name", "tiny", "--max-model-len", "512", "--threads", "1",
            "--prefix-cache-dir", str(store)]
    prompt = "the quick brown fox jumps over the lazy dog " * 12
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2}

    def ask(srv: LiveServer) -> tuple:
        r = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).completions.create(**body)
        lp = r.choices[0].logprobs
        return r.choices[0].text, lp.token_logprobs, lp.top_logprobs, r.usage

    with LiveServer(args) as srv:
        text, lps, tops, usage = ask(srv)
        assert usage.prompt_tokens_details is None or not usage.prompt_tokens_details.cached_tokens
    n_full = (usage.prompt_tokens - 1) // PAGE * PAGE
    assert n_full > 0 and len(list(store.glob("*/*.kv"))) >= n_full // PAGE
    with LiveServer(args) as srv:
        assert f"{len(list(store.glob('*/*.kv')))} pages in" in "".join(srv.stdout)
        again = ask(srv)
        assert again[:3] == (text, lps, tops)  # bitwise the same logprobs
        assert again[3].prompt_tokens_details.cached_tokens == n_full
        metrics = httpx.get(srv.url + "/metrics").text
        assert f"pocketmoe_prefix_cache_disk_hits_total {float(n_full)}" in metrics
    with LiveServer([*args, "--kv-dtype", "f16"]) as srv:  # another KV layout (f32 the default): none of those
        usage = ask(srv)[3]
        assert usage.prompt_tokens_details is None or not usage.prompt_tokens_details.cached_tokens
        assert "pocketmoe_prefix_cache_disk_hits_total 0.0" in httpx.get(srv.url + "/metrics").text


def test_without_prefix_caching_the_directory_is_one_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    model = write_fixture("deepseek2", "tiny", "Q8_0", tmp_path / "m.gguf")[0]
    r = subprocess.run([sys.executable, "-m", "pocketmoe.serve", "--model", str(model), "--port", "0", "--threads", "1",
                        "--backend", "reference", "--prefix-cache-dir", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--enable-prefix-caching" in r.stderr.splitlines()[-1]


def test_only_its_own_files_are_counted_or_removed(tmp_path: Path) -> None:
    """A directory given by mistake (a home directory) loses nothing: files not named as pages are never counted
    against the budget nor trimmed."""
    (tmp_path / "notes").mkdir()
    mine = tmp_path / "notes" / "draft.kv"
    mine.write_bytes(b"x" * 10_000)
    page_file = len(b"PMKVPAGE1\0") + 32 + L * PAGE * W * 4
    cache = pool(tmp_path, pages=32, budget=2 * page_file)
    assert cache.store.bytes == 0
    compute(cache, "a", list(range(4 * PAGE)))
    assert mine.read_bytes() == b"x" * 10_000 and len(cache.store) == 2


def test_the_single_sequence_reads_and_keeps_its_pages(tmp_path: Path) -> None:
    """LLM's single sequence (generate, chat, one prompt of the API): a later process given the directory reads a
    prompt's start back, and the tokens and logprobs are bitwise those computed; a prompt that shares only part of a
    page, then the first again, still gives the tokens computed without the store; a reply's pages are kept too."""
    from pocketmoe.engine.llm import LLM
    from pocketmoe.engine.sampler import SamplingParams

    model = write_fixture("deepseek2", "tiny", "Q4_K_M", tmp_path / "m.gguf", seed=11)[0]
    store = tmp_path / "store"
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    a, b = list(range(20, 120)), list(range(20, 40)) + list(range(300, 380))
    ref = LLM(model, n_ctx=512, threads=1, max_num_seqs=1)
    want = {k: ref.generate([p], greedy)[0] for k, p in (("a", a), ("b", b))}
    ref.close()
    first = LLM(model, n_ctx=512, threads=1, max_num_seqs=1, prefix_cache_dir=store)
    out = first.generate([a], greedy)[0]
    assert (out.token_ids, out.logprobs, out.cached_tokens) == (want["a"].token_ids, want["a"].logprobs, 0)
    first.close()
    second = LLM(model, n_ctx=512, threads=1, max_num_seqs=1, prefix_cache_dir=store)
    for name, prompt, cached in (("a", a, 96), ("b", b, 20), ("a", a, 96)):  # b: the 20 rows a left
        out = second.generate([prompt], greedy)[0]
        assert (out.token_ids, out.logprobs) == (want[name].token_ids, want[name].logprobs), name
        assert out.cached_tokens == cached, name
    # a reply's pages are kept too: a later process given the conversation so far reads them
    reply = second.generate([a], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].token_ids
    second.close()
    third = LLM(model, n_ctx=512, threads=1, max_num_seqs=1, prefix_cache_dir=store)
    assert third.generate([a + reply[:39] + [7]], greedy)[0].cached_tokens == (len(a) + 39) // PAGE * PAGE == 128
    with pytest.raises(PocketMoEError, match="enable_prefix_caching"):
        LLM(model, n_ctx=512, threads=1, backend="reference", prefix_cache_dir=store)


def test_generate_cli_reads_the_prompt_back(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    model = write_fixture("deepseek2", "tiny", "Q8_0", tmp_path / "m.gguf")[0]
    cmd = [sys.executable, "-m", "pocketmoe.generate", "--model", str(model), "--threads", "1", "--json",
           "--max-tokens", "6", "--temperature", "0", "--prompt", "the quick brown fox " * 20,
           "--prefix-cache-dir", str(tmp_path / "store")]
    runs = [json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout)
            for _ in range(2)]
    assert runs[0]["text"] == runs[1]["text"] and runs[0]["cached_tokens"] == 0 < runs[1]["cached_tokens"]


def test_a_slot_file_puts_a_prompt_back_in_another_pool_bitwise(tmp_path: Path) -> None:
    """llama-server's slot save / restore / erase at the pool's level: the full pages of a prompt go to one file
    and back into a fresh pool (no store), bitwise, where a prompt starting with its tokens attaches them; a pool
    too small takes what fits without touching held pages; erase drops the pages no sequence holds."""
    from pocketmoe.engine.prefix_store import SlotFileError, read_slot_file, write_slot_file

    tokens = list(range(300, 300 + 4 * PAGE + 5))
    first = PagedKVCache(L, W, 16, 16 * PAGE)
    values = compute(first, "a", tokens)
    first.free("a")
    rows = first.prefix_rows(tokens)
    assert len(rows) == 4
    path = tmp_path / "s.bin"
    written = write_slot_file(path, b"k" * 16, tokens[:4 * PAGE], rows)
    assert written == path.stat().st_size == 10 + 16 + 4 + 4 * 4 * PAGE + 4 * L * PAGE * W * 4
    got_tokens, got_rows, read = read_slot_file(path, b"k" * 16, (L, PAGE, W), torch.float32)
    assert got_tokens == tokens[:4 * PAGE] and read == written
    fresh = PagedKVCache(L, W, 16, 16 * PAGE)
    assert fresh.index_rows(got_tokens, got_rows) == 4 * PAGE and fresh.cached_pages == 4
    assert fresh.attach("b", tokens) == 4 * PAGE
    assert torch.equal(rows_of(fresh, "b", 4 * PAGE), values[:, :4 * PAGE])
    assert fresh.index_rows(got_tokens, got_rows) == 4 * PAGE and fresh.cached_pages == 4  # already there
    # three pages held by a running sequence, one free: one page goes in, the held ones stay as they were
    small = PagedKVCache(L, W, 4, 4 * PAGE)
    compute(small, "busy", list(range(900, 900 + 3 * PAGE)), seed=4)
    held = rows_of(small, "busy", 3 * PAGE).clone()
    assert small.index_rows(got_tokens, got_rows) == PAGE
    assert torch.equal(rows_of(small, "busy", 3 * PAGE), held)
    # erase: the pages "b" holds stay, then go once it is done
    assert fresh.forget_prefix(tokens) == 0
    fresh.free("b")
    assert fresh.forget_prefix(tokens) == 4 * PAGE and fresh.cached_pages == 0 and fresh.free_pages == 16
    assert fresh.attach("c", tokens) == 0
    with pytest.raises(SlotFileError, match="another model"):
        read_slot_file(path, b"x" * 16, (L, PAGE, W), torch.float32)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(SlotFileError, match="cut short"):
        read_slot_file(path, b"k" * 16, (L, PAGE, W), torch.float32)
    (tmp_path / "t.bin").write_bytes(b"hello")
    with pytest.raises(SlotFileError, match="not a slot file"):
        read_slot_file(tmp_path / "t.bin", b"k" * 16, (L, PAGE, W), torch.float32)
