"""The demo's model: a small GPT-style transformer, split into pipeline stages.

The real CPU compute is tiny on purpose; the simulated GPU (see `emulation`) supplies the
time and power a real stage of a large model would take. The first stage holds the token
and position embeddings, the last the final norm and the language-model head, as in real
pipeline partitions.
"""

from __future__ import annotations

import torch
from torch import nn

from perseus.demo.config import ModelConfig
from perseus.exceptions import ConfigError


class Block(nn.Module):
    """One pre-norm transformer block with causal self-attention."""

    causal_mask: torch.Tensor  # a buffer (register_buffer in __init__)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, config.num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        mask = torch.triu(torch.ones(config.seq_len, config.seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        n = x.shape[1]
        x = x + self.attn(h, h, h, attn_mask=self.causal_mask[:n, :n], need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class StageModel(nn.Module):
    """The layers of one pipeline stage: [embeddings] blocks [norm + head]."""

    def __init__(self, config: ModelConfig, stage: int, num_stages: int) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ConfigError(f"stage {stage} is out of range for {num_stages} stages (use 0..{num_stages - 1})")
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        d = config.d_model
        if self.is_first:
            self.tok_emb = nn.Embedding(config.vocab_size, d)
            self.pos_emb = nn.Embedding(config.seq_len, d)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers_per_stage))
        if self.is_last:
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, config.vocab_size)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok_emb(tokens) + self.pos_emb(positions)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def head_out(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.embed(x)
        x = self.body(x)
        return self.head_out(x) if self.is_last else x

    def example_input(self, config: ModelConfig, microbatch_size: int) -> torch.Tensor:
        """A tensor shaped like this stage's input (static pipeline metadata: no shape inference)."""
        if self.is_first:
            return torch.zeros(microbatch_size, config.seq_len, dtype=torch.long)
        return torch.zeros(microbatch_size, config.seq_len, config.d_model, requires_grad=True)

    def example_output(self, config: ModelConfig, microbatch_size: int) -> torch.Tensor:
        width = config.vocab_size if self.is_last else config.d_model
        return torch.zeros(microbatch_size, config.seq_len, width, requires_grad=True)


def build_stage(config: ModelConfig, stage: int, num_stages: int, seed: int) -> StageModel:
    """Stage `stage` of the model, with weights that depend only on (seed, stage)."""
    torch.manual_seed(seed * 1000 + stage)
    return StageModel(config, stage, num_stages)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (the schedule's loss function on the last stage)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(config: ModelConfig, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed, seeded batch of token sequences and their next-token targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
