"""Fixed-size, preallocated cache of MLA latents: [n_layer, max_ctx, C+R] per sequence.

Legend: L layers, P cache positions, W latent width (kv_lora_rank + rope dims; 576 for V2-Lite).
"""

from __future__ import annotations

import torch

from pocketmoe.errors import PocketMoEError


class ContextLengthError(PocketMoEError):
    """A request needs more positions than the context the engine was built with."""


class LatentKVCache:
    def __init__(self, n_layer: int, max_ctx: int, width: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if max_ctx <= 0:
            raise ContextLengthError(f"the context length must be > 0 tokens, got {max_ctx}.")
        self.max_ctx = max_ctx
        self.data = torch.zeros(n_layer, max_ctx, width, dtype=dtype, device=device)  # [L, P, W]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def check_fits(self, n_prompt: int, max_tokens: int = 0) -> None:
        """ContextLengthError unless prompt + max_tokens fits in the context."""
        if n_prompt + max_tokens > self.max_ctx:
            raise ContextLengthError(
                f"the prompt has {n_prompt} tokens and {max_tokens} more were requested, "
                f"{n_prompt + max_tokens} in all, but the context holds {self.max_ctx}; "
                f"shorten the prompt, lower max_tokens or raise n_ctx.")

    def update(self, layer: int, start: int, latent: torch.Tensor) -> torch.Tensor:
        """latent [T, W] written at positions start..start+T-1; returns positions [0, start+T) as [S, W]."""
        end = start + latent.shape[0]
        if end > self.max_ctx:
            raise ContextLengthError(
                f"position {end - 1} is past the context of {self.max_ctx} tokens; raise n_ctx.")
        self.data[layer, start:end] = latent  # converts to the cache dtype
        out = self.data[layer, :end]
        return out if out.dtype == torch.float32 else out.float()
