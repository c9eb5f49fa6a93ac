"""`python -m moejax`'s flags, in this process: flags that make no valid run exit with a
message naming them, not a traceback (the commands themselves run in tests/test_demo.py)."""

import argparse

import pytest

from moejax.apps.cli import main, parse_mesh
from moejax.apps.cli_setup import from_flags, layer_mesh, moe_config
from moejax.models import TransformerConfig

FLAGS = argparse.Namespace(
  command="demo", experts=16, top_k=2, hidden=32, intermediate=64, chunk_size="auto"
)


def test_a_mesh_flag_that_is_no_shape_exits_naming_it():
  assert parse_mesh("2x4", "train") == (2, 4)
  with pytest.raises(SystemExit, match="moejax train: --mesh must look like DATAxEXPERT"):
    parse_mesh("two-by-four", "train")
  with pytest.raises(SystemExit, match="moejax tune: --mesh sizes must be positive"):
    parse_mesh("0x8", "tune")


def test_a_mesh_the_experts_do_not_split_over_exits_naming_it():
  with pytest.raises(SystemExit, match=r"moejax demo: --mesh 1x3: num_experts=16 must be"):
    layer_mesh(FLAGS, (1, 3), moe_config(FLAGS))
  with pytest.raises(
    SystemExit, match="moejax demo: --mesh 4x4: a 4x4 mesh needs 16 devices, found 8"
  ):
    layer_mesh(FLAGS, (4, 4), moe_config(FLAGS))
  assert layer_mesh(FLAGS, (2, 4), moe_config(FLAGS)).devices.shape == (2, 4)


def test_flags_that_make_no_config_exit_naming_the_field():
  with pytest.raises(SystemExit, match="moejax demo: top_k=32 must be in"):
    moe_config(argparse.Namespace(**{**vars(FLAGS), "top_k": 32}))


@pytest.mark.parametrize(
  "flag, value, message",
  [
    ("--steps", "0", "must be a positive int, got '0'"),
    ("--vocab", "-3", "must be a positive int, got '-3'"),
    ("--learning-rate", "nan", "must be a finite number > 0, got 'nan'"),
  ],
)
def test_a_count_or_rate_flag_out_of_range_is_an_argparse_error(flag, value, message, capsys):
  with pytest.raises(SystemExit):
    main(["train", flag, value])
  assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_flags_that_make_no_transformer_exit_naming_the_field():
  train = argparse.Namespace(command="train")
  moe = moe_config(FLAGS)
  with pytest.raises(SystemExit, match="moejax train: hidden_size=32 must divide by num_heads=5"):
    from_flags(train, TransformerConfig, vocab_size=64, num_layers=2, num_heads=5, moe=moe)
  with pytest.raises(SystemExit, match="num_layers=1 with moe_every=2 has no MoE block"):
    from_flags(
      train, TransformerConfig, vocab_size=64, num_layers=1, num_heads=2, moe=moe, moe_every=2
    )


def test_help_shows_every_default_and_the_choices_from_their_tables(capsys):
  from kernels_pallas.formats import FORMATS
  from moejax.fit import PRESETS

  for command in ("demo", "train", "fit"):
    with pytest.raises(SystemExit):
      main([command, "--help"])
  shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
  for default in (
    "E, routed experts (default: 16)",
    "(default: 2x4)",
    "optimizer steps (default: 60)",
  ):
    assert default in shown, default
  assert all(name in shown for name in [*PRESETS, *FORMATS]), shown
