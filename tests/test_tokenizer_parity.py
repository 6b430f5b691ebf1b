"""Our tokenizer against llama.cpp (llama-cpp-python) on the same GGUF files: encode, decode, pieces,
end-of-generation ids, and the DeepSeek-V2 chat format."""

from __future__ import annotations

import ctypes
import random
from pathlib import Path

import pytest

from pocketmoe.testing.vocab import tokenizer_metadata, write_vocab_gguf
from pocketmoe.tokenizer import Tokenizer

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.parity

FIXED = [
    "", " ", "  ", "\n", "\t", "\r\n", "Hello world", " Hello world", "Hello  world\n\n  bye   ",
    "It's we're they've I'M", "1 12 123 1234 12345 123456 3.14 1,000 0x1F",
    "混合专家模型。你好，世界！", "日本語のテキスト、カタカナ", "한국어 문장", "Ελληνικά Русский déjà",
    "😀👍🏽🚀 ❤️ 👨‍👩‍👧", "ＡＢＣ　全角　１２３", "a\u00a0b\u2028c\u3000d\u2009e", "x\u0301\u0327 e\u0308",
    "def f(x):\n    return x ** 2\n", "<｜begin▁of▁sentence｜>User: hi\n\nAssistant:",
    "a<｜end▁of▁sentence｜>b<｜User｜><｜Assistant｜>", "<s>text</s><unk>", "\u0378\ue000\ufffd\U0010fffd",
    "∑∫√∞ ≤≥≠ ←→ ①② ½¼ ²³", "XMLHttpRequest getHTTPResponse McDONALD'S I'LL can'T ÀÉÎõü ΑβΓδ ǅemal",
    "path/to/file.py\n// a/b\n12345678 x1y22z333", "getUserName iPhone 中文abc12345DEF 漢字かな ,中 x\u0301y",
    "مرحبا بالعالم नमस्ते ภาษาไทย", "   leading", "trailing   ", "\n\n\n",
]
POOL = (
    list("abcXYZ019 '\"!?.,;:-_()[]{}<>|/\\@#$%^&*+=~`") + ["  ", "   ", "\t", "\n", "\r", "\r\n"]
    + list("éñüßÅøçàÉ αβγΩ абвЖ 中文字符 ひらがな カタカナ 한글 ١٢٣ ٠ ह ि ก") + ["😀", "🏽", "\u200d", "\ufe0f"]
    + list("\u0301\u00a0\u3000\u2009\u2028\u0085\u00ad\u0378\ue000１２ＡＢ！？，。、「」…—–€£¥©®™½²")
    + ["'s", "'re", "'ll", " the", "ing", "<｜end▁of▁sentence｜>", "<｜User｜>", "<s>", "</s>"]
)


def _fuzz(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(POOL) for _ in range(rng.randint(1, 40))) for _ in range(n)]


class LlamaVocab:
    """llama.cpp's vocabulary of a GGUF file through llama-cpp-python's C API (vocab_only)."""

    def __init__(self, path: Path) -> None:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, f"llama.cpp could not load {path}"
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) * 2 + 8
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> str:
        toks = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        cap = 64 * len(ids) + 16
        buf = ctypes.create_string_buffer(cap)
        n = llama_cpp.llama_detokenize(self.vocab, toks, len(ids), buf, cap, remove_special, unparse_special)
        assert n >= 0
        return buf.raw[:n].decode("utf-8", "replace")

    def piece(self, tid: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, tid, buf, 256, 0, special)
        return buf.raw[:n]

    def close(self) -> None:
        llama_cpp.llama_model_free(self.model)


CASES = [("gpt2", "deepseek-llm", 1024), ("gpt2", "deepseek-v3", 1024), ("gpt2", "default", 700),
         ("gpt2", "gpt-2", 700), ("gpt2", "deepseek-coder", 700), ("gpt2", "deepseek-llm", 4096),
         ("gpt2", "minimax-m2", 1024), ("gpt2", "gpt-4o", 700), ("gpt2", "kimi-k2", 1024), ("llama", "", 700)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1] or 'spm'}-{c[2]}")
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model, pre, size = request.param
    meta = tokenizer_metadata(size, model=model, pre=pre or "deepseek-llm")
    path = write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "vocab.gguf", meta)
    ref = LlamaVocab(path)
    yield Tokenizer.from_metadata(meta), ref
    ref.close()


