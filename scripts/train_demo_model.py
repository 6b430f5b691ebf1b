"""Train PocketMoE's built-in demo model and write it as a GGUF file.

    .venv/bin/python scripts/train_demo_model.py [--out pocketmoe/data/demo-model.gguf] [--minutes 40]

A small `deepseek2` MoE (MLA attention in the absorbed k_b / v_b layout, one leading dense block,
then blocks of shared + routed experts with softmax top-k routing, as DeepSeek-V2-Lite) trained with
torch on the CPU on English text every Python install has: the docstrings of the standard library
(read from the .py sources with `ast`, and from the built-in / C modules with `inspect.getdoc`) and
the language reference topics that `pydoc` ships (`pydoc_data.topics`), all under the PSF License.
Besides the plain documents it trains on question/answer pairs made from them in the file's chat
format (DeepSeek-V2's template), so `--chat` gets an answer-shaped reply.

Everything is seeded; a run reads only the local Python install, so the same Python version and
torch build give the same file. It writes the GGUF (Q4_K/Q6_K experts, Q8_0 attention, Q6_K head,
a byte-level BPE vocabulary learned with `tokenizers`), a JSON log of the training and held-out loss
(read by scripts/demo_model_report.py) and a small held-out text sample the tests use.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import math
import platform
import random
import re
import sys
import sysconfig
import time
import warnings
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pocketmoe.specs import metadata_from_config  # noqa: E402
from pocketmoe.specs.deepseek2 import DeepSeek2Config  # noqa: E402
from pocketmoe.specs.metadata import RopeScaling  # noqa: E402
from pocketmoe.tokenizer import Tokenizer  # noqa: E402
from pocketmoe.tokenizer.chat import DEEPSEEK_V2_CHAT_TEMPLATE  # noqa: E402
from pocketmoe.tokenizer.pretokenize import PRE_REGEXES  # noqa: E402

MODEL_NAME = "PocketMoE demo MoE"
PRE = "deepseek-llm"  # DeepSeek-V2's pre-tokenizer; llama.cpp and pocketmoe.tokenizer both split with it
SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜▁pad▁｜>")
BOS, EOS = SPECIALS[0], SPECIALS[1]
HELDOUT_EVERY = 20       # one source unit (module / topic) in 20 is held out, chosen by crc32 of its name
SAMPLE_NAME = "demo-model-heldout.json"
LOG_NAME = "demo-model-train.json"


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 1234
    vocab: int = 4096
    n_embd: int = 256
    n_layer: int = 5
    n_dense_lead: int = 1
    n_ff: int = 768              # the leading dense block
    n_head: int = 4
    qk_nope: int = 32
    qk_rope: int = 32
    v_head: int = 64
    kv_lora: int = 128
    n_expert: int = 16
    n_expert_used: int = 2
    n_expert_shared: int = 1
    n_ff_exp: int = 256          # a multiple of 256: ffn_down_exps rows must fit K-quant blocks
    seq_len: int = 512
    batch: int = 8
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    aux_loss: float = 0.003      # light load balancing: usage stays skewed, no expert dies
    chat_repeat: int = 2         # the Q/A pairs are short; show them twice per epoch
    eval_every: int = 50
    eval_tokens: int = 16384
    threads: int = 2


# --------------------------------------------------------------------------------------------------
# corpus


@dataclass
class Doc:
    unit: str        # the module or topic it came from (the unit of the train / held-out split)
    name: str        # what it documents: "json.dumps", "json", "for" (a topic)
    kind: str        # "module" | "class" | "function" | "topic"
    head: str        # first line of the document ("json.dumps(obj, *, skipkeys=False, ...)")
    body: str        # the docstring / topic text


_SIG_LINE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$")


def _clean(doc: str) -> str:
    lines = [ln.rstrip() for ln in inspect.cleandoc(doc).splitlines()]
    text = "\n".join(lines).strip()
    return re.sub(r"\n{3,}", "\n\n", text)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    try:
        args = ast.unparse(node.args)
    except Exception:  # noqa: BLE001 - odd syntax: leave the arguments out
        args = "..."
    return f"({args})" if len(args) <= 100 else "(...)"


def _ast_docs(root: Path) -> list[Doc]:
    docs: list[Doc] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("site-packages", "dist-packages") or any(
                p in ("test", "tests", "idle_test", "__pycache__") or p.startswith("config-") for p in rel.parts):
            continue
        mod = ".".join(rel.with_suffix("").parts)
        if mod.endswith(".__init__"):
            mod = mod[: -len(".__init__")]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        unit = mod
        if (d := ast.get_docstring(tree)) and not mod.startswith("_"):
            docs.append(Doc(unit, mod, "module", f"The {mod} module", _clean(d)))

        def walk(body: list[ast.stmt], prefix: str, unit: str) -> None:
            for node in body:
                if isinstance(node, ast.ClassDef):
                    qual = f"{prefix}.{node.name}"
                    if node.name.startswith("_"):
                        continue
                    if d := ast.get_docstring(node):
                        bases = ", ".join(ast.unparse(b) for b in node.bases)
                        docs.append(Doc(unit, qual, "class", f"class {qual}" + (f"({bases})" if bases else ""),
                                        _clean(d)))
                    walk(node.body, qual, unit)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qual = f"{prefix}.{node.name}"
                    if node.name.startswith("_") and node.name != "__init__":
                        continue
                    if d := ast.get_docstring(node):
                        docs.append(Doc(unit, qual, "function", qual + _signature(node), _clean(d)))

        if not any(p.startswith("_") for p in mod.split(".")):
            walk(tree.body, mod, unit)
    return docs


def _builtin_docs() -> list[Doc]:
    """Docstrings of the modules written in C (builtins, math, itertools, ...), read by importing them."""
    dynload = Path(sysconfig.get_paths()["platstdlib"]) / "lib-dynload"
    names = set(sys.builtin_module_names) | {p.name.split(".")[0] for p in dynload.glob("*.so")}
    docs: list[Doc] = []
    for mod in sorted(n for n in names if not n.startswith("_") and n not in ("this", "antigravity")):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = importlib.import_module(mod)
        except Exception:  # noqa: BLE001 - a module this build lacks
            continue
        if (d := inspect.getdoc(m)) and m.__doc__:
            docs.append(Doc(mod, mod, "module", f"The {mod} module", _clean(d)))
        for name, obj in sorted(vars(m).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) not in (mod, None):
                continue
            qual = name if mod == "builtins" else f"{mod}.{name}"
            if inspect.isclass(obj):
                if obj.__doc__:
                    docs.append(Doc(mod, qual, "class", f"class {qual}", _clean(obj.__doc__)))
                for mname, meth in sorted(vars(obj).items()):
                    if mname.startswith("_") or not callable(meth) or not getattr(meth, "__doc__", None):
                        continue
                    sig = getattr(meth, "__text_signature__", None) or "(...)"
                    sig = sig.replace("($self, ", "(").replace("($self)", "()").replace("($type, ", "(")
                    docs.append(Doc(mod, f"{qual}.{mname}", "function", f"{qual}.{mname}{sig}",
                                    _clean(meth.__doc__)))
            elif inspect.isbuiltin(obj) and obj.__doc__:
                sig = (getattr(obj, "__text_signature__", None) or "(...)").replace("($module, ", "(")
                sig = sig.replace("($module)", "()")
                docs.append(Doc(mod, qual, "function", qual + sig, _clean(obj.__doc__)))
    return docs


def _topic_docs() -> list[Doc]:
    import pydoc_data.topics

    docs = []
    for key, text in sorted(pydoc_data.topics.topics.items()):
        text = _clean(text)
        lines = text.splitlines()
        if len(lines) > 2 and set(lines[1]) <= set("*=-") and lines[1]:
            head, body = lines[0], "\n".join(lines[2:]).strip()
        else:
            head, body = key, text
        docs.append(Doc(f"topic:{key}", key, "topic", head, body))
    return docs


def collect_docs() -> list[Doc]:
    """Every document, deduplicated by body, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out = []
    for d in _topic_docs() + _ast_docs(stdlib) + _builtin_docs():
        if len(d.body) < 20 or d.body in seen:
            continue
        seen.add(d.body)
        out.append(d)
    return out


