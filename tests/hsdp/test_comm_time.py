"""zero_ext.comm_time: the alpha-beta estimate of a step's collectives, and the bytes they put on the links between
nodes by algorithm (ring, gloo, NCCL) with the step time that predicts, against numbers computed by hand."""

import pytest

from zero_ext.comm_time import (
    GBIT,
    GBYTE,
    Cluster,
    Collective,
    Link,
    collective_seconds,
    crossing_bytes,
    estimate_step,
    mesh_groups,
    overlapped_step_seconds,
    predict_step_seconds,
    step_collectives,
    step_link_load,
)

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


# ------------------------------------------------------------------------------------------------ link load (gloo)
def node_of_pairs(rank):  # 2 ranks per node
    return rank // 2


def test_gloo_1d_2x2_by_hand():
    # reduce-scatter: one all-to-all, each rank sends 400/4 = 100 to each other rank; ranks 0, 1 to 2, 3 cross
    rs = crossing_bytes("reduce_scatter", [0, 1, 2, 3], 400.0, node_of_pairs, "gloo")
    assert rs.out == {0: 400, 1: 400} and rs.into == {0: 400, 1: 400} and rs.intra_rank_max == 100
    # all-gather: a ring 0 -> 1 -> 2 -> 3 -> 0, each edge 3/4 of the output; 1 -> 2 and 3 -> 0 cross
    ag = crossing_bytes("all_gather", [0, 1, 2, 3], 400.0, node_of_pairs, "gloo")
    assert ag.out == {0: 300, 1: 300} and ag.into == {0: 300, 1: 300} and ag.intra_rank_max == 300
    # a step, Psi = 100 bf16 gradients and parameters (200 B each): 200 + 3/4 x 200 per direction (the bench's
    # 3.81 + 2.86 MiB); the flat model counts both ranks' 3/4 of both collectives: 600
    load = step_link_load(100, SMALL, 2, algorithm="gloo", grad_bytes=2)
    assert load.per_direction == 350 and [x.per_direction for x in load.crossings] == [200, 150]
    assert step_link_load(100, SMALL, 2, grad_bytes=2).per_direction == 600 == 2 * estimate_step(
        100, SMALL, 2, grad_bytes=2).bytes_on(True)  # fmt: skip
    # NCCL's reduce-scatter is a ring: 3/4 x 200 crosses each way
    assert step_link_load(100, SMALL, 2, algorithm="nccl", grad_bytes=2).per_direction == 300


def test_gloo_mesh_2x2_by_hand():
    # the shard groups {0, 1}, {2, 3} stay in their nodes; the replicas {0, 2}, {1, 3} all-to-all the fp32 chunk
    # (100 elements x 4 B / 2 = 200 B, half of it to the peer) and ring-gather the bf16 slice into the chunk
    # (100 B, an edge carries 1/2 of it): per node 2 x 100 + 2 x 50 = 1.5 x the 200 B bucket (5.72 / 3.81 MiB)
    load = step_link_load(100, SMALL, 2, algorithm="gloo", mesh=(2, 2), grad_bytes=2, replica_grad_bytes=4)
    assert [x.per_direction for x in load.crossings] == [0, 200, 100, 0] and load.per_direction == 300
    assert load.crossings[0].intra_rank_max == 100  # the shard group's all-to-all: 200 / 2 to the other rank
    # int8 blocks: 1 + 4/64 bytes per element
    int8 = step_link_load(100, SMALL, 2, algorithm="gloo", mesh=(2, 2), grad_bytes=2, replica_grad_bytes=1 + 4 / 64)
    assert int8.crossings[1].per_direction == pytest.approx(2 * 25 * (1 + 4 / 64))


def test_flat_reduce_scatter_on_a_mesh_by_hand():
    """ZeroAdamW's mesh on gloo with bf16 gradients summed in fp32 on nodes of 2 ranks: the reduce-scatter is one
    all-to-all over the 4 ranks (the 1-D one: 200 B per direction, as many as the two levels' fp32 chunk), the
    updated slices are gathered in two levels (100 B across)."""
    kw = dict(mesh=(2, 2), grad_bytes=2, replica_grad_bytes=4)
    flat = step_collectives(100, SMALL, 2, flat_reduce_scatter=True, **kw)
    assert [(c.kind, c.group, c.size) for c in flat] == [("reduce_scatter", "world", 4), ("all_gather", "replicate", 2),
                                                         ("all_gather", "shard", 2)]  # fmt: skip
    load = step_link_load(100, SMALL, 2, algorithm="gloo", flat_reduce_scatter=True, **kw)
    assert [x.per_direction for x in load.crossings] == [200, 100, 0] and load.per_direction == 300
    assert load.crossings[0].intra_rank_max == 50  # a quarter of the 200 B bucket to the node's other rank
    two_levels = step_link_load(100, SMALL, 2, algorithm="gloo", **kw)
    assert two_levels.per_direction == load.per_direction  # the same bytes across: the tie the rule takes
    with pytest.raises(ValueError, match="flat_reduce_scatter"):
        step_collectives(100, SMALL, 2, flat_reduce_scatter=True, grad_bytes=2)  # no mesh
    with pytest.raises(ValueError, match="flat_reduce_scatter"):
        step_collectives(100, SMALL, 2, flat_reduce_scatter=True, mesh=(2, 2), replicate_state=True)


