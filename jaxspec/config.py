"""Frozen configuration dataclasses, parsed from Hugging Face `config.json` at the boundary and validated there."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxspec.errors import JaxspecError
from jaxspec.files import read_json

# The most drafts one verify step may check along a path (a chain's K, a tree's DEPTH). Acceptance decays
# geometrically with depth, so past ~10 a verify slot is almost never used; the bound also keeps a tree node and its
# ancestors within the two 64-key blocks the invariant attention gathers them into.
MAX_DRAFT_DEPTH = 32

# Hugging Face `model_type` → what differs from plain Llama.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
                         "gemma3_text", "gemma3", "gemma4_text", "gemma4")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Gemma text decoders (models/gemma.py) and the multimodal checkpoints whose text_config is read
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text", "gemma4_text")
GEMMA_MULTIMODAL_TYPES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base frequency and the optional `linear` / `llama3` scaling of Hugging Face."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts target (models/moe.py): a router picks `top_k` of `num_experts`
    SwiGLU experts per token and sums their outputs weighted by its probabilities.

    The three families differ only in how the weights are made and added (transformers' code, followed exactly):
    Qwen3-MoE and Qwen2-MoE take the softmax over all experts, keep the top k and renormalize them when
    `norm_topk_prob`, then round them to the model dtype (`round_weights`); Mixtral always renormalizes and keeps
    them in float32. Qwen2-MoE adds a dense shared expert gated by sigmoid(x · w) (`shared_intermediate_size`).
    Gemma 4's (26B-A4B: models/gemma.py) renormalizes in float32 and scales each weight by its expert's learned
    scale; its experts are tanh-GELU gated MLPs beside each layer's dense MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's SwiGLU width
    layers: tuple[int, ...]  # the decoder layers whose MLP is sparse (the others keep the dense MLP)
    norm_topk_prob: bool = True
    round_weights: bool = True  # routing weights rounded to the model dtype before they scale an expert's output
    shared_intermediate_size: int = 0  # 0: no shared expert

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise JaxspecError(f"config.json: the experts' {name} must be an integer >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise JaxspecError(f"config.json: num_experts_per_tok={self.top_k} exceeds the {self.num_experts} experts")


@dataclasses.dataclass(frozen=True)
class GemmaLayout:
    """What a Gemma text decoder (models/gemma.py; transformers' Gemma2Model, Gemma3TextModel, Gemma4TextModel) has
    beside the fields it shares with Llama. TargetConfig's head_dim and num_kv_heads are its sliding layers'; Gemma
    4's full-attention layers have their own (`full_head_dim`, `full_kv_heads`: its global_head_dim and
    num_global_key_value_heads); Gemma 2 and 3 give both layer types the same.

    KV sharing (Gemma 4): the last `num_kv_shared_layers` layers compute no keys or values; each attends to those of
    the last earlier layer of its own type (`kv_source`), so only the other layers have a cache (`cache_layers`).

    The generations differ by configuration only (the defaults are Gemma 4's): Gemma 2 and 3 store their norms'
    weights as w and apply 1 + w (`norm_offset`), scale the scores by query_pre_attn_scalar^-1/2 (`query_scale`;
    Gemma 4 norms q and k and scales by 1), have no value norm and no layer scalar; Gemma 2 has no q/k norms and
    soft-caps the attention scores (`attn_softcapping`)."""

    layer_types: tuple[str, ...]  # "sliding_attention" or "full_attention" per layer
    sliding_window: int  # a sliding layer's query at p sees keys at positions p - window < q <= p
    full_head_dim: int
    full_kv_heads: int
    k_eq_v: bool = False  # full layers: values are the key projection's output (no v_proj)
    kv_source: tuple[int, ...] = ()  # per layer: the layer whose keys and values it attends (itself, or shared)
    mlp_widths: tuple[int, ...] = ()  # per layer: the MLP width (2x on shared layers with use_double_wide_mlp)
    per_layer_dim: int = 0  # hidden_size_per_layer_input: per-layer inputs (PLE); 0 = none
    per_layer_vocab: int = 0  # vocab_size_per_layer_input
    final_logit_softcapping: float | None = None
    sliding_rope: tuple[float, float, float] = (10000.0, 1.0, 1.0)  # (theta, partial_rotary_factor, factor)
    full_rope: tuple[float, float, float] = (1000000.0, 0.25, 1.0)  # proportional RoPE (theta, partial, factor)
    norm_offset: bool = False  # RMSNorm weights applied as 1 + w (Gemma 2 and 3)
    qk_norm: bool = True  # per-head RMSNorms on q and k (Gemma 3 and 4)
    v_norm: bool = True  # an unweighted RMSNorm on v (Gemma 4)
    layer_scalar: bool = True  # a learned scalar multiplying each layer's output (Gemma 4)
    query_scale: float = 1.0  # the scores' scale (Gemma 2 and 3: query_pre_attn_scalar^-1/2)
    attn_softcapping: float | None = None  # scores capped by c·tanh(s/c) (Gemma 2)

    def sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """The layers that compute keys and values, in order: the cache holds one entry per layer here."""
        return tuple(i for i, src in enumerate(self.kv_source) if src == i)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A Llama-family decoder (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3, Mistral), dense or with sparse MLPs (`moe`:
    Mixtral, Qwen2-MoE, Qwen3-MoE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2; Llama's `attention_bias`)
    o_proj_bias: bool = False  # Llama's `attention_bias` also puts a bias on o_proj; Qwen2 has none there
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # EAGLE-3 auxiliary features: Hugging Face `hidden_states[l]`, the residual stream entering decoder layer l.
    aux_layer_ids: tuple[int, ...] | None = None
    # Usable context; smaller than max_position_embeddings when the model uses sliding-window attention.
    context_length: int | None = None
    moe: MoeConfig | None = None  # the sparse MLP layers of a mixture-of-experts target; None: dense
    gemma: GemmaLayout | None = None  # a Gemma 2/3/4 text decoder's layout (models/gemma.py); None: Llama's

    def __post_init__(self) -> None:
        check_sizes(self, "config.json")
        if self.moe is not None and not all(0 <= i < self.num_layers for i in self.moe.layers):
            raise JaxspecError(f"config.json: sparse layers {self.moe.layers} outside 0..{self.num_layers - 1}")
        if self.num_heads % self.num_kv_heads:
            raise JaxspecError(f"num_attention_heads={self.num_heads} is not a multiple of {self.num_kv_heads=}")
        if self.aux_layer_ids is None:
            object.__setattr__(self, "aux_layer_ids", default_aux_layer_ids(self.num_layers))
        for layer in self.aux_layer_ids:
            if not 0 <= layer < self.num_layers:
                raise JaxspecError(
                    f"aux layer id {layer} is outside 0..{self.num_layers - 1} (ids are Hugging Face hidden_states "
                    "indices: the input of that decoder layer)"
                )
        if self.context_length is None:
            object.__setattr__(self, "context_length", self.max_position_embeddings)

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """An EAGLE-3 draft head: fc(n_aux·Ht → H), a first decoder layer over concat(norm(embed), norm(state)) = 2H,
    `num_layers - 1` plain decoder layers after it (multi-layer heads: speculators, vLLM), final norm, lm_head over
    `draft_vocab_size` tokens, mapped back to target ids by `d2t` offsets. EAGLE 3.1's switches: `fc_norm` (one
    norm per feature chunk before fc) and `norm_output` (the post-norm state is fed to the next step)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (embedding rows)
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False  # residual = hidden_norm(state) (speculators) instead of state (EAGLE)
    norm_before_fc: bool = False  # RMSNorm over the concatenated features before fc (`input_norm`)
    fc_norm: bool = False  # one RMSNorm per feature chunk before fc (`fc_norm.{i}`)
    has_embed_tokens: bool = False  # the checkpoint ships its own embedding table
    aux_layer_ids: tuple[int, ...] | None = None  # Hugging Face hidden_states indices; None = the target's default
    num_aux: int = 3
    num_layers: int = 1  # decoder layers; only the first reads the 2H input
    norm_output: bool = False  # EAGLE 3.1: the next step's state is norm(out), the lm_head's input, not out
    # P-EAGLE (parallel drafting): the token of the K - 1 extra slots of its one forward (their state is
    # fc(mask_hidden), a learned [n_aux·Ht] vector); None: an EAGLE-3 head, which drafts step by step
    mask_token_id: int | None = None
    # Shared with the target's layer code, always off in EAGLE-3 heads.
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        check_sizes(self, "head config.json")
        if self.num_heads % self.num_kv_heads:
            raise JaxspecError(f"head num_attention_heads={self.num_heads} is not a multiple of {self.num_kv_heads=}")
        if self.draft_vocab_size > self.vocab_size:
            raise JaxspecError(f"draft_vocab_size={self.draft_vocab_size} exceeds the vocabulary {self.vocab_size}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise JaxspecError(f"head config.json: the parallel-drafting token {self.mask_token_id} is outside the "
                               f"vocabulary of {self.vocab_size}")

    @classmethod
    def for_target(cls, target: TargetConfig, **overrides) -> HeadConfig:
        """The usual EAGLE-3 head of a target: its attention shape, MLP width, vocabulary, norms, RoPE and feature
        layers, one decoder layer; `overrides` replace any field (e.g. draft_vocab_size, intermediate_size)."""
        base = dict(
            hidden_size=target.hidden_size, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim, intermediate_size=target.intermediate_size, vocab_size=target.vocab_size,
            draft_vocab_size=target.vocab_size, target_hidden_size=target.hidden_size,
            rms_norm_eps=target.rms_norm_eps, rope=target.rope, aux_layer_ids=target.aux_layer_ids,
        )
        return cls(**{**base, **overrides})



