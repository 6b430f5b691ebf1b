"""Tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata, encoding exactly as llama.cpp does."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from pocketmoe.errors import PocketMoEError
from pocketmoe.tokenizer.chat import DEEPSEEK_V2_CHAT_TEMPLATE, ChatTemplateError, render_chat
from pocketmoe.tokenizer.models import ByteLevelBPE, SentencePieceBPE, symbols_to_bytes
from pocketmoe.tokenizer.pretokenize import resolve_pre
from pocketmoe.tokenizer.specials import (
    EOG_TEXTS,
    EOT_TEXTS,
    FIM_OLD_KEYS,
    FIM_TEXTS,
    FORCED_CONTROL_TEXTS,
    SPECIAL_ATTRS,
    TYPE_TO_ATTR,
    TokenAttr,
    clean_spaces,
    partition,
)
from pocketmoe.tokenizer.stream import StreamDecoder

_K = "tokenizer.ggml."
# pre types for which llama.cpp keeps clean_up_tokenization_spaces on
_CLEAN_SPACES_PRE = frozenset({"default", "gpt-2"})


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class TokenizerError(PocketMoEError):
    """The file's tokenizer metadata is missing, malformed, or of a kind we do not support."""


def _opt_id(meta: Mapping[str, object], key: str, n: int, default: int | None) -> int | None:
    value = meta.get(_K + key)
    if value is None:
        return default if default is not None and default < n else None
    if not isinstance(value, int) or not 0 <= value < n:
        return default if default is not None and default < n else None
    return value


