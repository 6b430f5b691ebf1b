"""Tokenizer checks against independent references: HF `tokenizers` pre-tokenizers built from the same
regexes, HF transformers' chat template renderer, and plain re-derivations."""

from __future__ import annotations

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pocketmoe.errors import PocketMoEError
from pocketmoe.testing.vocab import DEEPSEEK_SPECIALS, tokenizer_metadata
from pocketmoe.tokenizer import ChatTemplateError, Tokenizer, TokenizerError
from pocketmoe.tokenizer.pretokenize import PRE_REGEXES, split_words

# ordinary text: no non-ASCII whitespace, where llama.cpp's splitter knowingly differs from onig's
TEXTS = [
    "Hello world! It's a test.",
    "  leading spaces and trailing   ",
    "tabs\tand\t\tmore\ttabs",
    "line one\nline two\r\nline three\n\n\nend",
    "numbers 1234567890 and 3.14159 and 1,000,000 and -42",
    "def f(x):\n    return x ** 2  # square\n",
    "if (a != b && c >= 0) { return a->next; }",
    "混合专家模型把每个词元分配给少数几个专家。",
    "日本語のテキスト、カタカナとひらがな。한국어 문장도 있습니다.",
    "Ελληνικά καλημέρα, Русский привет, Français déjà vu, naïve café",
    "emoji 😀👍🏽🚀 ❤️ 🎉 mixed😀text",
    "quotes \"double\" 'single' `back` «guillemets» “curly”",
    "punctuation!!! ??? ... ;;; ::: --- ___ +++ ===",
    "ＡＢＣ ｆｕｌｌｗｉｄｔｈ １２３ ！？",
    "I'm we're they've she'll he'd it's I'M WE'RE",
    "x" * 50 + " " + "ab" * 30,
    "",
    " ",
    "\n",
]


def _onig_splitter(pre: str) -> HFTokenizer:
    """An HF tokenizer whose pre-tokenizer splits with the same regexes (onig engine), for comparison."""
    exprs = list(PRE_REGEXES[pre])
    exprs = [e + r"|\s+" if e.startswith("'s|'t") else e for e in exprs]
    tk = HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(e), "isolated") for e in exprs])
    return tk


@pytest.mark.parametrize("pre", ["deepseek-llm", "deepseek-v3", "gpt-2", "default", "deepseek-coder"])
def test_split_words_matches_onig(pre: str) -> None:
    ref = _onig_splitter(pre).pre_tokenizer
    for text in TEXTS:
        expected = [w for w, _ in ref.pre_tokenize_str(text)]
        assert split_words(text, pre) == expected, text


@pytest.mark.parametrize("pre", ["deepseek-llm", "deepseek-v3"])
def test_encode_matches_hf_bpe(pre: str) -> None:
    meta = tokenizer_metadata(1024, pre=pre)
    tok = Tokenizer.from_metadata(meta)
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    ref = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    splits = _onig_splitter(pre).pre_tokenizer
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    ref.decoder = decoders.ByteLevel()
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False, parse_special=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == ref.decode(ids) == text


def test_fixture_vocab_layout() -> None:
    meta = tokenizer_metadata(1024)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 1024 and len(set(tokens)) == 1024
    assert tokenizer_metadata(1024) == meta
    bos, eos = meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]
    assert (tokens[bos], tokens[eos]) == DEEPSEEK_SPECIALS[:2]
    assert all(types[tokens.index(s)] == 3 for s in DEEPSEEK_SPECIALS)
    vocab = set(tokens)
    for m in meta["tokenizer.ggml.merges"]:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    big = tokenizer_metadata(4096)
    assert len(big["tokenizer.ggml.tokens"]) == 4096 and big["tokenizer.ggml.token_type"][-1] == 5
    spm = tokenizer_metadata(600, model="llama")
    assert spm["tokenizer.ggml.tokens"][:3] == ["<unk>", "<s>", "</s>"]
    assert spm["tokenizer.ggml.tokens"][3 + 0x41] == "<0x41>" and len(spm["tokenizer.ggml.scores"]) == 600
    with pytest.raises(ValueError):
        tokenizer_metadata(100)


def test_special_tokens_are_single_tokens() -> None:
    tok = Tokenizer.from_metadata(tokenizer_metadata(1024))
    eos = tok.eos_id
    ids = tok.encode("Hi<｜end▁of▁sentence｜>there<｜User｜>", add_bos=False)
    assert eos in ids and tok.tokens.index("<｜User｜>") == ids[-1]
    assert tok.decode(ids) == "Hi<｜end▁of▁sentence｜>there<｜User｜>"
    assert tok.decode(ids, skip_special=True) == "Hithere"
    plain = tok.encode("Hi<｜end▁of▁sentence｜>", add_bos=False, parse_special=False)
    assert eos not in plain and tok.decode(plain) == "Hi<｜end▁of▁sentence｜>"
    assert tok.encode("x")[0] == tok.bos_id and tok.encode("x", add_bos=False)[0] != tok.bos_id
    assert eos in tok.eot_ids and tok.vocab_size == 1024


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_stream_decoder_equals_full_decode(model: str) -> None:
    tok = Tokenizer.from_metadata(tokenizer_metadata(700, model=model))
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        dec = tok.stream_decoder()
        chunks = [dec.push(t) for t in ids] + [dec.flush()]
        joined = "".join(chunks)
        expected = b"".join(tok.token_to_piece(t) for t in ids).decode("utf-8")
        assert joined == expected and "\ufffd" not in joined
        if model == "gpt2":
            assert joined == text


