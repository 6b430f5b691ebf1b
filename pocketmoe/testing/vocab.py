"""Small but real tokenizers for fixtures: the `tokenizer.ggml.*` keys of a byte-level BPE ("gpt2")
or SentencePiece ("llama") vocabulary learned from a built-in text sample, loadable by llama.cpp."""

from __future__ import annotations

import heapq
import re
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path

import gguf

from pocketmoe.testing.corpus import CORPUS
from pocketmoe.tokenizer.chat import DEEPSEEK_V2_CHAT_TEMPLATE
from pocketmoe.tokenizer.models import byte_to_unicode, bytes_to_symbols
from pocketmoe.tokenizer.pretokenize import resolve_pre, split_words

NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE = 1, 2, 3, 5, 6

# DeepSeek's special tokens; bos and eos first
DEEPSEEK_SPECIALS = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>",
    "<｜User｜>", "<｜Assistant｜>", "<｜▁pad▁｜>",
)
SPM_SPECIALS = ("<unk>", "<s>", "</s>")
# A chat template with MiniMax-M2's conventions (written here from its documented format): the generation prompt
# opens a reasoning block; history's reasoning_content goes back between "<think>\n" and "\n</think>\n\n" before
# the content; each turn ends with [e~[
MINIMAX_SHAPED_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}]~!b[]~b]system\n{{ m.content }}[e~[\n"
    "{% elif m.role == 'user' %}]~b]user\n{{ m.content }}[e~[\n"
    "{% elif m.role == 'assistant' %}]~b]ai\n{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n"
    "</think>\n\n{% endif %}{{ m.content }}[e~[\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n<think>\n{% endif %}")

# A chat template with DeepSeek-V3.1's conventions (written here from its documented format): history's assistant
# turns open with "</think>"; the generation prompt opens a reasoning block where the `thinking` variable is true
# (else closes it); tool calls as NAME<｜tool▁sep｜>ARGUMENTS with no fence, tool results between
# <｜tool▁output▁begin｜> and <｜tool▁output▁end｜>
DEEPSEEK_V31_SHAPED_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content or '' }}{% if m.tool_calls %}"
    "<｜tool▁calls▁begin｜>{% for t in m.tool_calls %}<｜tool▁call▁begin｜>{{ t.function.name }}<｜tool▁sep｜>"
    "{{ t.function.arguments }}<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{{ '<think>' if thinking else '</think>' }}{% endif %}")

# A chat template with Kimi-K2's conventions (written here from its documented format): turns between
# <|im_user|>/<|im_assistant|>/<|im_system|> ROLE<|im_middle|> and <|im_end|>; a call's head is its id
# (functions.NAME:INDEX), which a tool result names back
KIMI_SHAPED_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{% elif m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{% elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}{% if m.tool_calls %}"
    "<|tool_calls_section_begin|>{% for t in m.tool_calls %}<|tool_call_begin|>{{ t.id }}<|tool_call_argument_begin|>"
    "{{ t.function.arguments }}<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>"
    "{% elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n{{ m.content }}"
    "<|im_end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")


def _learn_merges(words: Counter[tuple[str, ...]], limit: int) -> list[tuple[str, str]]:
    """Greedy BPE: merge the most frequent adjacent pair (ties: smallest pair) until `limit` merges
    or no pair is left. Deterministic."""
    seqs = [list(w) for w in words]
    freqs = list(words.values())
    counts: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for wi, seq in enumerate(seqs):
        for pair in zip(seq, seq[1:], strict=False):
            counts[pair] += freqs[wi]
            where[pair].add(wi)
    heap = [(-c, p) for p, c in counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while heap and len(merges) < limit:
        neg, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -neg or neg == 0:
            continue
        merges.append(pair)
        touched: set[tuple[str, str]] = set()
        for wi in sorted(where.pop(pair, ())):
            seq, f = seqs[wi], freqs[wi]
            for old in zip(seq, seq[1:], strict=False):
                counts[old] -= f
                touched.add(old)
            out: list[str] = []
            i = 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
                    out.append(seq[i] + seq[i + 1])
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[wi] = out
            for new in zip(out, out[1:], strict=False):
                counts[new] += f
                where[new].add(wi)
                touched.add(new)
        for p in touched:
            if counts[p] > 0:
                heapq.heappush(heap, (-counts[p], p))
    return merges


def _grow(vocab: list[str], merges: list[tuple[str, str]], room: int) -> list[tuple[str, str]]:
    """Append merge results to `vocab` (no duplicates) until `room` new tokens; the merges used."""
    seen = set(vocab)
    used: list[tuple[str, str]] = []
    for a, b in merges:
        if room == 0:
            break
        used.append((a, b))
        if a + b not in seen:
            seen.add(a + b)
            vocab.append(a + b)
            room -= 1
    return used


@lru_cache(maxsize=16)
def _gpt2(vocab_size: int, pre: str) -> dict[str, object]:
    n_base = 256 + len(DEEPSEEK_SPECIALS)
    if vocab_size < n_base + 1:  # GGUF cannot store an empty merges array
        raise ValueError(f"a byte-level BPE vocabulary needs at least {n_base + 1} tokens, got {vocab_size}")
    words = Counter(tuple(bytes_to_symbols(w.encode("utf-8"))) for w in split_words(CORPUS, resolve_pre(pre)))
    tokens = [byte_to_unicode()[b] for b in range(256)]
    used = _grow(tokens, _learn_merges(words, vocab_size), vocab_size - n_base)
    types = [NORMAL] * len(tokens)
    bos = len(tokens)
    tokens += DEEPSEEK_SPECIALS
    types += [CONTROL] * len(DEEPSEEK_SPECIALS)
    n_fill = vocab_size - len(tokens)
    tokens += [f"<｜place▁holder▁no▁{i}｜>" for i in range(n_fill)]
    types += [UNUSED] * n_fill
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in used],
        "tokenizer.ggml.bos_token_id": bos,
        "tokenizer.ggml.eos_token_id": bos + 1,
        "tokenizer.ggml.padding_token_id": bos + len(DEEPSEEK_SPECIALS) - 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": DEEPSEEK_V2_CHAT_TEMPLATE,
    }


