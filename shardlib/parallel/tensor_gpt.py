"""The course's GPT in its tensor-parallel form: vocabulary-parallel embedding and
cross-entropy, Megatron MLP and self-attention.

Shoeybi et al., arXiv 1909.08053, section 3 (figure 3); sequence parallelism from
Korthikanti et al., arXiv 2205.05198, section 4.2.2. Layers: shardlib/parallel/tensor.py.

    embedding  vocabulary-parallel (V/t rows per rank); output head column-parallel (V/t logits)
    loss       vocabulary-parallel cross-entropy: the (B, T, V) logits are never gathered
    MLP        fc: column-parallel (h -> 4h/t), GELU on the shard, proj: row-parallel (4h/t -> h)
    attention  q, k, v: column-parallel by heads (n_head/t heads per rank), attention on those
               heads alone, o_proj: row-parallel (h/t -> h). With grouped-query attention (n_kv_head
               key/value heads) k and v split by kv heads, n_kv_head/t per rank; when n_kv_head < t each
               kv head is replicated on t/n_kv_head ranks (as Megatron-LM and vLLM do): k, v weights and
               KV cache per rank stay at 1/n_kv_head instead of 1/t (inference only: training would need
               the replicas' weight gradients summed)

Per rank memory, Psi = V*h + T*h + L*(12h^2 + 12h) + 2h + h*V parameters:
    (2*V*h + L*(12h^2 + 6h)) / t  split,  plus  T*h + L*6h + 2h  replicated
(per layer the 12h^2 + 6h are q/k/v/o and MLP weights and the column biases of q, v and fc; the
6h are two LayerNorms and two row biases). Communication per step: see shardlib/parallel/tensor.py,
2 all-reduces of b*s*h forward and 2 backward per transformer layer; the embedding adds one
of b*s*h forward, the loss three of b*s (max, target logit, sum of exponentials).

Sequence parallelism (`sequence_parallel=True`, shardlib/parallel/sequence.py) cuts the sequence between
the pairs; a sequence that t does not divide is padded at its end with T' - T = -T mod t tokens: causal
attention keeps them out of every real token's output, and the loss leaves them out, so their
gradients are exactly zero. `keep_gathered_input=True` keeps the column layers' gathered inputs for
backward instead of gathering them again; `recompute="selective"` recomputes the attention core in
backward (arXiv 2205.05198, section 5): what each keeps is shardlib.memory.course_gpt_activation_terms.

`parallelize_gpt(model, group=group)` turns a full GPT (or its state dict) into this form;
`gather_full_state_dict(model, group=group)` (shardlib/parallel/tensor.py) gives the full state dict back,
with the same names as the single-device GPT.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardlib.comm import ops
from shardlib.models import GPT, GPTConfig
from shardlib.parallel.recompute import recompute as recompute_in_backward
from shardlib.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_reduce_copy,
    check_divisible,
    column_parallel_linears,
    exit_tp_region,
    load_shards,
    rank_and_size,
    shard_parameter,
)

RECOMPUTE_MODES = (None, "selective")


def check_tp_config(config: GPTConfig, t: int) -> None:
    """Raise a ValueError naming what to change when the GPT cannot be split t ways."""
    if t < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {t}")
    check_divisible(config.n_head, t, "n_head")
    if config.kv_heads % t and t % config.kv_heads:
        raise ValueError(f"n_kv_head={config.kv_heads} and t={t}: each rank needs whole key/value heads, so t must "
                         f"divide n_kv_head (heads split) or be a multiple of it (heads replicated)")
    check_divisible(4 * config.n_embd, t, "MLP hidden size 4*n_embd")
    check_divisible(config.vocab_size, t, "vocab_size")


def check_layer_options(sequence_parallel: bool, keep_gathered_input: bool, recompute) -> None:
    """Raise a ValueError naming what to change when the options do not go together."""
    if keep_gathered_input and not sequence_parallel:
        raise ValueError("keep_gathered_input=True chooses what sequence parallelism keeps for backward: "
                         "use it with sequence_parallel=True")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES} for the tensor-parallel GPT, got {recompute!r} "
                         f"(full recomputation of a block would repeat its collectives; the single-device GPT has it: "
                         f"shardlib.parallel.recompute.apply_recompute)")


# ---------------------------------------------------------------------------------
# the vocabulary split: embedding rows and output logits


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding(V, C) with its rows split: rank i holds tokens [i*V/t, (i+1)*V/t).
    Each rank looks up its own tokens, writes zeros for the others', and g sums:
    (B, T) ids -> (B, T, C), or (B, T/t, C) under sequence parallelism (reduce-scatter)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None, sequence_parallel: bool = False):
        super().__init__()
        rank, t = rank_and_size(group)
        check_divisible(num_embeddings, t, "vocab_size")
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.sequence_parallel = sequence_parallel
        self.vocab_start = rank * num_embeddings // t
        self.weight = shard_parameter((num_embeddings // t, embedding_dim), partition_dim=0)
        nn.init.normal_(self.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (B, T)
        local = idx - self.vocab_start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])  # (B, T): another rank's tokens
        partial = F.embedding(local.masked_fill(elsewhere, 0), self.weight)  # (B, T, C)
        partial = partial.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        # (B, T, C), or (B, T/t, C) under sequence parallelism
        return exit_tp_region(partial, group=self.group, sequence_parallel=self.sequence_parallel)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, group=None, **options) -> "VocabParallelEmbedding":
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group, **options)
        layer.to(embedding.weight.dtype)
        load_shards(layer, embedding.state_dict(), group=group)
        return layer


# ---------------------------------------------------------------------------------
# cross-entropy over vocabulary-split logits: three all-reduces of b*s numbers, never the logits


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group):
        rank, t = rank_and_size(group)
        v_local, ctx.logits_shape = logits.shape[-1], logits.shape  # (B, T, V/t)
        logits = logits.reshape(-1, v_local)  # (N, V/t), N = B*T
        targets = targets.reshape(-1)  # (N,)
        global_max = all_reduce_copy(logits.max(dim=-1).values, dist.ReduceOp.MAX, group=group)  # (N,)
        shifted = logits - global_max.unsqueeze(1)  # (N, V/t), at most 0: exp cannot overflow
        local = targets - rank * v_local
        elsewhere = (local < 0) | (local >= v_local)  # (N,): the target is another rank's token
        local = local.masked_fill(elsewhere, 0)
        target_logit = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(elsewhere, 0.0)  # (N,)
        target_logit = all_reduce_copy(target_logit, group=group)  # (N,)
        exp = shifted.exp()  # (N, V/t)
        sum_exp = all_reduce_copy(exp.sum(dim=-1), group=group)  # (N,)
        loss = sum_exp.log() - target_logit  # (N,): log sum_j e^z_j - z_target
        ctx.save_for_backward(exp / sum_exp.unsqueeze(1), local, elsewhere)  # softmax shard (N, V/t)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, elsewhere = ctx.saved_tensors
        grad = softmax.clone()  # d loss_n / d z = softmax - one_hot(target), on this rank's columns
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~elsewhere).to(grad.dtype)
        grad *= grad_loss / grad.shape[0]  # the mean over N tokens
        return grad.view(ctx.logits_shape), None, None  # (B, T, V/t)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, group=None) -> torch.Tensor:
    """Mean cross-entropy from logits split over the vocabulary, equal to
    F.cross_entropy(full_logits, targets). logits: (B, T, V/t), targets: (B, T) ids in [0, V)."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group).view(())  # scalar


