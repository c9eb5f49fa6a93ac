"""`moejax.hf`: tiny checkpoints written here in each family's real key names and layouts,
loaded and run on one device and on the 2x4 mesh, against NumPy versions of each family's MoE
block (`tests/hf_checkpoints.py`, not moejax's reference); sharded checkpoints; placement on a
mesh; errors."""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from moejax import hf, moe_apply
from moejax.hf import peft
from tests.helpers import mesh_id, mesh_of, random_adapters, seed_of, slow, tolerance
from tests.hf_checkpoints import FAMILIES, D, E, F, T, save_raw, write_checkpoint


@pytest.mark.parametrize("mesh_shape", [slow(None), (2, 4)], ids=mesh_id)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_loads_and_matches_its_numpy_block(model_type, mesh_shape, tmp_path, request):
  layer = 3
  hf_config, get = write_checkpoint(tmp_path, model_type, layer, seed=seed_of(request.node.name))
  config = hf.config_from_hf(hf_config, chunk_size=5)
  params = hf.load_layer(tmp_path, layer, config)
  rng = np.random.default_rng(seed_of(request.node.name) + 1)
  x = rng.standard_normal((T, D)).astype(np.float32)
  mask = rng.random(T) < 0.7
  expected = np.where(
    mask[:, None], FAMILIES[model_type][3](x.astype(np.float64), get, hf_config), 0
  )
  mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
  y, _ = moe_apply(params, jnp.asarray(x), config=config, mesh=mesh, token_mask=jnp.asarray(mask))
  chex.assert_trees_all_close(y, expected.astype(np.float32), **tolerance())


def test_sharded_checkpoint_loads_straight_onto_a_mesh(tmp_path):
  write_checkpoint(tmp_path, "deepseek_v3", layer=1, shards=3)
  mesh = mesh_of(2, 4)
  on_mesh = hf.load_layer(tmp_path, 1, mesh=mesh)
  on_host = hf.load_layer(tmp_path, 1)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, on_mesh), on_host)
  assert on_mesh.w_gate_up.sharding.spec[0] == "expert"
  assert on_mesh.w_gate_up.addressable_shards[0].data.shape == (E // 4, D, 2 * F)
  assert on_mesh.router_kernel.sharding.is_fully_replicated


def test_a_bfloat16_checkpoint_loads(tmp_path):
  """Released checkpoints are mostly bfloat16, a dtype safetensors' NumPy reader lacks."""
  write_checkpoint(tmp_path, "qwen3_moe", layer=0)
  as_float32 = hf.load_layer(tmp_path, 0)
  with safe_open(tmp_path / "model.safetensors", "np") as file:
    tensors = {k: file.get_tensor(k).astype(ml_dtypes.bfloat16) for k in file.keys()}  # noqa: SIM118
  save_raw(tensors, tmp_path / "model.safetensors", "BF16")
  rounded = jax.tree.map(lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32), as_float32)
  as_stated = hf.config_from_hf(tmp_path, param_dtype="float32")
  chex.assert_trees_all_equal(hf.load_layer(tmp_path, 0, as_stated), rounded)
  # config.json's dtype is the parameters' (transformers 5 writes `dtype`, 4 `torch_dtype`).
  hf_config = json.loads((tmp_path / "config.json").read_text())
  for key in ("dtype", "torch_dtype"):
    (tmp_path / "config.json").write_text(json.dumps({**hf_config, key: "bfloat16"}))
    assert hf.config_from_hf(tmp_path).param_dtype == jnp.bfloat16
    in_bf16 = hf.load_layer(tmp_path, 0)
    dtypes = {name: a.dtype for name, a in in_bf16._asdict().items() if a is not None}
    bf16 = jnp.dtype(jnp.bfloat16)
    assert dtypes == {"router_kernel": jnp.float32, "w_gate_up": bf16, "w_down": bf16}
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a.astype(np.float32), in_bf16), rounded)
  assert hf.config_from_hf(tmp_path, param_dtype="float32").param_dtype == jnp.float32


def test_missing_tensor_names_the_key(tmp_path):
  write_checkpoint(tmp_path, "mixtral", layer=0)
  with pytest.raises(KeyError, match=r"model\.layers\.2\.block_sparse_moe\.gate\.weight"):
    hf.load_layer(tmp_path, 2)


def test_a_dense_layer_names_the_moe_layers(tmp_path):
  hf_config, _ = write_checkpoint(tmp_path, "deepseek_v3", layer=1)
  deep = {**hf_config, "num_hidden_layers": 6, "first_k_dense_replace": 2}
  (tmp_path / "config.json").write_text(json.dumps(deep))
  with pytest.raises(ValueError, match=r"layer 0 is not an MoE layer.*dense.*MoE layers are 2-5"):
    hf.load_layer(tmp_path, 0)
  with pytest.raises(ValueError, match=r"layer 6 is not an MoE layer.*outside the model's 6"):
    hf.load_layer(tmp_path, 6)


def test_shape_mismatch_names_the_key_and_shapes(tmp_path):
  hf_config, _ = write_checkpoint(tmp_path, "qwen3_moe", layer=0)
  wider = hf.config_from_hf({**hf_config, "moe_intermediate_size": F + 1})
  with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight.*\(12, 16\).*\(13, 16\)"):
    hf.load_layer(tmp_path, 0, wider)


