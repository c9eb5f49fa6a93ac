"""Each family's MoE block in Hugging Face `transformers` against moejax, on a checkpoint that
`save_pretrained` wrote locally: the loader reads the real on-disk layout, and the outputs
agree at 1e-4 in float32. Needs the `.[hf]` extra (transformers and a CPU torch)."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import hf, moe_apply
from tests.helpers import mesh_of, seed_of, tolerance
from tests.transformers_models import FAMILIES, hf_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # transformers' models


@pytest.mark.parametrize("model_type", FAMILIES)
def test_block_matches_transformers(model_type, tmp_path, request):
  fields, layer = FAMILIES[model_type]
  model = hf_checkpoint(model_type, dict(fields), tmp_path, seed_of(request.node.name) % 2**31)
  # The loaded model's name of the block (PEFT's adapters name it so).
  block = model.get_submodule(hf.family_of(model_type).loaded_block(layer))
  rng = np.random.default_rng(seed_of(request.node.name))
  x = rng.standard_normal((1, 24, 16)).astype(np.float32)
  with torch.no_grad():
    expected = block(torch.from_numpy(x))
  expected = (expected[0] if isinstance(expected, tuple) else expected).numpy().reshape(24, 16)

  config = hf.config_from_hf(
    __import__("json").loads((tmp_path / "config.json").read_text()), chunk_size=5
  )
  params = hf.load_layer(tmp_path, layer, config)
  mask = jnp.asarray(rng.random(24) < 0.75)
  for mesh in (None, mesh_of(2, 4)):
    y, _ = moe_apply(params, jnp.asarray(x[0]), config=config, mesh=mesh, token_mask=mask)
    want = np.where(np.asarray(mask)[:, None], expected, 0.0)
    chex.assert_trees_all_close(y, want, **tolerance(comparison="torch"))
