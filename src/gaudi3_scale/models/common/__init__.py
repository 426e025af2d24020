"""Building blocks shared by the model families: attention, MLPs, norms, rotary embeddings.

Everything here is written for one device; parallelism is applied from the outside
(`distributed.parallelize`).
"""

from gaudi3_scale.models.common.attention import Attention
from gaudi3_scale.models.common.mlp import GeluMLP, SwiGLU
from gaudi3_scale.models.common.norms import build_dropout, build_norm
from gaudi3_scale.models.common.rope import apply_rope, build_rope_cache

__all__ = ["Attention", "GeluMLP", "SwiGLU", "apply_rope", "build_dropout", "build_norm", "build_rope_cache"]