def test_the_config_from_a_path_or_a_transformers_config(tmp_path):
  """config.json's folder or file, or an object with `to_dict()` (a transformers config),
  read as its dict; anything else named."""
  hf_config, _ = write_checkpoint(tmp_path, "qwen3_moe", layer=0)
  expected = hf.config_from_hf(hf_config)

  class TransformersConfig:
    def to_dict(self):
      return dict(hf_config)

  for given in (tmp_path, str(tmp_path / "config.json"), TransformersConfig()):
    assert hf.config_from_hf(given) == expected
  with pytest.raises(TypeError, match=r"config must be config\.json as a dict.*got int"):
    hf.config_from_hf(3)


def test_unsupported_family_lists_the_supported_ones():
  with pytest.raises(ValueError, match=r"model_type='bert'.*'mixtral'"):
    hf.config_from_hf({"model_type": "bert", "hidden_size": 8})


@pytest.mark.parametrize("layout", peft.LAYOUTS)
def test_adapters_written_read_back_onto_a_mesh(layout, tmp_path):
  """save_lora then load_lora: the same adapters (the per-expert layout fuses gate's and up's
  A: rank 2r, with the same products), placed over the expert axis."""
  hf_config, _ = write_checkpoint(tmp_path, "deepseek_v3", layer=1)
  config = hf.config_from_hf(hf_config, lora_rank=3, lora_alpha=2.0)
  expert, shared = random_adapters(config, jax.random.key(0), scale=1.0)
  params = hf.load_layer(tmp_path, 1, config)._replace(lora=expert, shared_lora=shared)
  hf.save_lora(tmp_path / "adapter", {1: params}, config, model_type="deepseek_v3", layout=layout)
  mesh = mesh_of(2, 4)
  back = hf.load_lora(tmp_path / "adapter", 1, config, model_type="deepseek_v3", mesh=mesh)
  assert back.lora.gate_up_a.sharding.spec[0] == "expert"
  delta = lambda adapters, c: [c.lora_scale * np.einsum("...ir,...ro->...io", a, b)
                               for a, b in (adapters[:2], adapters[2:])]  # fmt: skip
  for ours, theirs in ((back.lora, expert), (back.shared_lora, shared)):
    got = jax.tree.map(np.asarray, ours)
    chex.assert_trees_all_close(
      delta(got, back.config), delta(theirs, config), **tolerance(comparison="reordered")
    )
  before = (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
  with pytest.raises(FileExistsError, match=r"adapter_model\.safetensors exists.*overwrite=True"):
    hf.save_lora(tmp_path / "adapter", {1: params}, config, model_type="deepseek_v3")
  assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == before
  assert back.config.lora_rank == 6 and back.config.lora_scale == config.lora_scale


def test_adapter_errors_name_the_tensor(tmp_path):
  hf_config, _ = write_checkpoint(tmp_path, "qwen3_moe", layer=0)
  config = hf.config_from_hf(hf_config, lora_rank=2)
  params = hf.load_layer(tmp_path, 0, config)._replace(
    lora=random_adapters(config, jax.random.key(1), scale=1.0)[0]
  )
  hf.save_lora(tmp_path / "adapter", {0: params}, config, model_type="qwen3_moe")
  read = lambda layer=0, **changes: hf.load_lora(
    tmp_path / "adapter", layer, dataclasses.replace(config, **changes), model_type="qwen3_moe"
  )
  with pytest.raises(KeyError, match=r"layers\.5\.mlp\.experts"):
    read(layer=5)  # another layer (or another model's file)
  with pytest.raises(
    ValueError, match=r"experts.*lora_A/B\.weight have shapes .* expected gate_up: A \[r\*8, 17\]"
  ):
    read(hidden_size=D + 1, intermediate_size=F)
  with pytest.raises(NotImplementedError, match="no adapter layout"):
    hf.save_lora(tmp_path / "dbrx", {0: params}, config, model_type="dbrx")
  with pytest.raises(NotImplementedError, match="use layout='fused'"):
    hf.save_lora(tmp_path / "oss", {0: params}, config, model_type="gpt_oss", layout="per_expert")
  with pytest.raises(ValueError, match=r"params\.lora must be a moejax\.lora\.ExpertLoRA"):
    hf.save_lora(tmp_path / "none", {0: params._replace(lora=None)}, config, model_type="qwen3_moe")


def test_multimodal_text_fields_nested_or_at_the_top_level():
  """A multimodal model's text fields in `text_config` (as transformers writes them) or at the
  top level (as Dots3-Note publishes them) read the same."""
  fields = dict(
    hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
    n_shared_experts=2, shared_experts_intermediate_size=12, n_group=4, topk_group=2,
    num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
  )  # fmt: skip
  nested = {"model_type": "dots3_note", "text_config": fields}
  top_level = {"model_type": "dots3_note", **fields}
  assert hf.config_from_hf(nested) == hf.config_from_hf(top_level)
  assert hf.config_from_hf(top_level).shared_intermediate_size == 24
  assert hf.moe_layers(nested) == hf.moe_layers(top_level) == (1, 2)