def is_heldout(doc: Doc) -> bool:
    return zlib.crc32(doc.unit.encode()) % HELDOUT_EVERY == 0


def doc_text(doc: Doc) -> str:
    return f"{doc.head}\n\n{doc.body}"


def _first_paragraph(body: str) -> str | None:
    para = body.split("\n\n")[0].strip()
    if _SIG_LINE.match(para.splitlines()[0]):           # "S.strip([chars]) -> str": skip the signature
        rest = body.split("\n\n")
        para = rest[1].strip() if len(rest) > 1 else ""
    para = re.sub(r"\s+", " ", para)
    if (not 25 <= len(para) <= 500 or para.startswith((">>>", "..", "*", "-", ":")) or para.count("`") > 6
            or para.endswith(":")):
        return None
    return para


_QUESTIONS = {
    "function": ("What does {n}() do?", "What is {n}() for?", "Explain {n}().", "What does the {n} function do?"),
    "class": ("What is {n}?", "What is the {n} class?", "Explain the {n} class.", "What is {n} used for?"),
    "module": ("What is the {n} module?", "What does the {n} module do?", "Tell me about the {n} module.",
               "What is {n} for?"),
    "topic": ("What is {h}?", "Explain {h}.", "Tell me about {h}."),
}


def qa_pair(doc: Doc) -> tuple[str, str] | None:
    """A question about `doc` and its first paragraph as the answer (None when it makes a poor answer)."""
    answer = _first_paragraph(doc.body)
    if answer is None:
        return None
    forms = _QUESTIONS[doc.kind]
    form = forms[zlib.crc32(doc.name.encode()) % len(forms)]
    head = doc.head
    if doc.kind == "topic":
        head = head[0].lower() + head[1:] if head[:2] != head[:2].upper() else head
    return form.format(n=doc.name, h=head), answer


