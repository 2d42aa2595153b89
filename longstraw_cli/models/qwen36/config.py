"""Shapes of the qwen36 family (HF `qwen3_5_text`): named configs and their validation."""

from __future__ import annotations

from dataclasses import dataclass

from longstraw_cli.models.spec import check_sizes, config_with_overrides


@dataclass(frozen=True)
class Qwen36Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    # LongStraw's named configs admit 8M positions (the paper trains at 2M-4,456,448); HF's release says 262144.
    # Only a check (no table is sized by it): fp32 positions in RoPE are exact to 2**24.
    max_position_embeddings: int = 8_388_608
    tie_word_embeddings: bool = False

    def __post_init__(self):
        check_sizes(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives an unusable rotary dim")

    @property
    def layer_types(self) -> tuple[str, ...]:
        # HF: layer i is full attention when (i + 1) % interval == 0, else linear (GDN).
        return tuple(
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )


NAMED_CONFIGS: dict[str, Qwen36Config] = {
    # Qwen3.6-27B
    "qwen36": Qwen36Config(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128,
    ),
    # benchmark shape, ~2.4B
    "qwen36_mini": Qwen36Config(
        vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=8, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128,
    ),
    # CPU tests: two (3 GDN + 1 attention) groups, byte-level vocab
    "qwen36_tiny": Qwen36Config(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, rope_theta=10_000.0, max_position_embeddings=65_536,
    ),
}


def named_config(name: str, **overrides) -> Qwen36Config:
    return config_with_overrides("qwen36", NAMED_CONFIGS, name, overrides)
