"""Token attributes and special-token handling as llama.cpp does it (src/llama-vocab.cpp)."""

from __future__ import annotations

from enum import IntFlag


class TokenAttr(IntFlag):
    UNDEFINED = 0
    UNKNOWN = 1
    UNUSED = 2
    NORMAL = 4
    CONTROL = 8
    USER_DEFINED = 16
    BYTE = 32


# GGUF tokenizer.ggml.token_type value -> attribute
TYPE_TO_ATTR = {
    1: TokenAttr.NORMAL,
    2: TokenAttr.UNKNOWN,
    3: TokenAttr.CONTROL,
    4: TokenAttr.USER_DEFINED,
    5: TokenAttr.UNUSED,
    6: TokenAttr.BYTE,
}

# token texts llama.cpp treats as end of generation, whatever the file says
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
EOT_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
    "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
})
# fill-in-the-middle tokens by role (llama.cpp's names: tokenizer.ggml.fim_<role>_token_id), found by text where the
# file names none, as llama.cpp does; pre/suf/mid: DeepSeek's <｜fim▁begin｜>, <｜fim▁hole｜>, <｜fim▁end｜>
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
            "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
            "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
            "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# the older keys of the first three (tokenizer.ggml.prefix_token_id ...)
FIM_OLD_KEYS = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
# texts llama.cpp forces to CONTROL when it auto-detects EOT/EOM/FIM tokens by name
_FIM_TEXTS = frozenset(t for texts in FIM_TEXTS.values() for t in texts)
FORCED_CONTROL_TEXTS = EOG_TEXTS | EOT_TEXTS | _FIM_TEXTS | {"<|eom_id|>"}

SPECIAL_ATTRS = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN


def partition(text: str, specials: list[tuple[str, int, TokenAttr]], parse_special: bool) -> list[str | int]:
    """Cut `text` at special tokens: strings are raw text, ints are token ids.

    `specials` is (text, id, attr), longest text first. Each special token in turn is searched in every
    raw fragment left by the previous ones, left to right. Control and unknown tokens are only
    recognised with `parse_special`; user-defined tokens always are.
    """
    fragments: list[str | int] = [text] if text else []
    for stext, sid, attr in specials:
        if not parse_special and attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN):
            continue
        if not any(isinstance(f, str) and stext in f for f in fragments):
            continue
        out: list[str | int] = []
        for f in fragments:
            if isinstance(f, int) or stext not in f:
                out.append(f)
                continue
            parts = f.split(stext)
            for i, part in enumerate(parts):
                if i:
                    out.append(sid)
                if part:
                    out.append(part)
        fragments = out
    return fragments


def clean_spaces(text: str) -> str:
    """llama.cpp's clean_up_tokenization_spaces: ' ?' ' !' ' .' ' ,' -> no space, ' ' ' -> ''',
    and " 's" " 'm" " 're" " 've" lose their space."""
    for p in "?!.,":
        text = text.replace(" " + p, p)
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "'" and out and out[-1] == " " and i + 1 < len(text) and text[i + 1] == " ":
            out[-1] = "'"
            i += 2
            continue
        out.append(text[i])
        i += 1
    text = "".join(out)
    for suffix in ("'s", "'m", "'re", "'ve"):
        text = text.replace(" " + suffix, suffix)
    return text
