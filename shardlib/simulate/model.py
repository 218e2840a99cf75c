"""A pipeline stage of a transformer at its true shape, made of shardlib's own techniques.

The planner's ModelSpec (shardlib/plan/model.py) says what the model is: layers, hidden size h,
heads a (and key/value heads), MLP size f, gated or not, norms, biases, position table,
vocabulary V, experts. A rank of a job holds one stage (or, interleaved, v chunks) of it, and every
piece is the course's code for its technique:

    layer          shardlib.parallel.tensor_gpt.ParallelBlock: pre-norm, x + attn(norm(x)), x + mlp(norm(x))
    attention      its ParallelSelfAttention (heads split t ways, one f for q, k, v, row-parallel o;
                   "selective": its core recomputed); under context parallelism the same projections
                   around ring attention or Ulysses over the cp group
    MLP            ParallelMLP (column fc, GeLU, row proj); gated (SwiGLU, Llama): one column-parallel
                   linear for gate and up, experts.swiglu (silu recomputed in backward), the row-parallel
                   down projection
    experts        shardlib.parallel.experts.ExpertParallelMoE on the expert-parallel group
    embedding      VocabParallelEmbedding on the first stage; norm, column-parallel output layer and
                   vocab_parallel_cross_entropy on the last, the logits cast to fp32 as Megatron-LM does;
                   tied embeddings on two stages: the last holds a copy, its gradient summed with the
                   first's (shardlib/parallel/tied_embeddings.py)
    recomputation  "full": each layer through shardlib.parallel.recompute.recompute (keeps its input)

Sizes a technique cannot split are refused with what to change. The vocabulary is padded up to a
multiple of t (Megatron-LM pads it to a multiple of 128 t: --make-vocab-size-divisible-by). Dropout,
when the spec has it, follows the attention and the MLP and acts inside the attention. Rotary
embeddings (no parameters) are left out, and so is the load-balancing loss of a mixture of experts.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardlib.models import GPTConfig
from shardlib.parallel.context import SequenceLayout, check_context_parallel
from shardlib.parallel.experts import ExpertParallelMoE, MoE, swiglu
from shardlib.parallel.pipeline import balanced_split
from shardlib.parallel.recompute import recompute
from shardlib.parallel.ring_attention import ring_attention
from shardlib.parallel.tensor import ColumnParallelLinear, RowParallelLinear, column_parallel_linears, shard_parameter
from shardlib.parallel.tensor_gpt import ParallelBlock, ParallelMLP, VocabParallelEmbedding, \
    vocab_parallel_cross_entropy
from shardlib.parallel.ulysses import ulysses_attention
from shardlib.plan.model import ModelSpec

__all__ = ["TransformerStage", "build_chunks", "padded_vocab", "layers_of_chunks"]

DROPOUT = 0.1  # when the spec trains with dropout: GPT-2's and Megatron-LM's (--hidden-dropout, --attention-dropout)


def padded_vocab(spec: ModelSpec, t: int) -> int:
    """V rounded up to a multiple of t (each tensor-parallel rank holds V/t rows of the embedding)."""
    return -(-spec.vocab_size // t) * t


def _config(spec: ModelSpec, t: int) -> GPTConfig:
    return GPTConfig(vocab_size=padded_vocab(spec, t), seq_len=spec.n_positions or spec.seq_len,
                     n_layer=spec.n_layer, n_head=spec.n_head, n_embd=spec.hidden, n_kv_head=spec.n_kv_head,
                     dropout=DROPOUT if spec.dropout else 0.0)  # on the scores, inside the attention kernel


def _norm(spec: ModelSpec) -> nn.Module:
    return nn.LayerNorm(spec.hidden) if spec.norm == "layernorm" else nn.RMSNorm(spec.hidden)


class GatedParallelMLP(nn.Module):
    """SwiGLU under tensor parallelism: (B, T, C) -> fc (B, T, 2f/t) -> silu(gate) * up (B, T, f/t) -> (B, T, C).
    Gate and up are one column-parallel linear (Megatron-LM fuses them too): one f for both."""

    def __init__(self, hidden: int, ffn: int, bias: bool, *, group, sequence_parallel: bool, keep_gathered_input: bool):
        super().__init__()
        self.fc = ColumnParallelLinear(hidden, 2 * ffn, bias=bias, group=group, sequence_parallel=sequence_parallel,
                                       keep_gathered_input=keep_gathered_input)
        self.proj = RowParallelLinear(ffn, hidden, bias=bias, group=group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)  # (B, T, f/t) each: this rank's gate and up columns
        return self.proj(swiglu(gate, up))  # keeps gate and up (one storage); silu recomputed in backward


class ContextParallelAttention(nn.Module):
    """ParallelSelfAttention's projections (entered as it enters them) around ring attention or Ulysses over
    the cp group, on this rank's s_r tokens (shardlib.parallel.context_gpt does the same without tp)."""

    def __init__(self, attn: nn.Module, layout: SequenceLayout, *, group, method: str):
        super().__init__()
        self.attn, self.layout, self.group, self.method = attn, layout, group, method

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, s_r, C), or (B, s_r/t, C) under SP
        a = self.attn
        q, k, v = column_parallel_linears(x, (a.q_proj, a.k_proj, a.v_proj), group=a.group,
                                          sequence_parallel=a.sequence_parallel,
                                          keep_gathered_input=a.keep_gathered_input)  # (B, s_r, heads/t * hd) each
        B, T, _ = q.shape
        q, k, v = (y.view(B, T, -1, a.head_dim).transpose(1, 2) for y in (q, k, v))  # (B, heads/t, s_r, hd)
        attention = ring_attention if self.method == "ring" else ulysses_attention
        y = attention(q, k, v, self.layout, group=self.group)  # (B, nh/t, s_r, hd)
        return a.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, s_r, C), or (B, s_r/t, C) under SP


