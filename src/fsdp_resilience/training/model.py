"""A GPT-style decoder (Llama-shaped): pre-norm RMSNorm, RoPE, causal SDPA attention, SwiGLU MLP.

Byte-level vocabulary (256); untied input embedding and output head (as Llama). Optional dropout
(nanoGPT's places: after the embedding, on attention weights, on each residual branch) is drawn
from the global torch RNG in train mode only; ``eval()`` turns it off. Parameter names
follow torchtitan's Llama (``tok_embeddings``, ``blocks.N.attention.wq``, ``feed_forward.w1``...),
and are never renamed by parallelisation (activation checkpointing is a flag on each block, not a
wrapper module), so checkpoints load the same with or without it.

Deterministic init: ``init_weights(seed)`` draws every parameter from its own generator, seeded
from ``(seed, parameter name)``, as the *full* tensor, and keeps the local shard when the
parameter is an FSDP2 DTensor. So the full weights are bitwise the same at any world size and in
any module order (for one device type: CPU and CUDA generators differ).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

# The shapes and sizes are the contract's (torch-free: the control plane sizes pods from them).
from fsdp_resilience.training.contract.model_sizes import (  # noqa: F401  (re-exported)
    BYTE_VOCAB,
    GPU_OVERHEAD_BYTES,
    PRESET_RUNS,
    PRESETS,
    ModelConfig,
    PresetRun,
    memory_per_gpu,
    param_count,
)

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 params: the mean of squares loses precision in bf16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, [max_seq_len, head_dim // 2], fp32."""
    exponents = torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta**exponents)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [B, T, H, D] by position; cos/sin are [T, D/2]."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.dropout = cfg.dropout
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.residual_dropout = nn.Dropout(cfg.dropout)
        # Set by fsdp_resilience.training.parallelize: recompute this block's activations in backward.
        self.activation_checkpointing = False

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.residual_dropout(self.attention(self.attention_norm(x), cos, sin))
        return h + self.residual_dropout(self.feed_forward(self.ffn_norm(h)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            # The recomputation replays the forward's RNG state (preserve_rng_state), so dropout
            # masks match.
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.embedding_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Not persistent: derived from cfg, so not in checkpoints; init_weights() refills them
        # (after to_empty() they hold garbage).
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: LongTensor [B, T] -> logits [B, T, vocab_size]."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.embedding_dropout(self.tok_embeddings(tokens))
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Fill the derived (non-checkpointed) buffers: all a model needs after ``to_empty()``
        when a checkpoint is about to fill every parameter."""
        cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Fill every parameter and buffer deterministically; see the module docstring.

        ``seed=None`` uses ``torch.initial_seed()`` (the last ``torch.manual_seed``)."""
        base_seed = torch.initial_seed() if seed is None else int(seed)
        self.init_buffers()
        # GPT-2 style: residual output projections scaled down with depth.
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            name = canonical_name(name)
            if name.endswith("norm.weight"):
                full = torch.ones(param.shape, device=param.device, dtype=param.dtype)
            else:
                std = residual_std if name.endswith(("wo.weight", "w2.weight")) else INIT_STD
                gen = torch.Generator(device=param.device).manual_seed(name_seed(base_seed, name))
                full = torch.empty(param.shape, device=param.device, dtype=torch.float32)
                full.normal_(0.0, std, generator=gen)
            _copy_full_into(param, full)


def canonical_name(name: str) -> str:
    """A parameter's name without wrapper prefixes (torch.compile, checkpoint_wrapper)."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def name_seed(base_seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, parameter name): not Python's salted hash()."""
    digest = hashlib.sha256(f"{base_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor, so each just keeps its own
        # shard; no communication.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


def build_model(preset: str, device: torch.device | str = "meta", **overrides) -> GPT:
    """A GPT for ``preset`` (optionally with ModelConfig fields overridden, e.g. max_seq_len).

    On "meta" nothing is allocated: shard it, ``to_empty()``, then ``init_weights()``. On a real
    device the weights are initialised at once with ``torch.initial_seed()``.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; use one of {', '.join(PRESETS)}")
    cfg = dataclasses.replace(PRESETS[preset], **overrides)
    with torch.device(device):
        model = GPT(cfg)
    if torch.device(device).type != "meta":
        model.init_weights()
    return model


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss; logits [B, T, V] (any float dtype, upcast to fp32), targets [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
