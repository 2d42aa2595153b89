"""Shapes of the glm52 family (HF `glm_moe_dsa`, GLM-5): named configs and their validation."""

from __future__ import annotations

from dataclasses import dataclass

from longstraw_cli.models.spec import check_sizes, config_with_overrides

MLP_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")


@dataclass(frozen=True)
class Glm52Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    # dense FFN (the first layers) and one routed / shared expert
    intermediate_size: int
    moe_intermediate_size: int
    # MLA
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    # DSA lightning indexer
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    # per layer; None derives them: the first `first_k_dense_replace` dense, every indexer "full"
    mlp_layer_types: tuple[str, ...] | None = None
    indexer_types: tuple[str, ...] | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    # LongStraw's named configs admit 8M positions (the paper trains at 2M-4,456,448); HF's release says 202752.
    # Only a check (no table is sized by it): fp32 positions in RoPE are exact to 2**24.
    max_position_embeddings: int = 8_388_608
    tie_word_embeddings: bool = False

    def __post_init__(self):
        check_sizes(self, may_be_zero=("n_shared_experts", "first_k_dense_replace"))
        for name, allowed in (("mlp_layer_types", MLP_TYPES), ("indexer_types", INDEXER_TYPES)):
            value = getattr(self, name)
            if value is None:
                continue
            object.__setattr__(self, name, tuple(value))
            if len(value) != self.num_hidden_layers or not set(value) <= set(allowed):
                raise ValueError(f"{name}={list(value)} must list one of {list(allowed)} per layer "
                                 f"({self.num_hidden_layers} layers)")
        if self.layer_indexer_types[0] != "full":
            raise ValueError(f"indexer_types={list(self.layer_indexer_types)}: layer 0 must be 'full' (a 'shared' "
                             "layer reuses the previous full layer's top-k)")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.index_head_dim:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= index_head_dim "
                             f"({self.index_head_dim}): the indexer rotates its first qk_rope_head_dim dims")
        if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"n_routed_experts={self.n_routed_experts}, n_group={self.n_group}, "
                             f"topk_group={self.topk_group}: experts must split into groups, "
                             "1 <= topk_group <= n_group")
        if self.n_routed_experts // self.n_group < 2 and self.n_group > 1:
            raise ValueError("group scores sum the top-2 experts of a group: need >= 2 experts per group")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts * self.topk_group // self.n_group:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} does not fit in {self.topk_group} "
                             f"of {self.n_group} groups of {self.n_routed_experts // self.n_group} experts")

    @property
    def layer_mlp_types(self) -> tuple[str, ...]:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types
        n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
        return ("dense",) * n_dense + ("sparse",) * (self.num_hidden_layers - n_dense)

    @property
    def layer_indexer_types(self) -> tuple[str, ...]:
        return self.indexer_types if self.indexer_types is not None else ("full",) * self.num_hidden_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


NAMED_CONFIGS: dict[str, Glm52Config] = {
    # GLM-5 (HF GlmMoeDsaConfig defaults): ~750B parameters; never instantiated outside device="meta"
    "glm52": Glm52Config(
        vocab_size=154880, hidden_size=6144, num_hidden_layers=78, intermediate_size=12288,
        moe_intermediate_size=2048, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=256, num_experts_per_tok=8,
    ),
    # GPU benchmark shape: same per-token attention/resident layout (512 + 64 latent, 128 index dims), fewer
    # layers, heads and experts (~2.2B parameters)
    "glm52_mini": Glm52Config(
        vocab_size=154880, hidden_size=2048, num_hidden_layers=12, intermediate_size=6144,
        moe_intermediate_size=768, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=32, num_experts_per_tok=4,
        first_k_dense_replace=1, index_n_heads=16,
        indexer_types=("full", "shared", "shared", "full", "shared", "shared") * 2,
    ),
    # CPU tests: a dense first layer, full and shared indexer layers, grouped routing, top-16 selection
    "glm52_tiny": Glm52Config(
        vocab_size=259, hidden_size=64, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32,
        num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        index_topk=16, index_head_dim=16, index_n_heads=4, indexer_types=("full", "shared", "full", "shared"),
        max_position_embeddings=65_536,
    ),
}


def named_config(name: str, **overrides) -> Glm52Config:
    base = NAMED_CONFIGS.get(name)
    # a depth override invalidates explicit per-layer patterns of the named shape: derive them again
    if base is not None and overrides.get("num_hidden_layers", base.num_hidden_layers) != base.num_hidden_layers:
        overrides.setdefault("mlp_layer_types", None)
        if "indexer_types" not in overrides and base.indexer_types is not None:
            pattern = base.indexer_types
            overrides["indexer_types"] = tuple(pattern[i % len(pattern)] for i in range(overrides["num_hidden_layers"]))
    return config_with_overrides("glm52", NAMED_CONFIGS, name, overrides)