class Recomputed(nn.Module):
    """A layer that keeps only its input for backward and runs its forward again there."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recompute(self.layer, x)


def _set_bias(linear: nn.Module, wanted: bool, size: int, partition_dim) -> None:
    if wanted and linear.bias is None:
        linear.bias = shard_parameter((size,), partition_dim)
    elif not wanted:
        linear.bias = None


def build_layer(spec: ModelSpec, t: int, groups, *, sequence_parallel: bool, layout: SequenceLayout | None,
                cp_method: str, keep_gathered_input: bool = False, recompute_mode: str | None = None) -> nn.Module:
    """One transformer layer of `spec`, this rank's 1/t of it. keep_gathered_input, and recompute_mode
    "selective": ParallelBlock's options (shardlib/parallel/tensor_gpt.py)."""
    config, h, sp, keep = _config(spec, t), spec.hidden, sequence_parallel, keep_gathered_input
    block = ParallelBlock(config, group=groups.tp, sequence_parallel=sp, keep_gathered_input=keep,
                          recompute="selective" if recompute_mode == "selective" else None)
    block.ln_1, block.ln_2 = _norm(spec), _norm(spec)
    attn = block.attn
    key_bias = spec.bias if spec.key_bias is None else spec.key_bias
    for linear, wanted in ((attn.q_proj, spec.bias), (attn.k_proj, key_bias), (attn.v_proj, spec.bias)):
        _set_bias(linear, wanted, linear.weight.shape[0], 0)
    _set_bias(attn.o_proj, spec.bias, h, None)
    if spec.moe:
        if spec.bias == spec.gated_mlp:
            raise ValueError("the course's experts are GeLU MLPs with biases or gated (SwiGLU) ones without: "
                             f"bias={spec.bias} with gated_mlp={spec.gated_mlp} has no module")
        moe = MoE(h, spec.n_experts, spec.top_k, spec.capacity_factor, ffn_hidden=spec.ffn, gated=spec.gated_mlp)
        block.mlp = ExpertParallelMoE.from_moe(moe, group=groups.ep)
    elif spec.gated_mlp:
        block.mlp = GatedParallelMLP(h, spec.ffn, spec.bias, group=groups.tp, sequence_parallel=sp,
                                     keep_gathered_input=keep)
    elif spec.ffn == 4 * h:
        block.mlp = ParallelMLP(config, group=groups.tp, sequence_parallel=sp, keep_gathered_input=keep)
        _set_bias(block.mlp.fc, spec.bias, block.mlp.fc.weight.shape[0], 0)
        _set_bias(block.mlp.proj, spec.bias, h, None)
    else:
        raise ValueError(f"an ungated MLP of {spec.ffn} (not 4h = {4 * h}) has no course module: use "
                         "gated_mlp=True or ffn_hidden=4*hidden")
    if sp:  # weights that see only a sequence shard: their gradients are summed over tp
        for param in (*block.ln_1.parameters(), *block.ln_2.parameters(), *_row_biases(block)):
            param.sequence_parallel = True
    if layout is not None:
        block.attn = ContextParallelAttention(attn, layout, group=groups.cp, method=cp_method)
    if spec.dropout:  # x + dropout(attn(norm(x))), x + dropout(mlp(norm(x))): Megatron-LM's bias-dropout-add
        block.attn, block.mlp = (nn.Sequential(m, nn.Dropout(DROPOUT)) for m in (block.attn, block.mlp))
    return block