def chat_text(question: str, answer: str) -> str:
    """One exchange as DeepSeek-V2's chat template renders it (without the leading BOS)."""
    return f"User: {question}\n\nAssistant: {answer}{EOS}"


# --------------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: list[str], vocab: int) -> dict[str, object]:
    """A byte-level BPE vocabulary learned with `tokenizers` (split as DeepSeek's pre-tokenizer does),
    returned as the GGUF `tokenizer.*` keys."""
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    hf = HFTokenizer(BPE())
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated")
              for r in PRE_REGEXES[PRE]]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=list(SPECIALS),
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(texts, trainer=trainer)
    model = json.loads(hf.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    assert [i for _, i in by_id] == list(range(len(tokens)))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    while len(tokens) < vocab:  # a small corpus may run out of merges before the vocabulary is full
        tokens.append(f"<｜place▁holder▁no▁{len(tokens)}｜>")
    types = [3 if t in SPECIALS or t.startswith("<｜place") else 1 for t in tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": PRE,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index(BOS),
        "tokenizer.ggml.eos_token_id": tokens.index(EOS),
        "tokenizer.ggml.padding_token_id": tokens.index("<｜▁pad▁｜>"),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": DEEPSEEK_V2_CHAT_TEMPLATE,
    }


# --------------------------------------------------------------------------------------------------
# model: DeepSeek-V2's forward (SPECS.md 1.4) with HF DeepseekV2 parameter names, so that
# pocketmoe.testing.hf_map turns its state dict into GGUF tensors


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1), as llama.cpp's NORM rope on deepseek2's q_pe / k_pe."""
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def rope_tables(n_pos: int, dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv
    return ang.cos().float(), ang.sin().float()


class MLA(nn.Module):
    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.c = c
        qk = c.qk_nope + c.qk_rope
        self.q_proj = nn.Linear(c.n_embd, c.n_head * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.n_embd, c.kv_lora + c.qk_rope, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora)
        self.kv_b_proj = nn.Linear(c.kv_lora, c.n_head * (c.qk_nope + c.v_head), bias=False)
        self.o_proj = nn.Linear(c.n_head * c.v_head, c.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, t, _ = x.shape
        q_nope, q_pe = self.q_proj(x).view(b, t, c.n_head, -1).split([c.qk_nope, c.qk_rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora, c.qk_rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(b, t, c.n_head, -1)
        k_nope, v = kv.split([c.qk_nope, c.v_head], dim=-1)
        cs, sn = cos[:t, None, :], sin[:t, None, :]
        q = torch.cat([q_nope, rope(q_pe, cs, sn)], dim=-1)
        k = torch.cat([k_nope, rope(k_pe[:, :, None, :], cs, sn).expand(b, t, c.n_head, c.qk_rope)], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=1.0 / math.sqrt(c.qk_nope + c.qk_rope))
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class DenseMLP(nn.Module):
    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.up_proj = nn.Linear(dim, width, bias=False)
        self.down_proj = nn.Linear(width, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed experts stacked as HF's fused layout: gate_up_proj [E, 2F, D] (gate rows first), down [E, D, F]."""

    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(c.n_expert, 2 * c.n_ff_exp, c.n_embd))
        self.down_proj = nn.Parameter(torch.empty(c.n_expert, c.n_embd, c.n_ff_exp))


