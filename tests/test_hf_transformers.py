"""Each family's MoE blocks in Hugging Face `transformers` against moejax, on a multi-layer
checkpoint that `save_pretrained` wrote locally: the loader reads the real on-disk layout and
finds the MoE layers, the outputs agree at 1e-4 in float32, and whole models with moejax's
blocks give transformers' logits. Needs the `.[hf]` extra (transformers and a CPU torch)."""

import dataclasses
import json
import shutil

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import hf, moe_apply
from moejax.params import ROUTER_PARAMS
from moejax.stacking import layer_of
from tests.helpers import mesh_of, seed_of, tolerance
from tests.transformers_models import BESIDE_BLOCK, FAMILIES, LAYERS, OUTPUT_NORM, hf_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.extras]  # transformers' models


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_moe_layer_loads_and_matches_transformers(model_type, tmp_path, request):
  """`hf.moe_layers` names the layers transformers built as MoE (the others dense),
  `hf.load_stack` loads them all (one config for all where the family's layers agree; each
  layer's own where they differ, `load_stack` then refusing them), and each one's output is
  transformers' block's, the last one's on the 2x4 mesh as well (stacks loaded onto meshes:
  tests/test_mesh_kinds.py). A block with parts (ERNIE-4.5-VL's text and vision experts) is
  one MoE layer per part, each run on its own tokens, the outputs added."""
  seed = seed_of(request.node.name)
  fields, _ = FAMILIES[model_type]
  model = hf_checkpoint(model_type, dict(fields), tmp_path, seed % 2**31)
  family = hf.family_of(model_type)
  # The loaded model's name of each block (PEFT's adapters name it so).
  blocks = [model.get_submodule(family.loaded_block(i)) for i in range(LAYERS)]
  layers = hf.moe_layers(tmp_path)
  assert layers == tuple(i for i, block in enumerate(blocks) if is_moe_block(block))
  parts = list(family.parts or [None])
  if family.parts:
    with pytest.raises(ValueError, match=r"pass part= one of \['text', 'vision'\]"):
      hf.config_from_hf(tmp_path)
  loaded = {part: loaded_layers(tmp_path, layers, part) for part in parts}
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((24, 16)).astype(np.float32)
  mask = rng.random(24) < 0.75
  token_ids = rng.integers(0, 32, 24)
  token_types = rng.integers(0, len(parts), 24)  # the part each token goes to
  hash_routes = hf.load_hash_routes(tmp_path)  # layers routed by token id: DeepSeek-V4's

  def moejax_output(position: int, layer: int, mesh=None) -> np.ndarray:
    given = hash_routes[layer][token_ids] if layer in hash_routes else None
    inputs, logits = layer_inputs(blocks[layer], model_type, x)
    y = 0.0
    for index, part in enumerate(parts):
      configs, params_of = loaded[part]
      part_mask = jnp.asarray(mask & (token_types == index))
      y = y + moe_apply(
        params_of(position), inputs, config=configs[position], mesh=mesh, token_mask=part_mask,
        expert_ids=given, router_logits=logits,
      )[0]  # fmt: skip
    return decoder_norm(blocks[layer], model_type, y)

  for position, layer in enumerate(layers):
    ids = token_ids if layer in hash_routes else None
    types = token_types if family.parts else None
    want = np.where(mask[:, None], moe_output(model, model_type, layer, x, ids, types), 0.0)
    chex.assert_trees_all_close(
      moejax_output(position, layer), want, **tolerance(comparison="torch")
    )
  y = moejax_output(position, layer, mesh_of(2, 4))
  chex.assert_trees_all_close(y, want, **tolerance(comparison="torch"))  # the last layer's
  if model_type == "deepseek_v4":
    assert list(hash_routes) == [0]
  if model_type in FLOAT32_ROUTERS:
    check_a_bfloat16_copy(model, model_type, tmp_path, layer, parts[0], x, mask)