class Tokenizer:
    """Encode/decode text for one model. Build it with `Tokenizer.from_metadata(bundle.metadata)`."""

    def __init__(self, metadata: Mapping[str, object]) -> None:
        model = metadata.get(_K + "model")
        tokens = metadata.get(_K + "tokens")
        if not isinstance(model, str):
            raise TokenizerError("the GGUF file has no tokenizer.ggml.model key, so it carries no tokenizer.")
        if not isinstance(tokens, list) or not tokens:
            raise TokenizerError("the GGUF file has no tokenizer.ggml.tokens list, so it carries no tokenizer.")
        self.model = model
        self.tokens: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(self.tokens)
        types = metadata.get(_K + "token_type")
        if types is not None and (not isinstance(types, list) or len(types) < n):
            raise TokenizerError(f"tokenizer.ggml.token_type has fewer entries than the {n} tokens.")
        self.attrs: list[TokenAttr] = [
            TYPE_TO_ATTR.get(int(types[i]), TokenAttr.UNDEFINED) if types is not None else TokenAttr.NORMAL
            for i in range(n)
        ]
        for i, text in enumerate(self.tokens):
            if text in FORCED_CONTROL_TEXTS:
                self.attrs[i] |= TokenAttr.CONTROL
        self.add_space_prefix = False
        self.pre: str | None = None
        if model == "gpt2":
            merges = metadata.get(_K + "merges")
            if not isinstance(merges, list):
                raise TokenizerError("the gpt2 tokenizer in this GGUF file has no tokenizer.ggml.merges list.")
            self.pre = resolve_pre(metadata.get(_K + "pre"))  # type: ignore[arg-type]
            self._impl: ByteLevelBPE | SentencePieceBPE = ByteLevelBPE(self.tokens, merges, self.pre)
            defaults: tuple[int | None, int | None, int | None] = (None, None, None)
            add_bos, self.clean_spaces = False, self.pre in _CLEAN_SPACES_PRE
        elif model == "llama":
            scores = metadata.get(_K + "scores")
            if scores is None:
                scores = [0.0] * n
            if not isinstance(scores, list) or len(scores) < n:
                raise TokenizerError(f"tokenizer.ggml.scores has fewer entries than the {n} tokens.")
            self._impl = SentencePieceBPE(self.tokens, [float(s) for s in scores])
            defaults, add_bos, self.clean_spaces = (1, 2, 0), True, False
            self.add_space_prefix = True
        else:
            raise TokenizerError(
                f"tokenizer.ggml.model {model!r} is not supported; PocketMoE reads 'gpt2' (byte-level BPE) "
                "and 'llama' (SentencePiece) vocabularies."
            )
        asp = metadata.get(_K + "add_space_prefix")
        if isinstance(asp, bool):
            self.add_space_prefix = asp
        self.bos_id = _opt_id(metadata, "bos_token_id", n, defaults[0])
        self.eos_id = _opt_id(metadata, "eos_token_id", n, defaults[1])
        self.unk_id = _opt_id(metadata, "unknown_token_id", n, defaults[2])
        self.pad_id = _opt_id(metadata, "padding_token_id", n, None)
        flag = metadata.get(_K + "add_bos_token")
        self.add_bos = flag if isinstance(flag, bool) else add_bos
        flag = metadata.get(_K + "add_eos_token")
        self.add_eos = flag if isinstance(flag, bool) else False
        self.eot_id = _opt_id(metadata, "eot_token_id", n, None)
        if self.eot_id is None:
            self.eot_id = next((i for i, t in enumerate(self.tokens) if t in EOT_TEXTS), None)
        eom_id = _opt_id(metadata, "eom_token_id", n, None)
        # fill-in-the-middle tokens by role (pre, suf, mid, pad, rep, sep): the file's, else found by text
        by_text: dict[str, int] = {}
        roles = {t: role for role, texts in FIM_TEXTS.items() for t in texts}
        for i, t in enumerate(self.tokens):
            if t in roles:
                by_text.setdefault(roles[t], i)
        self.fim: dict[str, int] = {}
        for role in FIM_TEXTS:
            tid = _opt_id(metadata, f"fim_{role}_token_id", n, None)
            if tid is None and role in FIM_OLD_KEYS:
                tid = _opt_id(metadata, f"{FIM_OLD_KEYS[role]}_token_id", n, None)
            tid = by_text.get(role) if tid is None else tid
            if tid is not None:
                self.fim[role] = tid
        eog = {i for i, t in enumerate(self.tokens) if t in EOG_TEXTS}
        # llama.cpp ends generation at the FIM pad, repo and file-separator tokens too
        eog.update(i for i in (self.eos_id, self.eot_id, eom_id, *(self.fim.get(r) for r in ("pad", "rep", "sep")))
                   if i is not None)
        self.eot_ids: tuple[int, ...] = tuple(sorted(eog))
        template = metadata.get("tokenizer.chat_template")
        self.chat_template: str = template if isinstance(template, str) else DEEPSEEK_V2_CHAT_TEMPLATE
        specials = [i for i, a in enumerate(self.attrs) if a & SPECIAL_ATTRS]
        specials.sort(key=lambda i: (-len(self.tokens[i].encode("utf-8")), i))
        self._specials = [(self.tokens[i], i, self.attrs[i]) for i in specials]
        self._pieces = [self._piece(i) for i in range(n)]

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, object]) -> Tokenizer:
        return cls(metadata)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def _piece(self, i: int) -> bytes:
        attr, text = self.attrs[i], self.tokens[i]
        if attr & SPECIAL_ATTRS:
            return text.encode("utf-8")
        if attr & TokenAttr.NORMAL:
            if self.model == "gpt2":
                return symbols_to_bytes(text)
            return text.replace("\u2581", " ").encode("utf-8")
        if attr & TokenAttr.BYTE:
            if not _BYTE_TOKEN.fullmatch(text):
                raise TokenizerError(f"token {i} is marked as a byte token but reads {text!r}, not <0xHH>; "
                                     "the file's tokenizer.ggml.tokens or token_type is damaged.")
            return bytes([int(text[3:5], 16)])
        return b""

    def is_special(self, token_id: int) -> bool:
        return bool(self.attrs[token_id] & (TokenAttr.CONTROL | TokenAttr.UNKNOWN))

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes this token stands for (may be part of a UTF-8 character). Control and unknown
        tokens give their text when `special`, else nothing (llama.cpp's llama_token_to_piece)."""
        if not 0 <= token_id < len(self.tokens):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary of {len(self.tokens)} tokens.")
        if not special and self.is_special(token_id):
            return b""
        return self._pieces[token_id]

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               space_prefix: bool = True) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize.

        add_bos: None follows the file (add_bos_token, add_eos_token); True always starts with BOS and
        adds EOS when the file asks for it; False adds neither. parse_special: special-token texts in
        `text` become single tokens (user-defined tokens always do). space_prefix=False: no leading space
        is added where a SentencePiece file asks for one (text that continues a sequence mid-line).
        """
        text = text.encode("utf-8", "replace").decode("utf-8")
        want_bos = self.add_bos if add_bos is None else add_bos
        out: list[int] = []
        if want_bos and self.bos_id is not None:
            out.append(self.bos_id)
        prev_special = True
        for frag in partition(text, self._specials, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.model == "llama":
                if self.add_space_prefix and prev_special and space_prefix:
                    frag = " " + frag
                frag = frag.replace(" ", "\u2581")
            out.extend(self._impl.encode(frag))
            prev_special = False
        if add_bos is not False and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`, as llama.cpp's llama_detokenize(remove_special=unparse_special=...)."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = [self.token_to_piece(t, special=not skip_special) for t in ids]
        if remove_space and parts and parts[0].startswith(b" "):
            parts[0] = parts[0][1:]
        text = b"".join(parts).decode("utf-8", "replace")
        return clean_spaces(text) if self.clean_spaces else text

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **variables: Any) -> str:
        """Render the file's chat template (DeepSeek-V2-Chat's when it has none), as HF does.
        continue_final_message: the chat ends inside the last (assistant) message, right after its text, so the
        model goes on with it (HF's and vLLM's option; no generation prompt then)."""
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id,
                 "pad_token": self.pad_id}
        for name, tid in names.items():
            variables.setdefault(name, self.tokens[tid] if tid is not None else "")
        if not continue_final_message:
            return render_chat(self.chat_template, messages, add_generation_prompt, **variables)
        final = messages[-1].get("content") if messages and messages[-1].get("role") == "assistant" else None
        final = final.strip() if isinstance(final, str) else ""
        if not final:
            raise ChatTemplateError("continue_final_message needs the last message to be the assistant's, with text "
                                    "to continue.")
        text = render_chat(self.chat_template, messages, False, **variables)
        end = text.rfind(final)
        if end < 0:
            raise ChatTemplateError("the chat template does not write the final assistant message's text as it is, "
                                    "so it cannot be continued.")
        return text[:end + len(final)]

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **variables: Any) -> list[int]:
        """Token ids of the rendered chat; no second BOS when the template writes one itself."""
        return self.encode_rendered_chat(
            self.apply_chat_template(messages, add_generation_prompt, continue_final_message, **variables))

    def encode_rendered_chat(self, text: str) -> list[int]:
        """Token ids of a chat apply_chat_template rendered (BOS as the file asks, unless the text has it)."""
        bos = self.bos_id
        starts_with_bos = bos is not None and text.startswith(self.tokens[bos])
        return self.encode(text, add_bos=None if not starts_with_bos else False)