@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash block drafter (z-lab, arXiv 2602.06036; BLOCK_DRAFTERS.md §1): a stack of Qwen3-style decoder
    layers with no embedding and no LM head of its own (the target's are shared). One forward drafts a block:
    the last target token and `block_size - 1` mask tokens attend, bidirectionally, to each other and to the
    context, the target's features at `target_layer_ids` projected by fc and hidden_norm and injected as extra
    keys and values in every layer; slot k's logits are the draft for the token k positions after the root.

    `target_layer_ids` are z-lab's: the OUTPUT of decoder layer i, Hugging Face hidden_states[i + 1], which is
    what `aux_layer_ids` (the input of a layer, as the target returns features) gives."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (its embedding rows and LM head)
    target_hidden_size: int
    block_size: int  # B: one forward drafts B - 1 tokens
    mask_token_id: int  # the block's filler token, embedded with the target's table
    target_layer_ids: tuple[int, ...]  # z-lab ids: the output of these target decoder layers
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig(theta=1000000.0)
    max_position_embeddings: int = 40960
    # Shared with the target's layer code: DFlash layers are Qwen3's (q/k norms, no biases).
    qk_norm: bool = True
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        check_sizes(self, "drafter config.json")
        if self.num_heads % self.num_kv_heads:
            raise JaxspecError(f"drafter num_attention_heads={self.num_heads} is not a multiple of "
                               f"{self.num_kv_heads=}")
        if self.block_size < 2:
            raise JaxspecError(f"drafter block_size must be at least 2 (the root and one draft), got {self.block_size}")
        if not self.target_layer_ids:
            raise JaxspecError("drafter dflash_config.target_layer_ids is empty: it names the target layers it reads")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise JaxspecError(
                f"drafter mask_token_id {self.mask_token_id} is outside the vocabulary 0..{self.vocab_size - 1}; "
                "the mask token must be a row of the target's embedding table"
            )

    @property
    def num_aux(self) -> int:
        return len(self.target_layer_ids)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target features this drafter reads, as hidden_states indices (the input of layer i + 1)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    @classmethod
    def for_target(cls, target: TargetConfig, **overrides) -> DFlashConfig:
        """A drafter shaped like its target's layers (z-lab's published drafters are), `num_layers` 5 or fewer,
        reading 5 (or fewer) layers spread as z-lab's `build_target_layer_ids` spreads them."""
        n = target.num_layers
        ids = build_target_layer_ids(n, min(5, max(n - 2, 1)))
        base = dict(
            hidden_size=target.hidden_size, num_layers=min(5, n), num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, intermediate_size=target.intermediate_size,
            vocab_size=target.vocab_size, target_hidden_size=target.hidden_size, block_size=16,
            mask_token_id=target.vocab_size - 1,
            target_layer_ids=tuple(dict.fromkeys(min(max(i, 0), n - 2) for i in ids)),
            rms_norm_eps=target.rms_norm_eps, rope=target.rope,
        )
        return cls(**{**base, **overrides})

# Config fields that count something (and the Hugging Face names they are read from): each must be at least 1.
SIZE_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "draft_vocab_size": "draft_vocab_size", "target_hidden_size": "target_hidden_size",
    "max_position_embeddings": "max_position_embeddings",
}


