"""The decoder stack every architecture here shares: embed, then per block an attention sublayer and an
FFN or MoE sublayer (each closing with the residual update and the next norm), then the head.

A model file (deepseek2.py, minimax_m2.py) binds the blocks to its tensors; the math of each sublayer is
its layer's (MLAttention, GQAttention, MoEBlock, GatedMLP) over the ops.

Legend: T tokens of the step, D hidden, V vocab, L tokens that need logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pocketmoe.layers.linear import QuantEmbedding, QuantLinear
from pocketmoe.layers.norm import Residual
from pocketmoe.layers.rotary import Rotary

if TYPE_CHECKING:
    from pocketmoe.engine.step import StepContext

# make_linear(name, role=None) -> the weight bound to that tensor (role: the spec's, unless given)
LinearFactory = Callable[..., QuantLinear]


def _take(x: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    return x if len(rows) == len(x) else x[torch.from_numpy(rows).long().to(x.device)].contiguous()


def finish_step(ctx: StepContext, x: torch.Tensor, normed: Callable[[torch.Tensor], torch.Tensor],
                head: Callable[[torch.Tensor], torch.Tensor], vocab: int) -> torch.Tensor:
    """The end of every model's step: the final hidden states of ctx.hidden_rows (normed(x): the head's input) into
    ctx.hidden, on the host; the logits [L, V] of ctx.logit_rows (head(normed(x)))."""
    if len(ctx.hidden_rows):
        ctx.hidden = normed(_take(x, ctx.hidden_rows)).float().cpu()
    rows = ctx.logit_rows
    if len(rows) == 0:
        return x.new_zeros(0, vocab)
    return head(normed(_take(x, rows)))


class DecoderBlock:
    def __init__(self, attn_norm: torch.Tensor, attn: Any, ffn_norm: torch.Tensor, ffn: Any) -> None:
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn


class LayeredModel:
    """What the runner reads of any model: its blocks and its head."""

    blocks: list[Any]
    head: QuantLinear

    @property
    def n_layer(self) -> int:
        return len(self.blocks)

    @property
    def vocab_size(self) -> int:
        return self.head.out_features


class DecoderModel(LayeredModel):
    def __init__(self, cfg: Any, ops: Any, embed: QuantEmbedding, blocks: list[DecoderBlock],
                 norm: torch.Tensor, head: QuantLinear, rotary: Rotary) -> None:
        self.cfg, self.ops = cfg, ops
        self.embed, self.blocks, self.norm, self.head, self.rotary = embed, blocks, norm, head, rotary

    def prepare(self, ctx: StepContext) -> None:
        """What the step's ops read besides the weights: the rope tables of its positions."""
        ctx.cos2, ctx.sin2 = self.rotary.span(*ctx.contiguous) if ctx.contiguous else self.rotary.at(ctx.positions)

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        """logits [L, V] float32 of the step's tokens that need them; writes every token's cache rows."""
        ops, eps = self.ops, self.cfg.rms_eps
        self.prepare(ctx)
        x, = ops.enter_layer(0, ops.embed(self.embed, ctx.tokens))  # [T, D], the residual stream (updated in place)
        xn = ops.rms_norm(x, self.blocks[0].attn_norm, eps)
        for i, block in enumerate(self.blocks):
            x, xn = ops.enter_layer(i, x, xn)  # a model split over GPUs: the stream moves to the layer's device
            xn = block.attn(xn, ctx, i, Residual(x, block.ffn_norm, eps))
            last = i + 1 == len(self.blocks)
            xn = block.ffn(xn, Residual(x, None if last else self.blocks[i + 1].attn_norm, eps))
        return finish_step(ctx, ops.enter_head(x), lambda h: ops.rms_norm(h, self.norm, eps), self.head,
                           self.vocab_size)