def _row_biases(block: nn.Module) -> list:
    return [m.bias for m in block.modules() if isinstance(m, RowParallelLinear) and m.bias is not None]


class TransformerStage(nn.Module):
    """Virtual stage `stage_index` of `num_stages` (pipeline_step's stage interface): layers `layers`, the
    embedding on the first, the norm, output layer and loss on the last. forward: token ids (b, s) on
    the first stage, else the activation (b, s/c, h) (/t under SP) -> the next stage's input, or
    fp32 logits (b, s/c, V/t) on the last."""

    def __init__(self, spec: ModelSpec, stage_index: int, num_stages: int, layers: range, groups, *, tp: int, cp: int,
                 cp_rank: int, tp_rank: int, sequence_parallel: bool, cp_method: str = "ring",
                 recompute_mode: str | None = None, keep_gathered_input: bool = False):
        super().__init__()
        self.spec, self.stage_index, self.num_stages, self.groups = spec, stage_index, num_stages, groups
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.tp, self.tp_rank, self.sequence_parallel = tp, tp_rank, sequence_parallel and tp > 1
        self.layout = check_context_parallel(spec.seq_len, cp, cp_method, spec.n_head // tp, spec.kv_heads // tp) \
            if cp > 1 else None
        self.cp_rank, self.activation_dtype = cp_rank, torch.bfloat16
        h, V, sp = spec.hidden, padded_vocab(spec, tp), self.sequence_parallel
        if self.is_first:
            self.tok_emb = VocabParallelEmbedding(V, h, group=groups.tp, sequence_parallel=sp)
            self.pos_emb = nn.Embedding(spec.n_positions or spec.seq_len, h) if spec.learned_positions else None
        keep = keep_gathered_input and sp
        layer = lambda: build_layer(spec, tp, groups, sequence_parallel=sp, layout=self.layout,  # noqa: E731
                                    cp_method=cp_method, keep_gathered_input=keep, recompute_mode=recompute_mode)
        wrap = Recomputed if recompute_mode == "full" else (lambda m: m)
        self.blocks = nn.ModuleDict({str(i): wrap(layer()) for i in layers})
        if self.is_last:
            self.ln_f = _norm(spec)
            self.lm_head = ColumnParallelLinear(h, V, bias=False, group=groups.tp, sequence_parallel=sp,
                                                keep_gathered_input=keep)
            if spec.tied_embeddings and self.is_first:
                self.lm_head.weight = self.tok_emb.weight  # one (V/t, h) matrix: input and output
        if sp:
            for module in (getattr(self, "pos_emb", None), getattr(self, "ln_f", None)):
                for param in module.parameters() if module is not None else ():
                    param.sequence_parallel = True

    def tied_embedding(self) -> nn.Parameter | None:
        """The weight shared with the other end of the pipeline (shardlib/parallel/tied_embeddings.py): the
        embedding on the first stage, the output layer on the last, when tied and on different stages."""
        if not self.spec.tied_embeddings or self.is_first == self.is_last:
            return None
        return self.tok_emb.weight if self.is_first else self.lm_head.weight

    def local_tokens(self) -> int:
        """Tokens of a sequence this rank's activations hold: s/c, and /t under sequence parallelism."""
        s = self.layout.length(self.cp_rank) if self.layout else self.spec.seq_len
        return s // self.tp if self.sequence_parallel else s

    def activation_shape(self, idx: torch.Tensor) -> tuple[int, ...]:
        return (idx.shape[0], self.local_tokens(), self.spec.hidden)  # (b, s/c(/t), h)

    def _positions(self, device) -> torch.Tensor:
        s = self.spec.seq_len
        pos = self.layout.positions(self.cp_rank) if self.layout else torch.arange(s)  # (s/c,)
        if self.sequence_parallel:
            pos = pos.chunk(self.tp)[self.tp_rank]  # (s/(c t),): this rank's share of the sequence
        return pos.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # (b, s) token ids
            if self.layout:
                x = self.layout.shard(x, self.cp_rank)  # (b, s/c): this rank's tokens (zigzag)
            x = self.tok_emb(x)  # (b, s/c, h), or (b, s/(c t), h) under SP
            if self.pos_emb is not None:
                x = x + self.pos_emb(self._positions(x.device))
        for block in self.blocks.values():
            x = block(x)  # (b, s/c(/t), h)
        if not self.is_last:
            return x
        return self.lm_head(self.ln_f(x)).float()  # (b, s/c, V/t) fp32

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.layout:
            targets = self.layout.shard(targets, self.cp_rank)  # (b, s/c)
        return vocab_parallel_cross_entropy(logits, targets, group=self.groups.tp)


def layers_of_chunks(spec: ModelSpec, n_chunks: int, tp: int) -> list[int]:
    """Layers per virtual stage, balanced by parameters with the embedding on the first and the output
    layer on the last (shardlib.parallel.pipeline.balanced_split, as gpt_stage cuts the course GPT)."""
    split, replicated = spec.layer_params()
    per_layer = split // tp + replicated + spec.expert_params()
    head = padded_vocab(spec, tp) * spec.hidden // tp
    return balanced_split([per_layer] * spec.n_layer, n_chunks, head, head)


def build_chunks(spec: ModelSpec, layout, coords: dict, groups, *, keep_gathered_input: bool = False
                 ) -> list[TransformerStage]:
    """This rank's chunks (one, or v interleaved: chunk c is virtual stage c p + s), on the meta device."""
    t, p, v = layout.tp, layout.pp, layout.virtual_stages
    if spec.moe and t > 1:
        raise ValueError("shardlib's expert-parallel MoE does not split experts over tensor-parallel ranks: "
                         "use tp=1 with expert parallelism")
    counts = layers_of_chunks(spec, p * v, t)
    chunks = []
    with torch.device("meta"):
        for c in range(v):
            k = c * p + coords["pp"]
            start = sum(counts[:k])
            chunks.append(TransformerStage(
                spec, k, p * v, range(start, start + counts[k]), groups, tp=t, cp=layout.cp, cp_rank=coords["cp"],
                tp_rank=coords["tp"], sequence_parallel=layout.sequence_parallel, cp_method=layout.cp_method,
                recompute_mode=layout.recompute, keep_gathered_input=keep_gathered_input))
    return chunks