class MoE(nn.Module):
    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.c = c
        self.gate = nn.Linear(c.n_embd, c.n_expert, bias=False)
        self.experts = Experts(c)
        self.shared_experts = DenseMLP(c.n_embd, c.n_ff_exp * c.n_expert_shared)
        self.aux = torch.zeros(())
        self.last_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        shape = x.shape
        x = x.reshape(-1, c.n_embd)
        probs = self.gate(x).float().softmax(dim=-1)
        w, ids = probs.topk(c.n_expert_used, dim=-1)       # softmax, greedy top-k, not renormalised
        self.last_ids = ids.detach()
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=c.n_expert)
        src = order // c.n_expert_used
        xs = x[src]
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                g, u = (xs[start:start + n] @ self.experts.gate_up_proj[e].t()).chunk(2, dim=-1)
                outs.append((F.silu(g) * u) @ self.experts.down_proj[e].t())
                start += n
        y = torch.cat(outs) * w.reshape(-1)[order, None].to(x.dtype)
        out = torch.zeros_like(x).index_add(0, src, y) + self.shared_experts(x)
        if self.training:  # Switch-style balance term: E * sum_e (share of assignments) * (mean prob)
            frac = counts.float() / flat.numel()
            self.aux = c.n_expert * (frac * probs.mean(0)).sum()
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, c: TrainConfig, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.n_embd)
        self.self_attn = MLA(c)
        self.post_attention_layernorm = RMSNorm(c.n_embd)
        self.mlp = MoE(c) if moe else DenseMLP(c.n_embd, c.n_ff)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.n_embd)
        self.layers = nn.ModuleList([Block(c, i >= c.n_dense_lead) for i in range(c.n_layer)])
        self.norm = RMSNorm(c.n_embd)


class DemoMoE(nn.Module):
    def __init__(self, c: TrainConfig) -> None:
        super().__init__()
        self.c = c
        self.model = Inner(c)
        self.lm_head = nn.Linear(c.n_embd, c.vocab, bias=False)
        cos, sin = rope_tables(c.seq_len, c.qk_rope)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._init()

    def _init(self) -> None:
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.c.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                continue
            last = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
            nn.init.normal_(p, std=out_std if last in ("o_proj", "down_proj") else std)

    def moe_layers(self) -> list[MoE]:
        return [blk.mlp for blk in self.model.layers if isinstance(blk.mlp, MoE)]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        for blk in self.model.layers:
            h = blk(h, self.cos, self.sin)
        return self.lm_head(self.model.norm(h))