def test_stream_decoder_holds_partial_utf8() -> None:
    tok = Tokenizer.from_metadata(tokenizer_metadata(300))
    ids = tok.encode("😀", add_bos=False)
    assert len(ids) == 4  # no merges for this emoji in a 300-token vocabulary: four byte tokens
    dec = tok.stream_decoder()
    assert [dec.push(t) for t in ids] == ["", "", "", "😀"]
    dec.push(ids[0])
    assert dec.flush() == "\ufffd"


def test_spm_encode_decode() -> None:
    tok = Tokenizer.from_metadata(tokenizer_metadata(700, model="llama"))
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert tok.decode(ids) == text
    ids = tok.encode("Hello \U0001d11e")  # a character the fixture vocabulary lacks: byte fallback
    assert ids[0] == tok.bos_id == 1 and tok.eos_id == 2
    assert [tok.tokens[i] for i in ids[-4:]] == ["<0xF0>", "<0x9D>", "<0x84>", "<0x9E>"]
    assert tok.decode(ids, skip_special=True) == " Hello \U0001d11e"  # llama.cpp keeps the space after BOS


def test_chat_template_matches_transformers() -> None:
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    tok = Tokenizer.from_metadata(tokenizer_metadata(1024))
    chats = [
        [{"role": "user", "content": "Hello!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    ]
    for chat in chats:
        for gen in (True, False):
            ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
            ref, _ = render(conversations=[chat], chat_template=tok.chat_template, add_generation_prompt=gen,
                            bos_token=tok.tokens[tok.bos_id], eos_token=tok.tokens[tok.eos_id])
            assert ours == ref[0]
    template = (
        "{% for m in messages %}\n  {% if m['role'] == 'user' %}\n    [U]{{ m['content'] | trim }}\n"
        "  {% else %}\n    [A]{{ m['content'] }}{{ eos_token }}\n  {% endif %}\n{% endfor %}\n"
        "{% if add_generation_prompt %}[A]{% endif %}{{ {'k': 'v'} | tojson }}"
    )
    meta = dict(tokenizer_metadata(1024), **{"tokenizer.chat_template": template})
    tok2 = Tokenizer.from_metadata(meta)
    ref, _ = render(conversations=[chats[1]], chat_template=template, add_generation_prompt=True,
                    bos_token=tok2.tokens[tok2.bos_id], eos_token=tok2.tokens[tok2.eos_id])
    assert tok2.apply_chat_template(chats[1]) == ref[0]


def test_chat_template_errors() -> None:
    meta = dict(tokenizer_metadata(1024), **{"tokenizer.chat_template": "{{ raise_exception('no system') }}"})
    with pytest.raises(ChatTemplateError, match="no system"):
        Tokenizer.from_metadata(meta).apply_chat_template([{"role": "system", "content": "x"}])
    meta["tokenizer.chat_template"] = "{% for %}"
    with pytest.raises(PocketMoEError):
        Tokenizer.from_metadata(meta).apply_chat_template([])
    del meta["tokenizer.chat_template"]
    out = Tokenizer.from_metadata(meta).apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<｜begin▁of▁sentence｜>User: hi\n\nAssistant:"


def test_bad_metadata() -> None:
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata({})
    meta = tokenizer_metadata(1024)
    with pytest.raises(TokenizerError, match="not supported"):
        Tokenizer.from_metadata(dict(meta, **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata({k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"})
    with pytest.warns(UserWarning, match="gpt-2"):
        tok = Tokenizer.from_metadata(dict(meta, **{"tokenizer.ggml.pre": "no-such-pre"}))
    assert tok.pre == "gpt-2"
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata(meta).token_to_piece(5000)


def test_damaged_byte_token_is_refused() -> None:
    meta = tokenizer_metadata(700, model="llama")
    tokens = list(meta["tokenizer.ggml.tokens"])
    i = tokens.index("<0x41>")
    tokens[i] = "<0xG1>"
    with pytest.raises(TokenizerError, match=rf"token {i} is marked as a byte token but reads '<0xG1>'"):
        Tokenizer.from_metadata(dict(meta, **{"tokenizer.ggml.tokens": tokens}))
