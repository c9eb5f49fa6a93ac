"""The placement policy (`moejax.eplb`) against deepseek-ai/EPLB's published example, and its
invariants on random loads."""

import chex
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax import eplb

# deepseek-ai/EPLB's README: 2 layers x 12 experts, 16 physical, 4 groups, 2 nodes, 8 GPUs.
README_LOAD = np.array(
  [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
  ]
)
README_PHY2LOG = np.array(
  [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
  ]
)


def check_consistent(placement: eplb.Placement, experts: int, physical: int) -> None:
  """The three fields describe one map: every slot listed once, under its own expert."""
  chex.assert_shape(placement.physical_to_logical, (physical,))
  chex.assert_shape(placement.logical_to_physical, (experts, physical - experts + 1))
  counts = np.bincount(placement.physical_to_logical, minlength=experts)
  chex.assert_trees_all_equal(placement.replica_counts, counts.astype(np.int32))
  assert counts.min() >= 1 and counts.sum() == physical
  slots = placement.logical_to_physical
  listed = slots[slots >= 0]
  chex.assert_trees_all_equal(np.sort(listed), np.arange(physical))
  for expert in range(experts):
    mine = slots[expert][: counts[expert]]
    assert np.all(placement.physical_to_logical[mine] == expert)
    assert np.all(slots[expert][counts[expert] :] == -1)


def test_reproduces_deepseeks_published_example():
  placement = eplb.rebalance(README_LOAD, num_physical=16, num_devices=8, num_groups=4, num_nodes=2)
  chex.assert_trees_all_equal(placement.physical_to_logical, README_PHY2LOG.astype(np.int32))
  for layer in range(2):
    check_consistent(eplb.Placement(*(field[layer] for field in placement)), 12, 16)


@settings(max_examples=40, deadline=None)
@given(
  experts_per_group=st.integers(1, 4),
  groups=st.sampled_from([1, 2, 4]),
  nodes=st.sampled_from([1, 2]),
  devices_per_node=st.sampled_from([1, 2, 4]),
  spare_per_device=st.integers(0, 2),
  seed=st.integers(0, 2**16),
)
def test_invariants_on_random_loads(
  experts_per_group, groups, nodes, devices_per_node, spare_per_device, seed
):
  experts = experts_per_group * groups * nodes
  devices = devices_per_node * nodes
  physical = experts + devices * spare_per_device
  if physical % devices:
    physical += devices - physical % devices
  load = np.random.default_rng(seed).zipf(1.5, experts).astype(float)
  placement = eplb.rebalance(
    load, num_physical=physical, num_devices=devices, num_groups=groups, num_nodes=nodes
  )
  check_consistent(placement, experts, physical)
  if groups % nodes == 0:  # hierarchical: each node holds whole groups, and their replicas
    node_of_slot = np.arange(physical) // (physical // nodes)
    node_of_group = {}
    for slot, expert in enumerate(placement.physical_to_logical):
      group = expert // experts_per_group
      assert node_of_group.setdefault(group, node_of_slot[slot]) == node_of_slot[slot]


def test_spare_slots_go_to_the_busiest_experts():
  placement = eplb.rebalance(np.array([1.0, 10.0, 1.0, 1.0]), num_physical=6, num_devices=2)
  chex.assert_trees_all_equal(placement.replica_counts, np.array([1, 3, 1, 1], np.int32))


def test_initial_placement_is_vllms():
  placement = eplb.initial_placement(4, 4)
  chex.assert_trees_all_equal(placement.physical_to_logical, np.array([0, 1, 2, 3] * 2, np.int32))
  check_consistent(placement, 4, 8)


def test_bad_maps_and_sizes_name_the_field():
  with pytest.raises(ValueError, match=r"leaves experts \[2\] without a slot"):
    eplb.from_physical_to_logical(np.array([0, 1, 1, 0]), 3)
  with pytest.raises(ValueError, match="ids outside"):
    eplb.from_physical_to_logical(np.array([0, 1, 3]), 3)
  with pytest.raises(ValueError, match="num_physical=10 must be a multiple of num_devices=4"):
    eplb.rebalance(np.ones(8), num_physical=10, num_devices=4)
  with pytest.raises(ValueError, match="num_physical=4 must be at least num_experts=8"):
    eplb.rebalance(np.ones(8), num_physical=4, num_devices=4)


def test_balancedness_is_mean_over_max_device_load():
  assert eplb.balancedness(np.array([3, 1, 2, 2]), num_devices=2) == 1.0
  assert eplb.balancedness(np.array([6, 0, 1, 1]), num_devices=2) == pytest.approx(8 / 2 / 6)