def gguf_config(c: TrainConfig, meta: dict[str, object]) -> DeepSeek2Config:
    return DeepSeek2Config(
        n_vocab=c.vocab, n_ctx=c.seq_len, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head, n_ff=c.n_ff,
        n_expert=c.n_expert, n_expert_used=c.n_expert_used, n_expert_shared=c.n_expert_shared,
        n_ff_exp=c.n_ff_exp, n_dense_lead=c.n_dense_lead, q_lora_rank=0, kv_lora_rank=c.kv_lora,
        qk_nope_head_dim=c.qk_nope, qk_rope_head_dim=c.qk_rope, v_head_dim=c.v_head, mla_layout="absorbed",
        gating_func=1, expert_weights_norm=False, expert_weights_scale=1.0, rms_eps=1e-6,
        rope_freq_base=10000.0, rope_scaling=RopeScaling(), mscale_all_dim=0.0,
        bos_token_id=int(meta["tokenizer.ggml.bos_token_id"]),  # type: ignore[call-overload]
        eos_token_id=int(meta["tokenizer.ggml.eos_token_id"]))  # type: ignore[call-overload]


# --------------------------------------------------------------------------------------------------
# GGUF export


def tensor_types(names: list[str]) -> dict[str, str]:
    """The quant mix: Q4_K expert gate/up, Q6_K expert down, shared/dense FFN and head; Q8_0 attention
    and embedding; F32 norms and router (as llama.cpp's converter keeps them)."""
    types = {}
    for n in names:
        if n.endswith(("_norm.weight", "ffn_gate_inp.weight")):
            types[n] = "F32"
        elif n.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            types[n] = "Q4_K"
        elif n.endswith(("ffn_down_exps.weight", "_shexp.weight", "output.weight")) or ".ffn_" in n:
            types[n] = "Q6_K"
        else:  # token_embd, attn_q, attn_kv_a_mqa, attn_k_b, attn_v_b, attn_output
            types[n] = "Q8_0"
    return types


def export_gguf(model: DemoMoE, tok_meta: dict[str, object], out: Path, general: dict[str, str]) -> Path:
    from gguf import GGMLQuantizationType, GGUFValueType

    from pocketmoe.quant.quantize import quantize
    from pocketmoe.testing.hf_map import hf_deepseek2_to_gguf_state_dict
    from pocketmoe.testing.quant_mix import quant_mix
    from pocketmoe.testing.synth import QUANTIZATION_VERSION, spec_for
    from pocketmoe.testing.writer import TensorPlan, write_gguf

    config = gguf_config(model.c, tok_meta)
    state = hf_deepseek2_to_gguf_state_dict(model, config)
    specs = [s for s in spec_for("deepseek2", config).tensors(state.keys()) if s.name in state]
    assert {s.name for s in specs} == set(state), "the state dict does not match the deepseek2 spec"
    types = tensor_types([s.name for s in specs])
    plans = [TensorPlan(s.name, s.shape, int(GGMLQuantizationType[types[s.name]])) for s in specs]
    for p in plans:
        assert tuple(state[p.name].shape) == p.shape, (p.name, state[p.name].shape, p.shape)
    meta: dict[str, object] = {"general.type": ("model", GGUFValueType.STRING)}
    meta |= {k: (v, GGUFValueType.STRING) for k, v in general.items()}
    meta |= {k: v for k, v in metadata_from_config("deepseek2", config).items() if k != "general.architecture"}
    meta["general.file_type"] = (int(quant_mix("Q4_K_M").file_type), GGUFValueType.UINT32)
    meta["general.quantization_version"] = (QUANTIZATION_VERSION, GGUFValueType.UINT32)
    meta |= tok_meta

    def chunks(p: TensorPlan):
        rows = state[p.name].reshape(-1, p.shape[-1]).numpy()
        if p.ggml_type == int(GGMLQuantizationType.F32):
            yield np.ascontiguousarray(rows, dtype=np.float32)
        else:
            yield quantize(np.ascontiguousarray(rows, dtype=np.float32), p.ggml_type)

    return write_gguf(out, "deepseek2", meta, plans, chunks)[0]


# --------------------------------------------------------------------------------------------------
# training