@lru_cache(maxsize=16)
def _llama(vocab_size: int) -> dict[str, object]:
    n_base = len(SPM_SPECIALS) + 256
    if vocab_size < n_base + 1:
        raise ValueError(f"a SentencePiece vocabulary needs at least {n_base + 1} tokens, got {vocab_size}")
    text = CORPUS.replace(" ", "\u2581")
    freq = Counter(text)
    chars = sorted(freq, key=lambda c: (-freq[c], c))[: vocab_size - n_base]
    keep = set(chars)
    words: Counter[tuple[str, ...]] = Counter()
    for w in re.findall("\u2581*[^\u2581]+|\u2581+", text):
        for run in re.findall("[" + re.escape("".join(sorted(keep))) + "]+", w):
            words[tuple(run)] += 1
    pieces = list(chars)
    _grow(pieces, _learn_merges(words, vocab_size), vocab_size - n_base - len(chars))
    n_fill = vocab_size - n_base - len(pieces)
    tokens = [*SPM_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    tokens += [f"<unused{i}>" for i in range(n_fill)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces) + [UNUSED] * n_fill
    # merged pieces score by merge order (earlier = higher), single characters below all of them
    scores = [0.0] * n_base
    scores += [-1.0e6 - i if len(p) == 1 else -float(i) for i, p in enumerate(pieces)]
    scores += [-2.0e6] * n_fill
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.chat_template": DEEPSEEK_V2_CHAT_TEMPLATE,
    }


def tokenizer_metadata(vocab_size: int, model: str = "gpt2", pre: str = "deepseek-llm") -> dict[str, object]:
    """The `tokenizer.*` GGUF keys of a real `vocab_size`-token vocabulary, as plain python values.

    Writers map them as: str -> STRING, list[str] -> ARRAY of STRING, token_type (list[int]) -> ARRAY
    of INT32, scores (list[float]) -> ARRAY of FLOAT32, *_token_id (int) -> UINT32, bool -> BOOL.

    model "gpt2": ids 0..255 are the GPT-2 byte symbols, then BPE merges learned from a built-in
    English/code/CJK sample with the `pre` word splitter, then DeepSeek's special tokens (control),
    then `<｜place▁holder▁no▁N｜>` (unused) once the sample has no merges left. model "llama": <unk>,
    <s>, </s>, byte tokens <0x00>..<0xFF>, the sample's characters and merged pieces with scores.
    """
    if model == "gpt2":
        meta = _gpt2(vocab_size, pre)
    elif model == "llama":
        meta = _llama(vocab_size)
    else:
        raise ValueError(f"tokenizer model must be 'gpt2' or 'llama', got {model!r}")
    return {k: list(v) if isinstance(v, list) else v for k, v in meta.items()}


def add_tokenizer_keys(writer: gguf.GGUFWriter, meta: dict[str, object]) -> None:
    """Add `tokenizer_metadata` output to a GGUFWriter with the types llama.cpp expects."""
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)  # element type from the first item: STRING, INT32, FLOAT32
        else:
            raise TypeError(f"tokenizer key {key} has a value of unsupported type {type(value).__name__}")


def write_vocab_gguf(path: str | Path, meta: dict[str, object], arch: str = "deepseek2") -> Path:
    """A tensor-less GGUF holding only general.architecture and the tokenizer keys (llama.cpp's
    vocab_only loading reads nothing else)."""
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("pocketmoe-vocab-fixture")
    add_tokenizer_keys(writer, meta)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