def test_gloo_all_reduce_and_fsdp2_by_hand():
    # gloo's all-reduce: a ring (i sends to i - 1) of two passes, each edge 2 (g-1)/g of the buffer
    ar = crossing_bytes("all_reduce", [0, 2], 400.0, node_of_pairs, "gloo")
    assert ar.out == {0: 400, 1: 400} and ar.into == {0: 400, 1: 400}
    three = crossing_bytes("all_reduce", [0, 2, 4], 300.0, node_of_pairs, "gloo")
    assert three.out == {0: 400, 1: 400, 2: 400} and three.intra_rank_max == 0
    # FSDP2's HSDP: the fp32 shard (100 x 4 / 2 B) all-reduced by both replica groups: 2 x 200 per direction
    hsdp = step_link_load(100, SMALL, 2, algorithm="gloo", mesh=(2, 2), replicate_state=True)
    assert hsdp.per_direction == 400


def test_gloo_odd_sizes_3_nodes_x_2():
    odd = Cluster(3, 2, SMALL.intra, SMALL.inter)
    # 1-D over 6: each rank sends 600/6 = 100 to each of the 4 ranks on other nodes; the ring crosses 1 -> 2,
    # 3 -> 4, 5 -> 0, each edge 5/6 of 600
    load = step_link_load(300, odd, 2, algorithm="gloo", grad_bytes=2)
    rs, ag = load.crossings
    assert rs.out == {0: 800, 1: 800, 2: 800} and ag.out == {0: 500, 1: 500, 2: 500} and load.per_direction == 1300
    # mesh (2, 3): the shard groups [0, 1, 2] and [3, 4, 5] span nodes 0-1 and 1-2; node 1 carries both
    rs3 = step_link_load(60, odd, 2, algorithm="gloo", mesh=(2, 3), grad_bytes=2).crossings[0]
    assert rs3.out == {0: 80, 1: 160, 2: 80} and rs3.per_direction == 160  # a piece is 120 / 3 = 40 B
    # a group of one rank moves nothing
    assert crossing_bytes("all_gather", [5], 100.0, node_of_pairs, "gloo").per_direction == 0


def test_collective_seconds_shares_the_nics():
    # NCCL's 1-D reduce-scatter of 400 B on 2 x 2: 300 B leave each node over its 2 NICs of 100 B/s; the busiest
    # rank sends 300 B over the 1000 B/s intra-node link meanwhile; 3 ring steps of 10 ms
    load = step_link_load(100, SMALL, 2, algorithm="nccl", grad_bytes=4)
    rs = load.collectives[0]
    assert collective_seconds(rs, load.crossings[0], SMALL) == pytest.approx(300 / 200 + 3 * 1e-2)


def test_step_time_formulas():
    # 1 MB at 1.25 MB/s x 0.8 = 1 s of link, 0.1 s of it hidden
    assert predict_step_seconds(0.05, 1e6, 1.25e6, 0.8, 0.1) == pytest.approx(0.95)
    assert predict_step_seconds(0.05, 1e3, 1.25e6, 0.8, 0.1) == 0.05  # all of it hidden
    assert overlapped_step_seconds(3.0, 2.5, 0.1) == pytest.approx(3.0 + 0.5 + 0.1)
    assert overlapped_step_seconds(3.0, 1.0, 0.1) == pytest.approx(3.1)
    assert overlapped_step_seconds(3.0, 1.0, 0.1, hide_fraction=0) == pytest.approx(4.1)


def test_kept_buckets():
    one_d3 = step_collectives(100, SMALL, 3, buckets=4, kept_buckets=2)
    assert [c.calls for c in one_d3] == [4, 6]  # forward 4 gathers, backward 2 (2 kept from forward)
    assert [c.calls for c in step_collectives(100, SMALL, 2, buckets=4, kept_buckets=2)] == [4, 4]
    assert step_collectives(100, SMALL, 3, buckets=4, kept_buckets=2, reshard_after_forward=False)[1].calls == 4


@pytest.mark.parametrize(
    "call, match",
    [(lambda: crossing_bytes("all_gather", [0, 1], 1.0, node_of_pairs, "mpi"), "algorithm"),
     (lambda: crossing_bytes("broadcast", [0, 1], 1.0, node_of_pairs), "kind"),
     (lambda: crossing_bytes("all_gather", [0, 1], -1.0, node_of_pairs), "nbytes"),
     (lambda: crossing_bytes("all_gather", [0, 0], 1.0, node_of_pairs), "members"),
     (lambda: crossing_bytes("all_gather", [], 1.0, node_of_pairs), "members"),
     (lambda: step_link_load(100, SMALL, 2, algorithm="tree"), "algorithm"),
     (lambda: predict_step_seconds(0.1, 1.0, 1.0, 0.0, 0.0), "efficiency"),
     (lambda: predict_step_seconds(0.1, 1.0, 1.0, 1.5, 0.0), "efficiency"),
     (lambda: predict_step_seconds(0.1, 1.0, 0.0, 0.5, 0.0), "rate"),
     (lambda: predict_step_seconds(0.1, 1.0, 1.0, 0.5, -1.0), "overlap_s"),
     (lambda: predict_step_seconds(float("nan"), 1.0, 1.0, 0.5, 0.0), "local_s"),
     (lambda: predict_step_seconds(0.1, -1.0, 1.0, 0.5, 0.0), "link_bytes"),
     (lambda: overlapped_step_seconds(1.0, 1.0, 0.0, hide_fraction=2), "hide_fraction"),
     (lambda: overlapped_step_seconds(-1.0, 1.0, 0.0), "compute_s"),
     (lambda: step_collectives(100, SMALL, 3, buckets=4, kept_buckets=5), "kept_buckets")],
)  # fmt: skip
def test_link_load_errors_name_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()