# ---------------------------------------------------------------------------------
# the transformer


class ParallelMLP(nn.Module):
    """Megatron MLP: f -> column fc -> GELU -> row proj -> g. (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPTConfig, *, group=None, sequence_parallel: bool = False,
                 keep_gathered_input: bool = False):
        super().__init__()
        h = config.n_embd
        self.fc = ColumnParallelLinear(h, 4 * h, group=group, sequence_parallel=sequence_parallel,
                                       keep_gathered_input=keep_gathered_input)
        self.proj = RowParallelLinear(4 * h, h, group=group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C), or (B, T/t, C) under SP
        return self.proj(F.gelu(self.fc(x)))  # fc: (B, T, 4C/t) -> proj: (B, T, C) or (B, T/t, C)


class ParallelSelfAttention(nn.Module):
    """Megatron attention: each rank owns n_head/t whole heads, so attention needs no
    communication; o_proj (row-parallel) sums the heads' contributions. recompute="selective": the
    attention core keeps only q, k, v and runs again in backward."""

    def __init__(self, config: GPTConfig, *, group=None, sequence_parallel: bool = False,
                 keep_gathered_input: bool = False, recompute: str | None = None):
        super().__init__()
        check_layer_options(sequence_parallel, keep_gathered_input, recompute)
        h = config.n_embd
        self.group, self.sequence_parallel, self.keep_gathered_input = group, sequence_parallel, keep_gathered_input
        self.recompute = recompute
        self.head_dim, self.dropout = h // config.n_head, config.dropout
        # f is applied once for q, k and v (Megatron fuses them into one column-parallel
        # linear): one all-reduce backward, not three
        t = dist.get_world_size(group)
        self.kv_replicas = max(t // config.kv_heads, 1)  # ranks holding each kv head (n_kv_head < t: replicated)
        kv_out = max(config.kv_heads, t) * self.head_dim  # kv heads, repeated up to t when n_kv_head < t
        self.q_proj, self.k_proj, self.v_proj = (ColumnParallelLinear(h, out, bias=bias, group=group, copy_input=False)
                                                 for out, bias in ((h, True), (kv_out, False), (kv_out, True)))
        self.o_proj = RowParallelLinear(h, h, group=group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C), or (B, T/t, C) under SP
        if self.kv_replicas > 1 and torch.is_grad_enabled():
            raise ValueError("key/value heads replicated over ranks (n_kv_head < t) serve inference only: run under "
                             "torch.no_grad(), or train with t <= n_kv_head")
        # one f (or one all-gather of the sequence) for q, k and v: (B, T, C/t), (B, T, h_kv/t) x 2
        q, k, v = column_parallel_linears(x, (self.q_proj, self.k_proj, self.v_proj), group=self.group,
                                          sequence_parallel=self.sequence_parallel,
                                          keep_gathered_input=self.keep_gathered_input)
        B, T, _ = q.shape
        q, k, v = (y.view(B, T, -1, self.head_dim).transpose(1, 2) for y in (q, k, v))  # (B, heads/t, T, hd)
        y = recompute_in_backward(self.core, q, k, v) if self.recompute == "selective" else self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C/t)
        return self.o_proj(y)  # (B, T, C), or (B, T/t, C) under SP

    def core(self, q, k, v):  # (B, nh/t, T, hd), (B, n_kv/t, T, hd) x 2 -> (B, nh/t, T, hd)
        # grouped-query attention: the kernel reads each kv head for its n_head/n_kv query heads (enable_gqa,
        # https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html), so k
        # and v are kept for backward at their own size, not as repeated copies
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
                                              enable_gqa=k.shape[1] != q.shape[1])


class ParallelBlock(nn.Module):
    """A pre-LayerNorm block, as models.Block, with Megatron attention and MLP."""

    def __init__(self, config: GPTConfig, *, group=None, sequence_parallel: bool = False,
                 keep_gathered_input: bool = False, recompute: str | None = None):
        super().__init__()
        options = dict(group=group, sequence_parallel=sequence_parallel, keep_gathered_input=keep_gathered_input)
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = ParallelSelfAttention(config, recompute=recompute, **options)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = ParallelMLP(config, **options)
        if sequence_parallel:
            _mark_sequence_parallel(self.ln_1, self.ln_2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C), or (B, T/t, C) under SP
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TensorParallelGPT(nn.Module):
    """models.GPT split over the ranks of `group`; parameter names are GPT's.
    forward(idx (B, T), targets) -> this rank's logits (B, T, V/t) [, mean loss]. Options: see the module
    docstring (sequence_parallel, keep_gathered_input, recompute)."""

    def __init__(self, config: GPTConfig, *, group=None, sequence_parallel: bool = False,
                 keep_gathered_input: bool = False, recompute: str | None = None):
        super().__init__()
        check_tp_config(config, dist.get_world_size(group))
        check_layer_options(sequence_parallel, keep_gathered_input, recompute)
        self.config, self.group, self.sequence_parallel = config, group, sequence_parallel
        h, sp, keep = config.n_embd, sequence_parallel, keep_gathered_input
        self.tok_emb = VocabParallelEmbedding(config.vocab_size, h, group=group, sequence_parallel=sp)
        self.pos_emb = nn.Embedding(config.seq_len, h)
        self.blocks = nn.ModuleList(ParallelBlock(config, group=group, sequence_parallel=sp, keep_gathered_input=keep,
                                                  recompute=recompute) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(h)
        self.lm_head = ColumnParallelLinear(h, config.vocab_size, bias=False, group=group, sequence_parallel=sp,
                                            keep_gathered_input=keep)
        if config.tie_embeddings:  # both split by vocabulary rows: one (V/t, h) Parameter on each rank
            self.lm_head.weight = self.tok_emb.weight
        if sequence_parallel:
            _mark_sequence_parallel(self.pos_emb, self.ln_f)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        rank, t = rank_and_size(self.group)
        if T > self.config.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.config.seq_len}")
        padded = T + (-T % t if self.sequence_parallel else 0)  # T': a multiple of t under SP
        x = self.tok_emb(F.pad(idx, (0, padded - T)))  # (B, T, C), or (B, T'/t, C) under SP
        if self.sequence_parallel:
            mine = torch.arange(rank * padded // t, (rank + 1) * padded // t, device=idx.device)  # (T'/t,)
            pos = mine.clamp(max=self.config.seq_len - 1)  # the padding's positions are never used
        else:
            pos = torch.arange(T, device=idx.device)  # (T,)
        x = x + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))[:, :T]  # (B, T, V/t): the padding's rows dropped
        if targets is None:
            return logits
        return logits, vocab_parallel_cross_entropy(logits, targets, group=self.group)


def _mark_sequence_parallel(*modules: nn.Module) -> None:
    for module in modules:
        for param in module.parameters():
            param.sequence_parallel = True


def parallelize_gpt(model_or_state_dict: GPT | dict, *, group=None, config: GPTConfig | None = None,
                    **options) -> TensorParallelGPT:
    """This rank's tensor-parallel shard of a full GPT (or of its state dict, with `config`); options:
    sequence_parallel, keep_gathered_input, recompute (TensorParallelGPT's)."""
    if isinstance(model_or_state_dict, GPT):
        config, state = model_or_state_dict.config, model_or_state_dict.state_dict()
    elif config is None:
        raise ValueError("parallelize_gpt(state_dict) needs config=GPTConfig(...): "
                         "the number of heads cannot be read from the weights")
    else:
        state = model_or_state_dict
    model = TensorParallelGPT(config, group=group, **options)
    model = model.to(state["tok_emb.weight"].dtype)
    load_shards(model, replicate_kv_heads(state, config, dist.get_world_size(group)), group=group)
    if isinstance(model_or_state_dict, GPT):  # frozen stays frozen
        for param, source in zip(model.parameters(), model_or_state_dict.parameters()):
            param.requires_grad_(source.requires_grad)
    return model


@torch.no_grad()
def sync_sequence_parallel_grads(model: nn.Module, *, group=None) -> None:
    """Sum, in one all-reduce, the gradients of weights that saw only a sequence shard
    (LayerNorms, row biases, position embedding). Call after backward; nothing without SP."""
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numels,)
    ops.all_reduce(flat, group=group)
    for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(piece.view_as(grad))


def parallelize_block(block: nn.Module, config: GPTConfig, *, group=None, **options) -> ParallelBlock:
    """This rank's shard of one models.Block; options: ParallelBlock's (sequence_parallel, ...)."""
    parallel = ParallelBlock(config, group=group, **options).to(block.ln_1.weight.dtype)
    load_shards(parallel, replicate_kv_heads(block.state_dict(), config, dist.get_world_size(group)), group=group)
    return parallel


def replicate_kv_heads(state: dict, config: GPTConfig, t: int) -> dict:
    """With n_kv_head < t, repeat each kv head's rows of k and v t/n_kv_head times, so that cutting them
    in t equal pieces gives every rank the kv head its query heads read; otherwise `state` unchanged."""
    if config.kv_heads >= t:
        return state
    hd, repeats = config.n_embd // config.n_head, t // config.kv_heads
    suffixes = ("attn.k_proj.weight", "attn.v_proj.weight", "attn.v_proj.bias")
    return {name: (value.unflatten(0, (config.kv_heads, hd)).repeat_interleave(repeats, dim=0).flatten(0, 1)
                   if name.endswith(suffixes) else value)  # (n_kv * hd, ...) -> (t * hd, ...)
            for name, value in state.items()}

