"""The pairing check of model-parallel steps (`mnjax/guard/_pairing.py`), on hand-written
sequences of up to four ranks: what completes, and what each stuck rank is told."""

import pytest

from mnjax.guard._pairing import ExchangeError, check_exchanges, entry

F32 = "float32"


def send(peer, group, phase="forward", shape=(3,)):
  return (entry("send", "send", group, peer=peer, phase=phase), shape, F32)


def recv(peer, group, phase="forward", shape=(3,)):
  return (entry("recv", "recv", group, peer=peer, phase=phase), shape, F32)


def collective(label, group, shape=(3,)):
  return (entry(label, "collective", group), shape, F32)


def check(*seqs):
  check_exchanges([tuple(s) for s in seqs], None, caller="test", world=tuple(range(len(seqs))))


def test_a_three_stage_ring_with_its_backward_completes():
  g = (0, 1, 2)
  check([send(1, g), recv(2, g), send(2, g, "gradient"), recv(1, g, "gradient")],
        [recv(0, g), send(2, g), recv(2, g, "gradient"), send(0, g, "gradient")],
        [recv(1, g), send(0, g), recv(0, g, "gradient"), send(1, g, "gradient")])


def test_every_rank_sending_first_is_a_deadlock():
  g = (0, 1, 2)
  ring = [[send((r + 1) % 3, g), recv((r - 1) % 3, g)] for r in range(3)]
  with pytest.raises(ExchangeError, match="both send first"):
    check(*ring)


def test_collectives_of_separate_groups_complete_side_by_side():
  a, b = (0, 1), (2, 3)
  check([collective("bucket", a, (4,))], [collective("bucket", a, (4,))],
        [collective("bucket", b, (9,))], [collective("bucket", b, (9,))])


def test_an_activation_never_pairs_with_a_gradient():
  g = (0, 1)
  with pytest.raises(ExchangeError, match="one is an activation, the other a gradient"):
    check([send(1, g)], [recv(0, g, "gradient")])


def test_a_missing_backward_is_named_with_the_fix():
  g = (0, 1)
  with pytest.raises(ExchangeError, match="pseudo_connect"):
    check([send(1, g), recv(1, g, "gradient")], [recv(0, g)])


def test_an_spmd_collective_waits_for_every_rank():
  untagged = ("SyncBatchNorm layer BatchNorm_0", (2, 4), F32)
  with pytest.raises(ExchangeError, match="waits for rank 1 at the end of its step"):
    check([untagged], [])
