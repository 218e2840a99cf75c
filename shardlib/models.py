"""The models every lesson and test shares: an MLP and a small GPT, deterministic from a seed.

Both are plain torch.nn modules, small enough to train on CPU ranks in seconds and
shaped so that every technique in the course has something to split:

- `MLP`: Linear -> GELU -> Linear blocks; the simplest thing to shard.
- `GPT`: a decoder-only transformer (GPT-2 layout, pre-LayerNorm) with separate
  q/k/v/o projections and a two-layer MLP per block, so that tensor parallelism can
  split heads and MLP columns without unpacking fused weights.

Parameter count of the GPT (h = n_embd, L = n_layer, V = vocab_size, T = seq_len,
biases and LayerNorms included):

    Psi = V*h + T*h + L*(12*h^2 + 12*h) + 2*h + h*V        (untied output head; tie_embeddings: no h*V)

The key projection has no bias: q . (k + b) shifts every score of a query's row by the same
q . b, which softmax ignores, so that bias would get an exactly zero gradient (its computed
gradient is rounding noise). Per block: q, k, v, o weights 4h^2, MLP 8h^2, biases of q, v, o 3h,
MLP 5h, two LayerNorms 4h. With n_experts = E > 0 every block's MLP is a mixture of experts
(shardlib/parallel/experts.py): E MLPs of 8h^2 + 5h and a router of h*E, adding L*((E-1)(8h^2 + 5h) + h*E).
With grouped-query attention (n_kv_head < n_head key/value heads of h/n_head each,
h_kv = n_kv_head * h/n_head) the k and v weights are h*h_kv and the v bias h_kv: each block has
(2h + 1)(h - h_kv) parameters fewer.

`text_batches` turns the course text in shardlib/data/ into (inputs, targets) byte batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardlib.parallel.experts import MoE
from shardlib.resources import data_path

DATA_DIR = data_path()  # shardlib/data, shipped inside the package (shardlib.resources)
COURSE_TEXT = data_path("course_text.txt")


# ---------------------------------------------------------------------------------
# MLP


class MLP(nn.Module):
    """x -> [Linear(d, hidden) -> GELU -> Linear(hidden, d)] * n_blocks -> Linear(d, n_out)."""

    def __init__(self, d_in: int = 32, hidden: int = 64, n_blocks: int = 2, n_out: int = 8):
        super().__init__()
        self.d_in = d_in
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, d_in)) for _ in range(n_blocks)
        )
        self.head = nn.Linear(d_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, d_in)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)  # (B, n_out)


def build_mlp(seed: int = 0, **sizes) -> MLP:
    torch.manual_seed(seed)
    return MLP(**sizes)


def mlp_batch(batch_size: int, d_in: int = 32, n_out: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch (x, y) from a fixed random teacher, deterministic from `seed`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, d_in, generator=g)
    teacher = torch.randn(d_in, n_out, generator=torch.Generator().manual_seed(1234))
    y = torch.tanh(x @ teacher)
    return x, y


# ---------------------------------------------------------------------------------
# GPT


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    # grouped-query attention (Ainslie et al., arXiv 2305.13245): n_kv_head key/value heads, each shared by
    # n_head / n_kv_head query heads; None: n_head (multi-head attention). The KV cache shrinks by n_head / n_kv_head
    n_kv_head: int | None = None
    # mixture of experts (shardlib/parallel/experts.py): 0 = the dense MLP; else n_experts expert
    # MLPs of 4h, top_k per token, capacity_factor, and the load-balancing loss added with aux_loss_coef
    n_experts: int = 0
    top_k: int = 1
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    # the output layer shares the embedding's (V, h) weight (GPT-2, GPT-3; Press and Wolf, arXiv 1608.05859)
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} (each key/value head "
                             f"serves n_head / n_kv_head query heads): use one of "
                             f"{[d for d in range(1, self.n_head + 1) if self.n_head % d == 0]}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads per layer: n_kv_head, or n_head without grouped-query attention."""
        return self.n_kv_head or self.n_head

    @property
    def n_params(self) -> int:
        """Psi from the formula in the module docstring."""
        h, L, V, T = self.n_embd, self.n_layer, self.vocab_size, self.seq_len
        moe = L * ((self.n_experts - 1) * (8 * h * h + 5 * h) + h * self.n_experts) if self.n_experts else 0
        gqa = L * (2 * h + 1) * (self.kv_heads * (h // self.n_head) - h)  # k, v weights and v bias shrink to h_kv
        head = 0 if self.tie_embeddings else h * V  # tied: the embedding's weight serves as the output layer
        return V * h + T * h + L * (12 * h * h + 12 * h) + 2 * h + head + moe + gqa  # moe: E MLPs and a router


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves n_rep consecutive query heads.
    (B, n_kv, T, hd) -> (B, n_kv * n_rep, T, hd)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        h = config.n_embd
        self.n_head, self.head_dim = config.n_head, h // config.n_head
        h_kv = config.kv_heads * self.head_dim  # grouped-query attention: fewer key/value heads than query heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, h), nn.Linear(h, h_kv, bias=False), nn.Linear(h, h_kv)
        self.o_proj = nn.Linear(h, h)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C); -1 so a head-split copy works too
        return self.o_proj(y)


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, 4C) -> (B, T, C)
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MoE(config.n_embd, config.n_experts, config.top_k, config.capacity_factor) \
            if config.n_experts else FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one (V, h) Parameter, input and output
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("o_proj.weight", "mlp.proj.weight", "mlp.w2")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx: (B, T) token ids -> logits (B, T, V); with targets also the mean cross-entropy."""
        B, T = idx.shape
        if T > self.config.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.config.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        if self.config.n_experts:  # each MoE layer's load-balancing loss (Switch, arXiv 2101.03961)
            loss = loss + self.config.aux_loss_coef * sum(block.mlp.aux_loss for block in self.blocks)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: append the arg-max token `max_new_tokens` times. idx: (B, T0)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.seq_len:])  # (B, T, V)
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx


def build_gpt(config: GPTConfig | None = None, seed: int = 0, **overrides) -> GPT:
    """A GPT with weights drawn from `seed`: the same seed gives the same model on every rank."""
    config = config or GPTConfig(**overrides)
    torch.manual_seed(seed)
    return GPT(config)


# ---------------------------------------------------------------------------------
# data


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes as token ids (vocabulary of 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


def load_course_text() -> torch.Tensor:
    if not COURSE_TEXT.exists():
        raise FileNotFoundError(f"{COURSE_TEXT} is missing: the course text ships inside the package (shardlib/data); "
                                "reinstall shardlib")
    return encode(COURSE_TEXT.read_text(encoding="utf-8"))


def random_token_batches(config: GPTConfig, batch_size: int, n_batches: int, seed: int = 0) -> list:
    """`n_batches` (inputs, next-token targets) pairs of uniformly random tokens, (B, T) each."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, config.vocab_size, (batch_size, config.seq_len + 1), generator=g) for _ in range(n_batches)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]  # (B, T) inputs, (B, T) targets shifted by one


def text_batches(batch_size: int, seq_len: int, n_batches: int, seed: int = 0, tokens: torch.Tensor | None = None):
    """`n_batches` (inputs, targets) pairs of shape (batch_size, seq_len), windows drawn from `seed`."""
    tokens = load_course_text() if tokens is None else tokens
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"text of {len(tokens)} tokens is too short for seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=g)
        x = torch.stack([tokens[s: s + seq_len] for s in starts.tolist()])  # (B, T)
        y = torch.stack([tokens[s + 1: s + 1 + seq_len] for s in starts.tolist()])  # (B, T)
        batches.append((x, y))
    return batches