def test_encode_matches_llama_cpp(pair) -> None:
    ours, ref = pair
    for text in FIXED + _fuzz(0, 300):
        for add_bos in (True, False):
            for special in (True, False):
                got = ours.encode(text, add_bos=add_bos, parse_special=special)
                assert got == ref.tokenize(text, add_bos, special), (text, add_bos, special)


def test_decode_matches_llama_cpp(pair) -> None:
    ours, ref = pair
    rng = random.Random(1)
    seqs = [ours.encode(t) for t in FIXED + _fuzz(2, 100)]
    seqs += [[rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 20))] for _ in range(200)]
    for ids in seqs:
        for skip in (True, False):
            assert ours.decode(ids, skip_special=skip) == ref.detokenize(ids, skip, not skip), (ids, skip)


def test_pieces_and_ids_match_llama_cpp(pair) -> None:
    ours, ref = pair
    for tid in range(ours.vocab_size):
        for special in (True, False):
            assert ours.token_to_piece(tid, special) == ref.piece(tid, special), tid
    eog = [t for t in range(ours.vocab_size) if llama_cpp.llama_vocab_is_eog(ref.vocab, t)]
    assert list(ours.eot_ids) == eog
    assert ours.bos_id == llama_cpp.llama_vocab_bos(ref.vocab)
    assert ours.eos_id == llama_cpp.llama_vocab_eos(ref.vocab)


def test_deepseek2_chat_format_matches_llama_cpp() -> None:
    meta = tokenizer_metadata(1024)
    tok = Tokenizer.from_metadata(meta)
    chat = [("system", "Be brief."), ("user", "2+2?"), ("assistant", "4"), ("user", "3+3?")]
    msgs = (llama_cpp.llama_chat_message * len(chat))(
        *[llama_cpp.llama_chat_message(role=r.encode(), content=c.encode()) for r, c in chat]
    )
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_chat_apply_template(tok.chat_template.encode(), msgs, len(chat), True, buf, 4096)
    assert n > 0
    ours = tok.apply_chat_template([{"role": r, "content": c} for r, c in chat])
    # llama.cpp's built-in DeepSeek-V2 format leaves BOS to the tokenizer; the jinja template writes it
    assert ours == tok.tokens[tok.bos_id] + buf.raw[:n].decode("utf-8")


@pytest.mark.parametrize("names, keys", [
    ({}, {}),  # DeepSeek's three (<｜fim▁begin｜> ...), found by text
    ({700 - 6: "<|fim_prefix|>", 700 - 5: "<|fim_suffix|>", 700 - 4: "<|fim_middle|>", 700 - 3: "<|fim_pad|>",
      700 - 2: "<|fim_repo|>", 700 - 1: "<|file_sep|>"}, {}),  # Qwen's six: pad, repo and file_sep end generation
    ({700 - 2: "<PAD>", 700 - 1: "<reponame>"}, {"fim_pre_token_id": 700 - 10, "suffix_token_id": 700 - 11}),
])
def test_fim_tokens_match_llama_cpp(tmp_path: Path, names: dict[int, str], keys: dict[str, int]) -> None:
    """The fill-in-the-middle tokens /infill lays out, by role, and the ends of generation they add: by the
    file's keys (new and old names) or by their texts, as llama.cpp finds them."""
    meta = tokenizer_metadata(700, pre="deepseek-coder")
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    for tid, text in names.items():
        tokens[tid], types[tid] = text, 3
    meta.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types},
                **{"tokenizer.ggml." + k: v for k, v in keys.items()})
    ref = LlamaVocab(write_vocab_gguf(tmp_path / "fim.gguf", meta))
    try:
        ours = Tokenizer.from_metadata(meta)
        for role in ("pre", "suf", "mid", "pad", "rep", "sep"):
            want = getattr(llama_cpp, f"llama_vocab_fim_{role}")(ref.vocab)
            assert ours.fim.get(role, -1) == want, role
        assert {"pre", "suf", "mid"} <= set(ours.fim)
        assert list(ours.eot_ids) == [t for t in range(ours.vocab_size) if llama_cpp.llama_vocab_is_eog(ref.vocab, t)]
    finally:
        ref.close()
