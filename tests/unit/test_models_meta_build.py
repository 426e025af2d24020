"""Building a model on the meta device (what plan, tune --estimate-only and the launcher's forecast do to read its
shape) runs no torch decomposition: torch._dynamo stays unimported (1.1 s of each such command). The work skipped
there still happens where the weights get storage: embeddings drawn when built on a real device, the RoPE cache
rebuilt, and MoE experts set to run eagerly under torch.compile."""

from __future__ import annotations

import ast
import subprocess
import sys

import torch

from gaudi3_scale.models import list_models
from gaudi3_scale.models.common.rope import build_rope_cache

_META = """
import sys
from dataclasses import replace
import torch
from gaudi3_scale.models import get_model_config
from gaudi3_scale.models.build import build_model
shapes = {}
for name in sys.argv[1:]:
    cfg = get_model_config(name)
    cfg = cfg if cfg.vocab_size else replace(cfg, vocab_size=65)
    with torch.device("meta"):
        model = build_model(cfg)
    assert all(p.is_meta for p in model.parameters()), name
    shapes[name] = None if model.rope_cache is None else tuple(model.rope_cache.shape)
    assert "torch._dynamo" not in sys.modules, f"building {name} on meta imported torch._dynamo"
print(shapes)
"""

_MOE_ON_CPU = """
from dataclasses import replace
from gaudi3_scale.models import get_model_config
from gaudi3_scale.models.build import build_model
from gaudi3_scale.models.common.moe import GroupedExperts
model = build_model(replace(get_model_config("moe-tiny"), vocab_size=65))  # on meta, then to_empty on the CPU
assert GroupedExperts.__dict__.get("_eager_under_compile"), "experts left to be compiled"
print("ok")
"""


def test_every_model_builds_on_meta_without_importing_dynamo() -> None:
    names = list_models()
    done = subprocess.run([sys.executable, "-c", _META, *names], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shapes = ast.literal_eval(done.stdout)  # the dict the snippet printed
    assert set(shapes) == set(names)
    from gaudi3_scale.models import get_model_config

    for name, shape in shapes.items():
        cfg = get_model_config(name)
        if cfg.arch == "llama":  # the same shape as the cache computed on a real device
            want = build_rope_cache(cfg.head_dim, 4, cfg.rope_theta).shape[1:]
            assert shape == (cfg.context_length, *want), name
        else:
            assert shape is None, name


def test_a_moe_model_materialized_from_meta_runs_its_experts_eagerly_under_compile() -> None:
    done = subprocess.run([sys.executable, "-c", _MOE_ON_CPU], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_model_built_directly_on_the_cpu_has_drawn_embeddings() -> None:
    from dataclasses import replace

    from gaudi3_scale.models import get_model_config
    from gaudi3_scale.models.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(
        replace(get_model_config("shakespeare-char"), vocab_size=65)
    )  # nn.Embedding's N(0, 1)
    for table in (model.tok_embeddings.weight.detach(), model.pos_embeddings.weight.detach()):
        assert torch.isfinite(table).all() and 0.9 < float(table.std()) < 1.1
