"""Instance keys are typed in memory and written in their compact tagged form: matched runs,
comm tables, report JSON and the trace's ``commviz.instance`` arg read as before, and the
cross-rank flow ids stay the ones earlier versions derived from that form."""

from __future__ import annotations

import hashlib
import json

import pytest

from commviz import metadata as md
from commviz.match.model import InstanceKey, KeyKind, Pair, instance_key
from commviz.merge.piece import CROSS_FLOW_BIT, cross_flow_id, instance_text

# (record args, the compact form written since the first matched-run version, the bare tuple
# earlier versions held in memory and hashed into the flow id)
CASES = [
    ({md.PG_NAME: "0", md.KIND: "collective", md.SEQ: 3}, ["c", "0", 3], ("c", "0", 3)),
    ({md.PG_NAME: "1", md.KIND: "collective", md.USER_SEQ: 2}, ["u", "1", 2], ("u", "1", 2)),
    ({md.PG_NAME: "0", md.KIND: "p2p", md.SRC: 0, md.DST: 1, md.P2P_SEQ: 5},
     ["p", "0", 0, 1, 5], ("p", "0", 0, 1, 5)),
    ({md.PG_NAME: "0", md.KIND: "batch", md.RANK: 1, md.PEERS: "send:0,recv:2",
      md.P2P_SEQ: "4,9"}, ["b", "0", [[1, 0, "4"], [2, 1, "9"]]],
     ("b", "0", ((1, 0, "4"), (2, 1, "9")))),
]


@pytest.mark.parametrize("args, written, old", CASES)
def test_written_form_and_flow_id_are_unchanged(args, written, old):
    key = instance_key(args)
    assert json.loads(instance_text(key)) == written
    assert InstanceKey.from_wire(written) == key
    digest = hashlib.blake2b(repr(old).encode(), digest_size=8).digest()
    assert cross_flow_id(key) == CROSS_FLOW_BIT | int.from_bytes(digest, "little") >> 1


def test_fields_by_name():
    p2p = instance_key(CASES[2][0])
    assert (p2p.kind, p2p.pg, p2p.src, p2p.dst, p2p.seq) == (KeyKind.P2P, "0", 0, 1, 5)
    batch = instance_key(CASES[3][0])
    assert batch.pairs == (Pair(1, 0, "4"), Pair(2, 1, "9")) and batch.kind.p2p
    assert not instance_key(CASES[0][0]).kind.p2p


def test_a_replay_copy_round_trips():
    key = InstanceKey(KeyKind.COLLECTIVE, "0", 3, replay=("in trace", 2))
    assert json.loads(instance_text(key)) == ["c", "0", 3, "replay", ["in trace", 2]]
    assert InstanceKey.from_wire(json.loads(instance_text(key))) == key


@pytest.mark.parametrize("bad", [["x", "0", 1], ["c", "0"], ["p", "0", 1], "c", None])
def test_malformed_keys_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        InstanceKey.from_wire(bad)