def float32_routers() -> dict[str, list[str]]:
  """{model type: the router tensors its transformers model keeps in float32 whatever the
  model's dtype (`_keep_in_fp32_modules_strict`)}: the families whose bfloat16 checkpoints
  store a float32 router weight or selection bias."""
  from transformers.models.auto import modeling_auto

  found = {}
  for model_type in FAMILIES:
    name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(
      model_type, modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
    )
    kept = getattr(getattr(transformers, name or "", None), "_keep_in_fp32_modules_strict", None)
    router = [k for k in kept or () if k.endswith(ROUTER_TENSORS)] if isinstance(kept, list) else []
    if router:
      found[model_type] = router
  return found


ROUTER_TENSORS = ("gate.weight", "e_score_correction_bias", "expert_bias")
FLOAT32_ROUTERS = float32_routers()


def check_a_bfloat16_copy(model, model_type: str, path, layer: int, part, x, mask) -> None:
  """The model loaded by transformers in bfloat16 and saved: its router weight and selection
  bias stay float32 on disk, moejax loads them as float32 (bit for bit the float32 model's)
  beside bfloat16 experts, and on the 2x4 mesh every token's output is the bfloat16 block's
  at bfloat16's tolerance (a token sent to another expert is off by about half its norm;
  a block with parts takes its tokens' types: the dtypes and values of its first part)."""
  copy = path / "bf16"
  type(model).from_pretrained(path, dtype=torch.bfloat16).save_pretrained(copy)
  in_bf16 = type(model).from_pretrained(copy, dtype=torch.bfloat16)
  config = hf.config_from_hf(copy, layer=layer, part=part, chunk_size=5)
  assert config.param_dtype == jnp.bfloat16
  params = hf.load_layer(copy, layer, config, mesh=mesh_of(2, 4), part=part)
  as_float32 = dataclasses.replace(config, param_dtype=jnp.float32)
  as_stored = hf.load_layer(copy, layer, as_float32, part=part)
  for name in ROUTER_PARAMS:  # nothing rounded past what the file holds
    if getattr(params, name) is not None:
      assert getattr(params, name).dtype == jnp.float32, name
      np.testing.assert_array_equal(getattr(params, name), getattr(as_stored, name), err_msg=name)
  float32 = hf.load_layer(path, layer, part=part)  # what the float32 model had
  kept = FLOAT32_ROUTERS[model_type]
  if any(name.endswith("gate.weight") for name in kept):
    np.testing.assert_array_equal(params.router_kernel, float32.router_kernel)
  if any(name.endswith("bias") for name in kept):
    np.testing.assert_array_equal(params.routing_bias, float32.routing_bias)
  assert params.w_down.dtype == jnp.bfloat16
  if model_type in BESIDE_BLOCK or model_type in OUTPUT_NORM or part is not None:
    return  # the block alone is not the layer's output, or needs its tokens' types
  x = np.array(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  y, _ = moe_apply(params, jnp.asarray(x), config=config, mesh=mesh_of(2, 4), token_mask=mask)
  block = in_bf16.get_submodule(hf.family_of(model_type).loaded_block(layer))
  with torch.no_grad():
    out = block(torch.from_numpy(x[None]).to(torch.bfloat16))
  want = (out[0] if isinstance(out, tuple) else out).float().numpy().reshape(x.shape)
  want = np.where(mask[:, None], want, 0.0)
  errors = np.abs(np.asarray(y) - want).max(-1) / np.maximum(np.abs(want).max(-1), 1e-6)
  assert errors.max() < 0.05, f"rows off by {np.sort(errors)[-3:]} relative"


def loaded_layers(path, layers, part):
  """(each layer's config, position -> its params) of `part`'s MoE layers: one stack where
  the layers' configs agree, else each layer by itself (`load_stack` refusing them)."""
  configs = [hf.config_from_hf(path, layer=layer, part=part, chunk_size=5) for layer in layers]
  if len(set(configs)) == 1:
    stack = hf.load_stack(path, configs[0], progress=False, part=part)
    return configs, lambda position: layer_of(stack, position)
  with pytest.raises(ValueError, match="different configs"):  # Step-3.7's per-layer clamps
    hf.load_stack(path, progress=False, part=part)
  return configs, lambda position: hf.load_layer(path, layers[position], configs[position])


def layer_inputs(block, model_type: str, x: np.ndarray):
  """moejax's layer's inputs for the block's input x [T, D]: (its x, router logits or None).
  Gemma 4's experts read x through their own norm, its router through another; Doge's
  block routes a batch by mixed logits (`doge_batch_logits`); ZAYA's layer has no router."""
  if model_type == "doge":
    return jnp.asarray(x), jnp.asarray(doge_batch_logits(block, x))
  if model_type == "zaya":  # its router is the model's: `test_zaya_router_state_flows`
    with torch.no_grad():
      return jnp.asarray(x), jnp.asarray(block.gate(torch.from_numpy(x[None]))[0].numpy())
  if not model_type.startswith("gemma4"):
    return jnp.asarray(x), None
  router = block.router
  with torch.no_grad():
    tokens = torch.from_numpy(x)
    normed = router.norm(tokens) * router.scale * router.scalar_root_size
    logits = router.proj(normed)
    inputs = block.pre_feedforward_layernorm_2(tokens)
  return jnp.asarray(inputs.numpy()), jnp.asarray(logits.numpy())


def doge_batch_logits(block, x: np.ndarray) -> np.ndarray:
  """The [T, E] logits Doge's block routes tokens x [T, D] by in one forward pass: its
  product-key logits [T, 2 n] read as [2, T, n] (a token's x keys are half of token t // 2's
  logits, its y keys half of token (T + t) // 2's: transformers notes that this mixes tokens),
  expert a n + b scored x_a + y_b. A token alone (generation) is routed by its own logits."""
  with torch.no_grad():
    keys = block.router_gate(torch.from_numpy(x)).reshape(2, len(x), -1).numpy()
  return (keys[0][:, :, None] + keys[1][:, None, :]).reshape(len(x), -1)


def is_moe_block(block) -> bool:
  """Whether a decoder layer's FFN module is an MoE block: experts, JetMoE's router, Doge's
  product keys, or ERNIE-4.5-VL's text and vision blocks."""
  return any(hasattr(block, name) for name in ("experts", "router", "router_gate", "text_moe"))


def decoder_norm(block, model_type: str, y) -> np.ndarray:
  """moejax's output y [T, D] through the norm the family's block applies to its output
  (`OUTPUT_NORM`; the decoder layer's in the checkpoint), if any."""
  if model_type not in OUTPUT_NORM:
    return np.asarray(y)
  with torch.no_grad():
    return getattr(block, OUTPUT_NORM[model_type])(torch.from_numpy(np.array(y))).numpy()


def block_output(block, x: np.ndarray, token_ids=None, token_types=None) -> np.ndarray:
  """A transformers MoE block's output for tokens x [T, D] (routed by `token_ids` [T] in a
  hash-routed block; split by `token_types` [T] in a block with parts)."""
  ids = {} if token_ids is None else {"input_ids": torch.from_numpy(token_ids[None])}
  if token_types is not None:  # ERNIE-4.5-VL's: 0 text, 1 vision
    ids["moe_mm_token_type_ids"] = torch.from_numpy(token_types[None])
  with torch.no_grad():
    out = block(torch.from_numpy(x[None]), **ids)
  return (out[0] if isinstance(out, tuple) else out).numpy().reshape(x.shape)


def moe_output(
  model, model_type: str, layer: int, x: np.ndarray, token_ids, token_types=None
) -> np.ndarray:
  """Decoder layer `layer`'s MoE output for tokens x [T, D]: its block's, plus the shared MLP
  beside the block where the family has one (`BESIDE_BLOCK`)."""
  block = hf.family_of(model_type).loaded_block(layer)
  if model_type.startswith("gemma4"):  # the router and experts of the decoder layer
    decoder = model.get_submodule(block)
    with torch.no_grad():
      _, weights, ids = decoder.router(torch.from_numpy(x))
      inputs = decoder.pre_feedforward_layernorm_2(torch.from_numpy(x))
      return decoder.experts(inputs, ids, weights).numpy()
  out = block_output(model.get_submodule(block), x, token_ids, token_types)
  if model_type in BESIDE_BLOCK:
    beside = model.get_submodule(f"{block.rsplit('.', 1)[0]}.{BESIDE_BLOCK[model_type]}")
    out = out + block_output(beside, x)
  return out


class MoejaxBlock(torch.nn.Module):
  """A transformers MoE block's stand-in: moejax's layer on the mesh, counting its calls."""

  def __init__(self, params, config, mesh):
    super().__init__()
    self.params, self.config, self.mesh, self.calls = params, config, mesh, 0

  def forward(self, hidden_states):
    self.calls += 1
    x = jnp.asarray(hidden_states.detach().numpy())
    y, _ = moe_apply(self.params, x, config=self.config, mesh=self.mesh)
    return torch.from_numpy(np.array(y))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_a_model_with_moejax_blocks_gives_transformers_logits(model_type, tmp_path, request):
  """The whole model: transformers' decoder with each MoE block replaced by moejax's (the
  stack loaded onto the 2x4 mesh) gives the logits of transformers alone. Mixtral's blocks
  are renamed as they load, Qwen2-MoE's have a gated shared expert, DeepSeek-V3's first layer
  is dense and its routing grouped."""
  seed = seed_of(request.node.name)
  fields, _ = FAMILIES[model_type]
  model = hf_checkpoint(model_type, dict(fields), tmp_path, seed % 2**31)
  tokens = torch.from_numpy(np.random.default_rng(seed).integers(0, 32, (2, 12)))
  with torch.no_grad():
    want = model(tokens).logits.numpy()
  mesh = mesh_of(2, 4)
  config = hf.config_from_hf(tmp_path)
  stack = hf.load_stack(tmp_path, config, mesh=mesh, progress=False)
  layers = hf.moe_layers(tmp_path)
  stand_ins = [MoejaxBlock(layer_of(stack, i), config, mesh) for i in range(len(layers))]
  for layer, stand_in in zip(layers, stand_ins, strict=True):
    model.set_submodule(hf.family_of(model_type).loaded_block(layer), stand_in)
  with torch.no_grad():
    logits = model(tokens).logits.numpy()
  assert [block.calls for block in stand_ins] == [1] * len(layers)
  chex.assert_trees_all_close(logits, want, **tolerance(comparison="torch"))


def test_a_step3p5_text_checkpoint_reads_as_step3p7s_text_model(tmp_path, request):
  """Step-3.5's text-only config.json (flat, in its legacy names: `moe_num_experts`,
  `moe_top_k`, `moe_layers_enum`) over Step-3.7's tensors: the same MoE layers, configs and
  weights as the vision-language model's nested text model."""
  fields, layer = FAMILIES["step3p7"]
  hf_checkpoint("step3p7", dict(fields), tmp_path / "vl", seed_of(request.node.name) % 2**31)
  shutil.copytree(tmp_path / "vl", tmp_path / "text")
  text = json.loads((tmp_path / "vl" / "config.json").read_text())["text_config"]
  renames = {"n_routed_experts": "moe_num_experts", "num_experts_per_tok": "moe_top_k"}
  text = {renames.get(name, name): value for name, value in text.items()}
  del text["mlp_layer_types"]
  text.update(model_type="step3p5", moe_layers_enum="1,2")
  (tmp_path / "text" / "config.json").write_text(json.dumps(text))
  assert hf.moe_layers(tmp_path / "text") == hf.moe_layers(tmp_path / "vl") == (1, 2)
  config = hf.config_from_hf(tmp_path / "vl", layer=layer)
  assert hf.config_from_hf(tmp_path / "text", layer=layer) == config
  with pytest.raises(ValueError, match=r"layer 0 is not an MoE layer .* MoE layers are 1-2"):
    hf.config_from_hf(tmp_path / "text", layer=0)
  chex.assert_trees_all_equal(
    hf.load_layer(tmp_path / "text", layer), hf.load_layer(tmp_path / "vl", layer)
  )


def test_doge_routes_a_token_alone_by_its_own_logits(tmp_path, request):
  """Doge's loaded router kernel (its product keys' sums) routes each token by its own
  logits: moejax's layer on a batch gives what transformers' block gives each token alone
  (as in generation), which is not what the block gives the batch at once."""
  seed = seed_of(request.node.name)
  fields, layer = FAMILIES["doge"]
  model = hf_checkpoint("doge", dict(fields), tmp_path, seed % 2**31)
  config = hf.config_from_hf(tmp_path, chunk_size=5)
  x = np.random.default_rng(seed).standard_normal((12, 16)).astype(np.float32)
  block = model.get_submodule(hf.family_of("doge").loaded_block(layer))
  alone = np.concatenate([block_output(block, token[None]) for token in x])
  y, _ = moe_apply(hf.load_layer(tmp_path, layer), jnp.asarray(x), config=config)
  chex.assert_trees_all_close(y, alone, **tolerance(comparison="torch"))
  assert not np.allclose(block_output(block, x), alone, atol=1e-2)


def test_zaya_router_state_flows_from_layer_to_layer(tmp_path, request):
  """ZAYA's router in JAX (`hf.zaya_router_logits`): each MoE layer's logits and the state it
  passes on are transformers', the second layer's from the first's state, and the layer
  given those logits is the block given that state; tokens whose choice is the skip class
  get nothing."""
  seed = seed_of(request.node.name)
  fields, _ = FAMILIES["zaya"]
  model = hf_checkpoint("zaya", dict(fields), tmp_path, seed % 2**31)
  with torch.no_grad():  # the skip class biased as the most biased expert: some tokens skip
    for layer in hf.moe_layers(tmp_path):
      bias = model.get_submodule(hf.family_of("zaya").loaded_block(layer)).gate.balancing_biases
      bias[-1] = bias[:-1].max()
  model.save_pretrained(tmp_path)
  config = hf.config_from_hf(tmp_path, chunk_size=5)
  x = np.random.default_rng(seed).standard_normal((12, 16)).astype(np.float32)
  tokens, state, want_state = torch.from_numpy(x[None]), None, None
  skipped = []
  for layer in hf.moe_layers(tmp_path)[:2]:
    block = model.get_submodule(hf.family_of("zaya").loaded_block(layer))
    with torch.no_grad():
      want_logits, *_, next_state = block.gate(tokens, want_state)
      want, _ = block(tokens, want_state)
    logits, state = hf.zaya_router_logits(hf.load_zaya_router(tmp_path, layer), x, state)
    chex.assert_trees_all_close(
      (logits, state), (want_logits.numpy(), next_state.numpy()[0]), **tolerance(comparison="torch")
    )
    y, aux = moe_apply(hf.load_layer(tmp_path, layer), x, config=config, router_logits=logits)
    chex.assert_trees_all_close(y, want.numpy()[0], **tolerance(comparison="torch"))
    skips = np.asarray(aux.expert_ids)[:, 0] == config.num_experts
    assert not np.asarray(y)[skips].any()
    skipped.append(skips.sum())
    want_state = next_state
  assert sum(skipped) > 0, "no token chose the skip class: the check above checked nothing"
  with pytest.raises(ValueError, match=r"state has shape \(12, 3\); expected \(12, 8\)"):
    hf.zaya_router_logits(hf.load_zaya_router(tmp_path, 1), x, state[:, :3])
  with pytest.raises(ValueError, match=r"x has shape \(12, 5\); expected \[\.\.\., hidden_size="):
    hf.zaya_router_logits(hf.load_zaya_router(tmp_path, 1), x[:, :5], state)
