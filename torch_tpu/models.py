"""Small reference models used by the main job, the tests and the benchmarks.

Everything here is plain PyTorch and device-agnostic: build a model under
``torch.manual_seed(s)`` (its initialisation is deterministic), then move it
with ``.to(device)``. :func:`train_steps` runs a short training loop on any
device, optionally under ``torch.autocast``.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MLP", "GPT", "CNN", "train_steps"]


# --------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """Two hidden layers: Linear -> act -> Linear -> act -> Linear."""

    def __init__(self, in_dim: int = 32, hidden: int = 64, out_dim: int = 10, act: str = "gelu"):
        super().__init__()
        act_cls = {"gelu": nn.GELU, "relu": nn.ReLU}[act]
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden),
            act_cls(),
            nn.Linear(hidden, hidden),
            act_cls(),
            nn.Linear(hidden, out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# --------------------------------------------------------------------- GPT


def _norm(kind: str, dim: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-5)
    raise ValueError(f"unknown norm {kind!r}; choose 'layernorm' or 'rmsnorm'")


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class FeedForward(nn.Module):
    def __init__(self, n_embd: int, dropout: float, act: str):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = {"gelu": nn.GELU, "silu": nn.SiLU}[act]()
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, norm: str, act: str):
        super().__init__()
        self.ln1 = _norm(norm, n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = _norm(norm, n_embd)
        self.mlp = FeedForward(n_embd, dropout, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """A small decoder-only transformer (pre-norm, causal SDPA attention)."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.1,
        norm: str = "layernorm",
        act: str = "gelu",
        tie_weights: bool = True,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, norm, act) for _ in range(n_layer))
        self.ln_f = _norm(norm, n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2 style scaled init of the residual projections.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        greedy: bool = True,
        temperature: float = 1.0,
        generator: Optional[torch.Generator] = None,
    ) -> torch.Tensor:
        """Appends ``max_new_tokens`` tokens to ``idx`` (B, T) and returns it."""
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                ctx = idx[:, -self.block_size:]
                logits, _ = self(ctx)
                logits = logits[:, -1, :]
                if greedy:
                    nxt = torch.argmax(logits, dim=-1, keepdim=True)
                else:
                    probs = F.softmax(logits / temperature, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=generator)
                idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        return idx


# --------------------------------------------------------------------- CNN


class CNN(nn.Module):
    """Two conv blocks (conv -> BatchNorm -> ReLU -> MaxPool), global average
    pool and a linear classifier. Input: (B, 3, H, W) with H, W >= 4."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.fc(torch.flatten(x, 1))


# --------------------------------------------------------------- training


def _loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Optional[Callable]) -> torch.Tensor:
    out = model(x, y) if isinstance(model, GPT) else model(x)
    if isinstance(out, tuple):  # (logits, loss) models such as GPT
        logits, loss = out
        if loss is not None and loss_fn is None:
            return loss
        out = logits
    fn = loss_fn or F.cross_entropy
    if out.dim() > 2:
        return fn(out.reshape(-1, out.size(-1)), y.reshape(-1))
    return fn(out, y)


def train_steps(
    model: nn.Module,
    batches: Iterable[Tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    steps: int,
    clip: Optional[float] = 1.0,
    autocast_dtype: Optional[torch.dtype] = None,
    device: Union[str, torch.device, None] = None,
    loss_fn: Optional[Callable] = None,
    callback: Optional[Callable[[int, torch.Tensor], None]] = None,
) -> List[float]:
    """Runs ``steps`` optimizer steps and returns the losses as floats.

    ``batches`` yields (x, y) pairs (they are moved to ``device``; default: the
    device of the model's first parameter). GPT models return their own loss;
    other models use ``loss_fn`` (default ``F.cross_entropy``). ``clip`` is the
    max gradient norm (None disables clipping). ``autocast_dtype`` (e.g.
    ``torch.bfloat16``) runs forward passes under ``torch.autocast``.
    ``callback(step, loss_tensor)`` is called after each step.
    """
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    model.train()
    losses: List[torch.Tensor] = []
    it = iter(batches)
    for step in range(steps):
        x, y = next(it)
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        if autocast_dtype is not None:
            with torch.autocast(device_type=device.type, dtype=autocast_dtype):
                loss = _loss_of(model, x, y, loss_fn)
        else:
            loss = _loss_of(model, x, y, loss_fn)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        loss = loss.detach()
        losses.append(loss)
        if callback is not None:
            callback(step, loss)
    # Host reads only at the end keep the loop asynchronous on the device.
    return [float(v) for v in losses]
