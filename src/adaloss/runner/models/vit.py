"""A small Vision Transformer (Dosovitskiy et al. 2021) for the image datasets: ``model=vit``.

``patch_embed`` (a ``patch x patch`` convolution with stride ``patch``: one GEMM per patch) -> flatten to
``[B, N, dim]`` tokens, ``N = (image_size / patch)^2`` -> ``+ pos_embed`` (learned) -> ``blocks.<i>``
(the pre-norm blocks of :mod:`adaloss.runner.models.gpt`, with ``causal=False``) -> ``norm`` -> mean over the
tokens -> ``head``. Mean pooling replaces the class token: one parameter and one concatenation fewer, about
the same accuracy at this size (Beyer et al. 2022, "Better plain ViT baselines").

Built from the same parts as the GPT, for the same reason: every weight GEMM is a conv or linear module and
attention is ``F.scaled_dot_product_attention``, so torch.fx traces it and the adaptive scaler rewrites it
(torchvision's ``VisionTransformer`` uses ``nn.MultiheadAttention``, whose packed projections are not
modules). Defaults fit 32x32 inputs on a CPU: 4x4 patches (64 tokens), width 64, 4 blocks of 4 heads, about
0.2M parameters. Init: truncated normal(0.02) for linear weights and the position embedding, zero biases,
the patch convolution as a linear layer (fan-in scaled).
"""

from __future__ import annotations

import torch
from torch import nn

from adaloss.errors import ConfigError
from adaloss.runner.models.gpt import Block

__all__ = ["ViT"]


class ViT(nn.Module):
    """Images ``[B, in_channels, image_size, image_size]`` -> logits ``[B, num_classes]``.

    ``num_classes``, ``in_channels`` and ``image_size`` come from the dataset when the config does not set
    them (see :func:`adaloss.runner.models.build_model`); ``patch`` must divide ``image_size``.
    """

    def __init__(
        self,
        num_classes: int,
        image_size: int = 32,
        in_channels: int = 3,
        patch: int = 4,
        dim: int = 64,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for key, value in (("patch", patch), ("dim", dim), ("depth", depth), ("heads", heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{key} must be a positive integer, got {value!r}")
        if image_size % patch:
            raise ConfigError(
                f"model.patch={patch} does not divide the {image_size}x{image_size} images: choose a "
                "divisor, "
                f"e.g. model.patch={next(p for p in (4, 2, 1) if image_size % p == 0)}"
            )
        if dim % heads:
            raise ConfigError(f"model.dim={dim} must be a multiple of model.heads={heads}")
        tokens = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch, stride=patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, dim))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(dim, heads, dropout, bias=True, causal=False, mlp_hidden=mlp_ratio * dim)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        nn.init.kaiming_normal_(self.patch_embed.weight.view(dim, -1), mode="fan_in", nonlinearity="linear")
        nn.init.zeros_(self.patch_embed.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, dim, H/p, W/p] -> [B, N, dim]
        x = self.drop(x + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))  # mean over the N tokens