def encode_all(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [tok.encode(t, add_bos=True) + [tok.eos_id] if not t.endswith(EOS) else tok.encode(t, add_bos=True)
            for t in texts]


def build_streams(docs: list[Doc], tok: Tokenizer, c: TrainConfig
                  ) -> tuple[torch.Tensor, torch.Tensor, list[str], dict]:
    """The training stream (documents and Q/A exchanges, shuffled), the held-out stream and texts."""
    train_texts, held_texts = [], []
    n_chat = [0, 0]
    for d in docs:
        held = is_heldout(d)
        (held_texts if held else train_texts).append(doc_text(d))
        if qa := qa_pair(d):
            for _ in range(1 if held else c.chat_repeat):
                (held_texts if held else train_texts).append(chat_text(*qa))
            n_chat[held] += 1
    rng = random.Random(c.seed)
    rng.shuffle(train_texts)
    rng.shuffle(held_texts)
    train = [t for seq in encode_all(tok, train_texts) for t in seq]
    held = [t for seq in encode_all(tok, held_texts) for t in seq]
    stats = {"train_docs": len(train_texts), "heldout_docs": len(held_texts), "train_qa_pairs": n_chat[0],
             "heldout_qa_pairs": n_chat[1], "train_tokens": len(train), "heldout_tokens": len(held),
             "train_chars": sum(map(len, train_texts)), "heldout_chars": sum(map(len, held_texts))}
    return torch.tensor(train), torch.tensor(held), held_texts, stats


@torch.no_grad()
def evaluate(model: DemoMoE, stream: torch.Tensor, c: TrainConfig) -> float:
    model.eval()
    n = min(len(stream) - 1, c.eval_tokens) // c.seq_len * c.seq_len
    x = stream[:n + 1]
    total = 0.0
    for i in range(0, n, c.seq_len * c.batch):
        starts = range(i, min(n, i + c.seq_len * c.batch), c.seq_len)
        inp = torch.stack([x[s:s + c.seq_len] for s in starts])
        tgt = torch.stack([x[s + 1:s + 1 + c.seq_len] for s in starts])
        total += F.cross_entropy(model(inp).flatten(0, 1), tgt.flatten(), reduction="sum").item()
    model.train()
    return total / n


def lr_at(step: int, steps: int, c: TrainConfig) -> float:
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    t = (step - c.warmup) / max(1, steps - c.warmup)
    return c.lr * (c.min_lr_frac + (1 - c.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def train(model: DemoMoE, train_stream: torch.Tensor, held_stream: torch.Tensor, c: TrainConfig, steps: int,
          log: dict, max_minutes: float) -> None:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=c.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(c.seed + 1)
    t0 = time.perf_counter()
    running = 0.0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, c)
        starts = torch.randint(0, len(train_stream) - c.seq_len - 1, (c.batch,), generator=gen)
        idx = starts[:, None] + torch.arange(c.seq_len + 1)
        batch = train_stream[idx]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        aux = torch.stack([m.aux for m in model.moe_layers()]).mean()
        opt.zero_grad(set_to_none=True)
        (loss + c.aux_loss * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % c.eval_every == 0 or step + 1 == steps:
            k = (step + 1) % c.eval_every or c.eval_every
            held = evaluate(model, held_stream, c)
            elapsed = time.perf_counter() - t0
            log["curve"].append({"step": step + 1, "tokens": (step + 1) * c.batch * c.seq_len,
                                 "train_loss": running / k, "heldout_loss": held, "aux": aux.item(),
                                 "seconds": round(elapsed, 1)})
            print(f"step {step + 1:5d}/{steps}  train {running / k:.3f}  held-out {held:.3f}  "
                  f"aux {aux.item():.3f}  lr {lr_at(step, steps, c):.2e}  {elapsed / 60:.1f} min", flush=True)
            running = 0.0
            if elapsed > 60 * max_minutes and step + 1 < steps:
                print(f"stopping at step {step + 1}: past --max-minutes {max_minutes}", flush=True)
                log["stopped_early_at"] = step + 1
                break


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "pocketmoe" / "data" / "demo-model.gguf")
    p.add_argument("--steps", type=int, default=720, help="optimizer steps (the schedule spans them)")
    p.add_argument("--max-minutes", type=float, default=48.0,
                   help="stop training early past this (the log says so; the file then differs)")
    p.add_argument("--checkpoint", type=Path, help="save the float weights here after training")
    p.add_argument("--resume", type=Path, help="skip training: load float weights saved by --checkpoint")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a TrainConfig field (for experiments)")
    args = p.parse_args(argv)
    c = TrainConfig()
    for kv in args.set:
        k, v = kv.split("=", 1)
        c = replace(c, **{k: type(getattr(c, k))(v)})
    torch.manual_seed(c.seed)
    random.seed(c.seed)
    np.random.seed(c.seed)
    torch.set_num_threads(c.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    t_start = time.perf_counter()

    docs = collect_docs()
    tok_meta = train_tokenizer([doc_text(d) for d in docs if not is_heldout(d)]
                               + [chat_text(*qa) for d in docs if not is_heldout(d) and (qa := qa_pair(d))],
                               c.vocab)
    tok = Tokenizer.from_metadata(tok_meta)
    train_stream, held_stream, held_texts, stats = build_streams(docs, tok, c)
    print(f"corpus: {json.dumps(stats)}  ({time.perf_counter() - t_start:.0f} s)", flush=True)

    model = DemoMoE(c)
    n_params = sum(p.numel() for p in model.parameters())
    log: dict = {"config": asdict(c), "steps": args.steps, "corpus": stats, "params": n_params, "curve": []}
    print(f"model: {n_params / 1e6:.1f}M parameters", flush=True)
    if args.resume:
        saved = torch.load(args.resume)
        model.load_state_dict(saved["model"])
        log = saved["log"]
    else:
        train(model, train_stream, held_stream, c, args.steps, log, args.max_minutes)
        log["train_seconds"] = round(time.perf_counter() - t_start, 1)
        if args.checkpoint:
            torch.save({"model": model.state_dict(), "log": log}, args.checkpoint)
    model.eval()
    for prompt in ("The json module", "User: What does the json module do?\n\nAssistant:"):
        ids = tok.encode(prompt)
        with torch.no_grad():
            for _ in range(40):
                ids.append(int(model(torch.tensor([ids[-c.seq_len:]]))[0, -1].argmax()))
        print(f"sample: {tok.decode(ids)!r}", flush=True)
    train_s = log["train_seconds"]
    held = evaluate(model, held_stream, replace(c, eval_tokens=len(held_stream)))
    log |= {"heldout_loss_final": held, "heldout_ppl_final": math.exp(held),
            "python": platform.python_version(), "torch": torch.__version__}
    print(f"held-out loss {held:.3f} (perplexity {math.exp(held):.1f}) after {train_s / 60:.1f} min", flush=True)

    general = {
        "general.name": MODEL_NAME,
        "general.description": (
            f"A {n_params / 1e6:.0f}M-parameter DeepSeek-V2-shaped MoE ({c.n_layer} blocks, {c.n_expert} "
            f"routed experts, top-{c.n_expert_used}) trained from scratch by PocketMoE's "
            f"scripts/train_demo_model.py on the CPU ({log['curve'][-1]['step']} steps of {c.batch}x{c.seq_len} tokens, "
            f"{train_s / 60:.0f} min) on the docstrings and pydoc topics of Python "
            f"{platform.python_version()}'s standard library, plus question/answer pairs made from them. "
            "A demo of the engine, not a useful assistant."),
        "general.license": "PSF-2.0",
        "general.license.name": "Python Software Foundation License Version 2 (training text)",
        "general.source.url": "https://docs.python.org/3/license.html",
        "general.organization": "PocketMoE",
        "general.size_label": f"{c.n_expert}x{c.n_ff_exp}",
    }
    out = export_gguf(model, tok_meta, args.out, general)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)", flush=True)
    log_path = out.with_name(LOG_NAME)
    log["total_seconds"] = round(time.perf_counter() - t_start, 1)
    log_path.write_text(json.dumps(log, indent=1) + "\n")
    sample, n = [], 0
    for text in held_texts:  # about 4000 tokens of held-out text for the tests' perplexity check
        sample.append(text)
        n += len(tok.encode(text))
        if n >= 4000:
            break
    out.with_name(SAMPLE_NAME).write_text(json.dumps(sample, indent=0, ensure_ascii=False) + "\n")
    print(f"wrote {log_path} and {out.with_name(SAMPLE_NAME)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