def check_sizes(cfg: TargetConfig | HeadConfig, what: str) -> None:
    """Every size of a config is an integer >= 1: a zero or negative one (a hand-edited config.json) was a
    ZeroDivisionError or a shape error deep in loading."""
    for field, hf_name in SIZE_FIELDS.items():
        value = getattr(cfg, field, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise JaxspecError(f"{what}: {hf_name} must be an integer >= 1, got {value!r}")


_REQUIRED = object()


def hf_int(raw: dict[str, Any], key: str, default: Any = _REQUIRED, what: str = "config.json") -> int:
    """An integer field of a Hugging Face config: missing or null takes `default` (none: the field is required);
    an integral float (2048.0) is accepted, any other type is a one-line error naming the field."""
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise JaxspecError(f"{what} lacks the field {key!r}")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise JaxspecError(f"{what}: {key} must be an integer, got {value!r}")
    return value


@contextlib.contextmanager
def hf_fields(what: str) -> Iterator[None]:
    """Any other field of the wrong type (a string where a number belongs, a list where an object belongs) is a
    one-line error naming the file, not a TypeError from deep in parsing."""
    try:
        yield
    except (TypeError, ValueError, AttributeError) as e:
        raise JaxspecError(f"{what} has a field of the wrong type ({e}); compare it with the model's published "
                           "config.json") from None


def build_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """z-lab's DFlash feature layers (outputs of decoder layers): the middle one, or `count` spread over 1..N-3."""
    if count == 1:
        return (num_target_layers // 2,)
    return tuple(round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count))


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default feature layers (2, L//2, L-3), clipped into range for tiny test models."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def _rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    # transformers ≥ 5 writes `rope_parameters`; older configs write `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise JaxspecError("per-layer-type rope_parameters are not supported (sliding-window models)")
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise JaxspecError(
            f"rope scaling type {rope_type!r} is not supported; jaxspec supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise JaxspecError("partial_rotary_factor != 1 is not supported")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


def _sliding_window_limit(raw: dict[str, Any]) -> int | None:
    """The context beyond which this model's sliding window would change attention, or None."""
    layer_types = raw.get("layer_types") or ()
    uses_window = any(t == "sliding_attention" for t in layer_types)
    if raw.get("model_type") in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        uses_window = uses_window or bool(raw.get("use_sliding_window", False))
    elif raw.get("sliding_window") is not None:
        uses_window = True
    if not uses_window or raw.get("sliding_window") is None:
        return None
    return int(raw["sliding_window"])


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _moe_from_hf(raw: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig | None:
    """The sparse MLPs of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json (None for a dense model type): every layer
    for Mixtral; for the Qwen families layer i when (i + 1) % decoder_sparse_step == 0 and i is not in
    mlp_only_layers, as transformers builds them."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    experts = hf_int(raw, "num_local_experts" if model_type == "mixtral" else "num_experts",
                     raw.get("num_local_experts", _REQUIRED))  # transformers 5 writes Qwen's as num_local_experts
    if model_type == "mixtral":
        return MoeConfig(num_experts=experts, top_k=hf_int(raw, "num_experts_per_tok", 2),
                         intermediate_size=hf_int(raw, "intermediate_size"), layers=tuple(range(num_layers)),
                         norm_topk_prob=True, round_weights=False)
    step = hf_int(raw, "decoder_sparse_step", 1)
    if step < 1:
        raise JaxspecError(f"config.json: decoder_sparse_step must be >= 1, got {step}")
    dense = set(int(i) for i in raw.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = hf_int(raw, "shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    return MoeConfig(num_experts=experts, top_k=hf_int(raw, "num_experts_per_tok"),
                     intermediate_size=hf_int(raw, "moe_intermediate_size"), layers=layers,
                     norm_topk_prob=bool(raw.get("norm_topk_prob", False)), round_weights=True,
                     shared_intermediate_size=shared)


GEMMA_NAMES = {"gemma2": "Gemma 2", "gemma3_text": "Gemma 3", "gemma4_text": "Gemma 4"}
GEMMA_ROPE_TYPES = {"gemma2": ("default", "linear"), "gemma3_text": ("default", "linear"),
                    "gemma4_text": ("default", "proportional")}


def _gemma_rope_params(raw: dict[str, Any], kind: str, model_type: str) -> dict[str, Any]:
    """One layer type's RoPE entry as transformers reads it: Gemma 3 and 4 write one `rope_parameters` entry per layer
    type, Gemma 2 one for both; configs from before transformers 5 give rope_theta (Gemma 3: the full layers', with
    rope_scaling, and rope_local_base_freq for sliding layers)."""
    given = raw.get("rope_parameters")
    if model_type == "gemma2":
        if isinstance(given, dict):
            return given
        return {"rope_theta": raw.get("rope_theta", 10_000.0), **(raw.get("rope_scaling") or {})}
    if given:
        if not isinstance(given.get(kind), dict):
            raise JaxspecError(f"config.json: {GEMMA_NAMES[model_type]} rope_parameters has no {kind!r} entry (one per "
                               "layer type)")
        return given[kind]
    if model_type == "gemma3_text":
        if kind == "sliding_attention":
            return {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
        return {"rope_theta": raw.get("rope_theta", 1_000_000.0), **(raw.get("rope_scaling") or {})}
    return {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1_000_000.0}}[kind]


def _gemma_rope(raw: dict[str, Any], kind: str, model_type: str) -> tuple[float, float, float]:
    """(theta, partial_rotary_factor, factor) of one layer type's RoPE: `default` rotates every dimension pair,
    `linear` (Gemma 3's full layers) divides the frequencies by factor, and Gemma 4's `proportional` rotates the first
    partial_rotary_factor of the pairs (the rest get frequency 0), all with the exponents over the whole head_dim
    (transformers' _compute_proportional_rope_parameters)."""
    params = _gemma_rope_params(raw, kind, model_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in GEMMA_ROPE_TYPES[model_type]:
        raise JaxspecError(f"config.json: {GEMMA_NAMES[model_type]} {kind} rope_type {rope_type!r} is not supported "
                           f"({', '.join(GEMMA_ROPE_TYPES[model_type])})")
    theta = float(params.get("rope_theta", 10_000.0))
    if rope_type == "default":  # transformers' default RoPE reads neither a partial factor nor a scaling factor
        return theta, 1.0, 1.0
    if rope_type == "linear":
        return theta, 1.0, float(params.get("factor", 1.0))
    return theta, float(params.get("partial_rotary_factor", 1.0)), float(params.get("factor", 1.0))


def _gemma_layer_types(raw: dict[str, Any], num_layers: int, model_type: str) -> list[str]:
    """Sliding and full layers as transformers builds them when the config lists none: Gemma 2 alternates (sliding
    first), Gemma 3 has a full layer every sliding_window_pattern (6), Gemma 4 every 6th and always as its last."""
    pattern = 2 if model_type == "gemma2" else hf_int(raw, "sliding_window_pattern", 6)
    if pattern < 1:
        raise JaxspecError(f"config.json: sliding_window_pattern must be >= 1, got {pattern}")
    types = list(raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                            for i in range(num_layers)])
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise JaxspecError(f"config.json: layer_types must name sliding_attention or full_attention for each of the "
                           f"{num_layers} layers, got {types}")
    if model_type == "gemma4_text":
        types[-1] = "full_attention"  # as transformers forces it
    return types


def _gemma_from_hf(raw: dict[str, Any], num_layers: int, head_dim: int, kv_heads: int,
                   model_type: str) -> GemmaLayout:
    """A Gemma text config's layout, as transformers' Gemma2Config / Gemma3TextConfig / Gemma4TextConfig build it:
    layer types, the scores' scale and soft cap, RoPE per layer type; for Gemma 4 also the full layers' head_dim and
    KV heads (`per_layer_config` as transformers >= 5.2x writes it, or `global_head_dim` /
    `num_global_key_value_heads`), which layers share keys and values, and per-layer inputs."""
    name = GEMMA_NAMES[model_type]
    bidirectional = raw.get("use_bidirectional_attention")  # Gemma 2/3: a bool; Gemma 4: None, "vision" or "all"
    if (bidirectional is not None) if model_type == "gemma4_text" else bool(bidirectional):
        raise JaxspecError(f"config.json: use_bidirectional_attention is set; jaxspec runs causal {name} decoders")
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise JaxspecError(f"config.json: {name} hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    types = _gemma_layer_types(raw, num_layers, model_type)
    num_heads = hf_int(raw, "num_attention_heads")
    window = hf_int(raw, "sliding_window", {"gemma2": 4096, "gemma3_text": 4096}.get(model_type, 512))
    if window < 1:
        raise JaxspecError(f"config.json: {name} sliding_window must be at least 1, got {window}")
    width = hf_int(raw, "intermediate_size")
    cap = raw.get("final_logit_softcapping", 30.0 if model_type == "gemma2" else None)
    rope = dict(sliding_rope=_gemma_rope(raw, "sliding_attention", model_type),
                full_rope=_gemma_rope(raw, "full_attention", model_type))
    if model_type != "gemma4_text":
        attn_cap = raw.get("attn_logit_softcapping", 50.0 if model_type == "gemma2" else None)
        scalar = float(raw.get("query_pre_attn_scalar", 256))
        if scalar <= 0 or (attn_cap is not None and float(attn_cap) <= 0):
            raise JaxspecError(f"config.json: {name} query_pre_attn_scalar and attn_logit_softcapping must be "
                               f"positive, got {scalar} and {attn_cap}")
        return GemmaLayout(
            layer_types=tuple(types), sliding_window=window, full_head_dim=head_dim, full_kv_heads=kv_heads,
            kv_source=tuple(range(num_layers)), mlp_widths=(width,) * num_layers,
            final_logit_softcapping=None if cap is None else float(cap), **rope, norm_offset=True,
            qk_norm=model_type == "gemma3_text", v_norm=False, layer_scalar=False, query_scale=scalar**-0.5,
            attn_softcapping=None if attn_cap is None else float(attn_cap),
        )
    if "per_layer_config" in raw:  # transformers >= 5.2x writes the overrides, and only those that differ
        overrides = raw.get("per_layer_config") or {}
        if not isinstance(overrides, dict) or not all(str(k).lstrip("-").isdigit() and 0 <= int(k) < num_layers
                                                       for k in overrides):
            raise JaxspecError(f"config.json: per_layer_config must map layer indices 0..{num_layers - 1} to "
                               f"overrides, got {overrides!r}")
        overrides = {int(k): v or {} for k, v in overrides.items()}
        if any(overrides.get(i) for i, kind in enumerate(types) if kind == "sliding_attention"):
            raise JaxspecError("config.json: per_layer_config overrides a sliding layer; jaxspec reads overrides of "
                               "full-attention layers only")
        full = {(hf_int(overrides.get(i, {}), "head_dim", head_dim),
                 hf_int(overrides.get(i, {}), "num_key_value_heads", kv_heads))
                for i, kind in enumerate(types) if kind == "full_attention"}
        if len(full) != 1:
            raise JaxspecError(f"config.json: per_layer_config gives full-attention layers different shapes {full}")
        ((full_head_dim, full_kv),) = full
    else:  # the global_head_dim / num_global_key_value_heads of earlier transformers releases
        full_head_dim, full_kv = hf_int(raw, "global_head_dim", 512), kv_heads
        if raw.get("attention_k_eq_v", False) and raw.get("num_global_key_value_heads") is not None:
            full_kv = hf_int(raw, "num_global_key_value_heads")
    for what, value in (("full layers' head_dim", full_head_dim), ("full layers' KV heads", full_kv)):
        if value < 1:
            raise JaxspecError(f"config.json: Gemma 4 {what} must be at least 1, got {value}")
    if num_heads % full_kv:
        raise JaxspecError(f"config.json: {num_heads} query heads are not a multiple of the full layers' {full_kv} "
                           "KV heads")
    shared = hf_int(raw, "num_kv_shared_layers", 0)
    first_shared = num_layers - shared
    if not 0 <= shared < num_layers:
        raise JaxspecError(f"config.json: num_kv_shared_layers={shared} must be below num_hidden_layers={num_layers}")
    source = []
    for i, kind in enumerate(types):
        if i < first_shared:
            source.append(i)
            continue
        producers = [j for j in range(first_shared) if types[j] == kind]
        if not producers:
            raise JaxspecError(f"config.json: shared layer {i} ({kind}) has no earlier {kind} layer to share with")
        source.append(producers[-1])
    double = bool(raw.get("use_double_wide_mlp", False))
    per_layer_dim = hf_int(raw, "hidden_size_per_layer_input", 256)  # transformers' defaults (E2B's)
    if per_layer_dim < 0:
        raise JaxspecError(f"config.json: hidden_size_per_layer_input must be >= 0, got {per_layer_dim}")
    return GemmaLayout(
        layer_types=tuple(types), sliding_window=window, full_head_dim=full_head_dim,
        full_kv_heads=full_kv, k_eq_v=bool(raw.get("attention_k_eq_v", False)), kv_source=tuple(source),
        mlp_widths=tuple(width * (2 if double and i >= first_shared else 1) for i in range(num_layers)),
        per_layer_dim=per_layer_dim,
        per_layer_vocab=hf_int(raw, "vocab_size_per_layer_input", 262_144) if per_layer_dim else 0,
        final_logit_softcapping=None if cap is None else float(cap), **rope,
    )


def target_config_from_hf(raw: dict[str, Any], aux_layer_ids: tuple[int, ...] | None = None) -> TargetConfig:
    """Parse a Hugging Face `config.json` dict; refuse what jaxspec cannot run exactly."""
    multimodal = raw.get("model_type")
    # Gemma 3 and 4's multimodal checkpoints: their text decoder's config
    if isinstance(multimodal, str) and multimodal in GEMMA_MULTIMODAL_TYPES:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise JaxspecError(f"config.json: a {multimodal} config without a text_config object")
        raw = {**text, "model_type": GEMMA_MULTIMODAL_TYPES[multimodal],
               "tie_word_embeddings": text.get("tie_word_embeddings", raw.get("tie_word_embeddings", True))}
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        arch = ",".join(map(str, raw.get("architectures") or [])) or "?"
        raise JaxspecError(
            f"unsupported architecture {arch} (model_type={model_type!r}); jaxspec supports model types "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    with hf_fields("config.json"):
        if model_type in GEMMA_MODEL_TYPES:
            return _gemma_target_config(raw, aux_layer_ids, model_type)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise JaxspecError(f"hidden_act={act!r} is not supported (Llama-family models use silu)")
        hidden = hf_int(raw, "hidden_size")
        num_heads = hf_int(raw, "num_attention_heads")
        cfg = dict(
            vocab_size=hf_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=hf_int(raw, "intermediate_size"),
            num_layers=hf_int(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf_int(raw, "num_key_value_heads", num_heads) or num_heads,
            head_dim=hf_int(raw, "head_dim", 0) or hidden // max(num_heads, 1),
        )
        max_pos = hf_int(raw, "max_position_embeddings", 2048)
        window = _sliding_window_limit(raw)
        return TargetConfig(
            **cfg,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope=_rope_from_hf(raw),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=(True if model_type == "qwen2" else bool(raw.get("qkv_bias", True))
                            if model_type == "qwen2_moe" else bool(raw.get("attention_bias", False))),
            o_proj_bias=model_type in ("llama", "qwen3", "qwen3_moe") and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            model_type=model_type,
            bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
            eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
            aux_layer_ids=aux_layer_ids,
            context_length=min(max_pos, window) if window else max_pos,
            moe=_moe_from_hf(raw, model_type, cfg["num_layers"]),
        )


def _gemma_target_config(raw: dict[str, Any], aux_layer_ids: tuple[int, ...] | None, model_type: str) -> TargetConfig:
    """A Gemma 2, 3 or 4 text decoder: no attention biases, tied embeddings by default; the context is the model's
    whole (sliding layers attend within their window exactly, models/gemma.py)."""
    hidden, num_heads = hf_int(raw, "hidden_size"), hf_int(raw, "num_attention_heads")
    num_layers = hf_int(raw, "num_hidden_layers")
    kv_heads = hf_int(raw, "num_key_value_heads", 4)  # transformers' Gemma defaults
    head_dim = hf_int(raw, "head_dim", 256)
    if raw.get("attention_bias"):
        raise JaxspecError(f"config.json: {GEMMA_NAMES[model_type]} attention_bias is not supported (the published "
                           "models have none)")
    if kv_heads < 1 or num_heads % kv_heads:
        raise JaxspecError(f"config.json: {num_heads} query heads are not a multiple of {kv_heads} KV heads")
    max_pos = hf_int(raw, "max_position_embeddings", {"gemma2": 8192}.get(model_type, 131072))
    layout = _gemma_from_hf(raw, num_layers, head_dim, kv_heads, model_type)
    vocab = hf_int(raw, "vocab_size")
    if layout.per_layer_dim and layout.per_layer_vocab < vocab:
        raise JaxspecError(f"config.json: vocab_size_per_layer_input={layout.per_layer_vocab} is smaller than the "
                           f"vocabulary ({vocab}); every token needs a per-layer input row")
    moe = None
    if model_type == "gemma4_text" and raw.get("enable_moe_block"):  # 26B-A4B: experts beside every dense MLP
        moe = MoeConfig(num_experts=hf_int(raw, "num_experts"), top_k=hf_int(raw, "top_k_experts"),
                        intermediate_size=hf_int(raw, "moe_intermediate_size"), layers=tuple(range(num_layers)),
                        norm_topk_prob=True, round_weights=False)
    return TargetConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hf_int(raw, "intermediate_size"),
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)), qk_norm=layout.qk_norm, model_type=model_type,
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        eos_token_ids=_as_id_tuple(raw.get("eos_token_id")), aux_layer_ids=aux_layer_ids, context_length=max_pos,
        moe=moe, gemma=layout,
    )


def gemma_inv_freq(head_dim: int, rope: tuple[float, float, float]):
    """A Gemma layer type's inverse frequencies [head_dim/2], float32, as transformers computes them: the first
    int(partial · head_dim / 2) pairs rotate with base^(-2i/head_dim), the others not at all, all divided by factor."""
    import numpy as np

    theta, partial, factor = rope
    angles = int(partial * head_dim // 2)
    rotated = (1.0 / (theta ** (np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / head_dim)))
    inv_freq = np.concatenate([rotated.astype(np.float32), np.zeros(head_dim // 2 - angles, np.float32)])
    return (inv_freq / np.float32(factor)).astype(np.float32)


def load_target_config(model_dir: str | Path, aux_layer_ids: tuple[int, ...] | None = None) -> TargetConfig:
    path = Path(model_dir)
    if not path.exists():
        raise JaxspecError(f"target path {str(path)!r} does not exist")
    if not path.is_dir():
        raise JaxspecError(f"target path {str(path)!r} is not a directory (expected a Hugging Face model directory)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise JaxspecError(f"{str(path)!r} has no config.json; point --target at a Hugging Face model directory")
    return target_config_from_hf(read_json(config_file, "the target's config.json"), aux_layer_ids)


def rope_inv_freq(cfg: TargetConfig):
    """Inverse frequencies [head_dim/2], float32, exactly as Hugging Face computes them (incl. llama3 scaling)."""
    import numpy as np

    rope = cfg.rope
    d = cfg.head_dim
    inv_freq = (1.0 / (rope.theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))).astype(np.float32)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope.factor)
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """An EAGLE-2 dynamic draft tree's budget (jaxspec/engine/tree.py builds the trees). Here, beside the other
    frozen configs, because a head's record names trees too (checkpoints/verifier.py checks them)."""

    total_tokens: int  # nodes verified per step, the root (last emitted token) included
    depth: int  # draft levels below the root: the longest acceptable path
    top_k: int  # children proposed per expanded node, and nodes expanded per level

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise JaxspecError(f"tree {self.spec}: need TOTAL >= 2, DEPTH >= 1 and TOPK >= 1")
        if self.depth > MAX_DRAFT_DEPTH:
            raise JaxspecError(f"tree {self.spec}: DEPTH is at most {MAX_DRAFT_DEPTH}, got {self.depth}")
        if self.total_tokens - 1 > self.num_candidates:
            raise JaxspecError(
                f"tree {self.spec}: DEPTH={self.depth} and TOPK={self.top_k} propose only {self.num_candidates} "
                f"draft tokens, fewer than TOTAL-1={self.total_tokens - 1}; lower TOTAL or raise DEPTH/TOPK"
            )

    @property
    def spec(self) -> str:
        return f"{self.total_tokens},{self.depth},{self.top_k}"

    @property
    def num_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def window(self) -> int:
        """Head cache slots the expanded levels occupy above the committed length."""
        return max(self.depth - 1, 1) * self.top_k

    @property
    def cache_slots(self) -> int:
        """Cache slots a step writes above the committed length: the verify block, and the head's levels."""
        return max(self.total_tokens, self.depth + 1 + self.window)

    @classmethod
    def parse(cls, text: str) -> TreeConfig:
        """'TOTAL,DEPTH,TOPK', e.g. '32,6,8'."""
        try:
            total, depth, top_k = (int(x) for x in text.split(","))
        except ValueError:
            raise JaxspecError(f"--tree wants TOTAL,DEPTH,TOPK (three integers, e.g. 32,6,8), got {text!r}") from None
        return cls(total, depth, top_k)
