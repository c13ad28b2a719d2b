"""zero_ext.comm_time: the alpha-beta estimate of a step's collectives against numbers computed by hand."""

import pytest

from zero_ext.comm_time import GBIT, GBYTE, Cluster, Collective, Link, estimate_step, mesh_groups, step_collectives

# 2 nodes x 2 ranks; round numbers: intra 1000 B/s, 1 ms; inter 100 B/s, 10 ms
SMALL = Cluster(2, 2, Link(1000.0, 1e-3), Link(100.0, 1e-2))


def test_one_collective_by_hand():
    rs = Collective("reduce_scatter", "world", 4, 400.0, 1, True)
    assert rs.wire_bytes == 300 and rs.latency_steps == 3
    assert rs.time(Link(100.0, 1e-2)) == pytest.approx(300 / 100 + 3 * 1e-2)
    ar = Collective("all_reduce", "replicate", 2, 400.0, 3, True)
    assert ar.wire_bytes == 3 * 2 * 200 and ar.latency_steps == 3 * 2 * 1
    assert ar.time(Link(100.0, 0.0)) == pytest.approx(12.0)


def test_1d_stage2_by_hand():
    # Psi = 100, fp32 gradients (400 B), bf16 params (200 B), 2 buckets, every collective over the 4 ranks: inter
    e = estimate_step(100, SMALL, 2, buckets=2)
    rs, ag = e.collectives
    assert (rs.kind, rs.size, rs.nbytes, rs.calls, rs.inter_node) == ("reduce_scatter", 4, 200, 2, True)
    assert (ag.kind, ag.nbytes, ag.calls) == ("all_gather", 100, 2)
    # 3/4 x 400 B at 100 B/s + 2 buckets x 3 steps x 10 ms; 3/4 x 200 B + 6 x 10 ms
    assert e.times == pytest.approx([3.0 + 0.06, 1.5 + 0.06])
    assert e.total_s == pytest.approx(4.62)
    assert e.bytes_on(True) == 450 and e.bytes_on(False) == 0 and e.latency_steps_on(True) == 12


def test_mesh_stage2_sharded_state_by_hand():
    e = estimate_step(100, SMALL, 2, mesh=(2, 2))
    kinds = [(c.kind, c.group, c.inter_node, c.nbytes) for c in e.collectives]
    assert kinds == [("reduce_scatter", "shard", False, 400), ("reduce_scatter", "replicate", True, 200),
                     ("all_gather", "replicate", True, 100), ("all_gather", "shard", False, 200)]  # fmt: skip
    # intra: 1/2 x 400 / 1000 + 1 ms; inter: 1/2 x 200 / 100 + 10 ms; 1/2 x 100 / 100 + 10 ms; 1/2 x 200 / 1000 + 1 ms
    assert e.times == pytest.approx([0.201, 1.01, 0.51, 0.101])
    assert e.bytes_on(True) == 150 and e.bytes_on(False) == 300
    assert (
        e.bytes_on(True) <= e.bytes_on(False)
        and e.bytes_on(True) / estimate_step(100, SMALL, 2).bytes_on(True) == 1 / 3
    )


def test_replica_grad_bytes():
    # gloo: bf16 gradients into the shard group's reduce-scatter, their fp32 sums between the replicas
    e = step_collectives(100, SMALL, 2, mesh=(2, 2), grad_bytes=2, replica_grad_bytes=4)
    assert [c.nbytes for c in e] == [200, 200, 100, 200]


def test_mesh_replicated_state_and_stage3():
    rep = estimate_step(100, SMALL, 2, mesh=(2, 2), replicate_state=True)
    ar = rep.collectives[1]
    assert (ar.kind, ar.nbytes, ar.wire_bytes) == ("all_reduce", 200, 200)
    assert rep.times[1] == pytest.approx(2.0 + 0.02)
    s3 = estimate_step(100, SMALL, 3, mesh=(2, 2))
    assert s3.collectives[-1].calls == 2 and not s3.collectives[-1].inter_node  # forward + backward, in the node
    assert estimate_step(100, SMALL, 3, mesh=(2, 2), reshard_after_forward=False).collectives[-1].calls == 1
    one_d3 = estimate_step(100, SMALL, 3)
    assert [c.calls for c in one_d3.collectives] == [1, 2]
    # issue 35: inter-node bytes at most half the 1-D layout's at stages 1/2, a quarter at stage 3
    for stage, bound in ((1, 0.5), (2, 0.5), (3, 0.25)):
        big = Cluster(8, 8, SMALL.intra, SMALL.inter)
        for rep_state in (False, True):
            m = estimate_step(10**6, big, stage, mesh=(8, 8), replicate_state=rep_state, grad_bytes=2)
            assert m.bytes_on(True) <= bound * estimate_step(10**6, big, stage, grad_bytes=2).bytes_on(True)


def test_nics_shared_and_one_node():
    shared = Cluster(2, 2, SMALL.intra, SMALL.inter, nics_per_node=1)
    assert shared.link(True).bandwidth == 50 and shared.link(False) is SMALL.intra
    one_node = Cluster(1, 4, SMALL.intra, SMALL.inter)
    assert not any(c.inter_node for c in step_collectives(100, one_node, 2))
    assert estimate_step(100, one_node, 2).total_s == pytest.approx(0.3 + 0.003 + 0.15 + 0.003)


def test_groups_and_errors():
    assert mesh_groups(6, (3, 2)) == ([[0, 1], [2, 3], [4, 5]], [[0, 2, 4], [1, 3, 5]])
    # a shard group spanning nodes is inter-node: 2 x 3 on nodes of 2 ranks
    odd = Cluster(3, 2, SMALL.intra, SMALL.inter)
    assert step_collectives(60, odd, 2, mesh=(2, 3))[0].inter_node
    for kw, match in [(dict(mesh=(2, 3)), "mesh"), (dict(replicate_state=True), "replicate_state"),
                      (dict(buckets=0), "buckets")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            step_collectives(100, SMALL, 2, **kw)
    with pytest.raises(ValueError, match="stage"):
        step_collectives(100, SMALL, 0)
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0)
    assert GBIT * 8 == GBYTE
