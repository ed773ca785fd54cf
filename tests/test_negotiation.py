"""Negotiation on rank 0 (MessageTable): when a collective is ready, in what order, and what a
disagreement between ranks reports. Single process, no MPI: the cycles are fed by hand.
"""

from __future__ import annotations

from gradsync.engine.message_table import MessageTable
from gradsync.engine.protocol import Kind, RankMessage, ReduceOp, Request, Response


def allreduce(name, rank, shape=(4,), dtype="float32", op=ReduceOp.Sum, prescale=1.0):
    return Request(name, Kind.ALLREDUCE, rank, dtype, shape, op, -1, prescale, 1.0)


def cycle(table, *per_rank, shutdown=()):
    """One cycle in which rank r sends the requests per_rank[r]."""
    return table.cycle([RankMessage(rank in shutdown, list(requests))
                        for rank, requests in enumerate(per_rank)])


def test_a_collective_is_ready_once_every_rank_has_sent_it():
    table = MessageTable(size=3, fusion_threshold=1 << 20)
    assert cycle(table, [allreduce("g", 0)], [], [allreduce("g", 2)]).responses == ()
    assert table.pending() == {"g": [0, 2]}
    reply = cycle(table, [], [allreduce("g", 1)], [])
    assert reply.responses == (Response(Kind.ALLREDUCE, ("g",)),)
    assert table.pending() == {}


def test_ranks_may_send_in_different_orders():
    table = MessageTable(size=2, fusion_threshold=1 << 20)
    a0, b0 = allreduce("a", 0), allreduce("b", 0, dtype="int32")
    a1, b1 = allreduce("a", 1), allreduce("b", 1, dtype="int32")
    reply = cycle(table, [a0, b0], [b1, a1])
    assert sorted(reply.responses) == sorted([Response(Kind.ALLREDUCE, ("a",)),
                                              Response(Kind.ALLREDUCE, ("b",))])


def test_ready_allreduces_of_one_kind_are_fused_in_the_order_they_became_ready():
    table = MessageTable(size=2, fusion_threshold=1 << 20)
    names = ["w1", "w2", "w3"]
    # Rank 1 completes them, in its (reversed) order.
    reply = cycle(table, [allreduce(n, 0) for n in names], [allreduce(n, 1) for n in names[::-1]])
    assert reply.responses == (Response(Kind.ALLREDUCE, ("w3", "w2", "w1")),)


def test_allgather_reports_every_ranks_first_dimension():
    table = MessageTable(size=3, fusion_threshold=1 << 20)
    requests = [Request("g", Kind.ALLGATHER, r, "float32", (rows, 2)) for r, rows in
                enumerate((2, 0, 5))]
    reply = cycle(table, *[[r] for r in requests])
    assert reply.responses == (Response(Kind.ALLGATHER, ("g",), first_dims=((2, 0, 5),)),)


def test_a_shape_disagreement_fails_the_collective_listing_every_rank():
    table = MessageTable(size=3, fusion_threshold=1 << 20)
    reply = cycle(table, *[[allreduce("t", r, shape=(r + 1, 2))] for r in range(3)])
    (response,) = reply.responses
    assert response.names == ("t",)
    assert response.error == ("allreduce 't': ranks disagree on shape: "
                              "rank 0: (1, 2), rank 1: (2, 2), rank 2: (3, 2)")


def test_dtype_op_root_and_factor_disagreements_name_the_field():
    table = MessageTable(size=2, fusion_threshold=1 << 20)
    cases = [
        ([allreduce("d", 0, dtype="float32")], [allreduce("d", 1, dtype="float16")],
         "ranks disagree on dtype: rank 0: 'float32', rank 1: 'float16'"),
        ([allreduce("o", 0, op=ReduceOp.Sum)], [allreduce("o", 1, op=ReduceOp.Average)],
         "ranks disagree on op: rank 0: Sum, rank 1: Average"),
        ([allreduce("p", 0, prescale=1.0)], [allreduce("p", 1, prescale=2.0)],
         "ranks disagree on prescale_factor: rank 0: 1.0, rank 1: 2.0"),
        ([Request("b", Kind.BROADCAST, 0, "float32", (3,), root=0)],
         [Request("b", Kind.BROADCAST, 1, "float32", (3,), root=1)],
         "ranks disagree on root rank: rank 0: 0, rank 1: 1"),
        ([Request("k", Kind.BROADCAST, 0, "float32", (3,), root=0)],
         [allreduce("k", 1, shape=(3,))],
         "ranks disagree on collective: rank 0: BROADCAST, rank 1: ALLREDUCE"),
    ]
    for rank0, rank1, message in cases:
        (response,) = cycle(table, rank0, rank1).responses
        assert message in response.error


def test_allgather_must_agree_on_all_but_the_first_dimension():
    table = MessageTable(size=2, fusion_threshold=1 << 20)
    reply = cycle(table, [Request("g", Kind.ALLGATHER, 0, "int8", (2, 3))],
                  [Request("g", Kind.ALLGATHER, 1, "int8", (2, 4))])
    (response,) = reply.responses
    assert "ranks disagree on shape (all but the first dimension must match): " \
           "rank 0: (2, 3), rank 1: (2, 4)" in response.error


def test_a_failed_collective_does_not_fuse_with_the_others():
    table = MessageTable(size=2, fusion_threshold=1 << 20)
    reply = cycle(table, [allreduce("a", 0), allreduce("bad", 0, shape=(1,)), allreduce("c", 0)],
                  [allreduce("a", 1), allreduce("bad", 1, shape=(2,)), allreduce("c", 1)])
    assert [(r.names, r.error is not None) for r in reply.responses] == \
        [(("bad",), True), (("a", "c"), False)]


def test_a_name_can_be_used_again_once_answered():
    table = MessageTable(size=2, fusion_threshold=1 << 20)
    for _ in range(3):
        reply = cycle(table, [allreduce("step", 0)], [allreduce("step", 1)])
        assert reply.responses == (Response(Kind.ALLREDUCE, ("step",)),)


def test_shutdown_requests_are_reported_by_rank():
    table = MessageTable(size=3, fusion_threshold=1 << 20)
    assert cycle(table, [], [], [], shutdown=(0, 2)).shutdown_ranks == (0, 2)
    assert cycle(table, [], [], []).shutdown_ranks == ()


def member(group, index, rank, size=3, shape=(4,)):
    return allreduce(f"{group}.{index}", rank, shape=shape)._replace(group=group, group_size=size)


def test_a_group_is_answered_only_when_every_member_is_ready_everywhere_and_as_one_response():
    table = MessageTable(size=2, fusion_threshold=0)  # threshold 0 would put plain ones apart
    reply = cycle(table, [member("g", i, 0) for i in range(3)], [member("g", i, 1) for i in (2, 0)])
    assert reply.responses == ()  # g.0 and g.2 are ready everywhere, g.1 is not
    reply = cycle(table, [allreduce("plain", 0)], [member("g", 1, 1), allreduce("plain", 1)])
    assert reply.responses == (Response(Kind.ALLREDUCE, ("g.2", "g.0", "g.1")),
                               Response(Kind.ALLREDUCE, ("plain",)))
    assert table.pending() == {}


def test_a_disagreement_on_one_member_fails_the_whole_group():
    table = MessageTable(size=2, fusion_threshold=1 << 20)
    reply = cycle(table, [member("g", i, 0) for i in range(3)],
                  [member("g", i, 1, shape=(4,) if i != 1 else (5,)) for i in range(3)])
    (response,) = reply.responses
    assert response.names == ("g.0", "g.1", "g.2")
    assert response.error == ("grouped allreduce 'g' fails as a whole: allreduce 'g.1': ranks "
                              "disagree on shape: rank 0: (4,), rank 1: (5,)")


def test_a_group_whose_ranks_disagree_on_its_size_fails_at_once_with_every_member():
    table = MessageTable(size=2, fusion_threshold=1 << 20)
    reply = cycle(table, [member("g", i, 0, size=2) for i in range(2)],
                  [member("g", i, 1, size=3) for i in range(3)])
    (response,) = reply.responses
    assert sorted(response.names) == ["g.0", "g.1", "g.2"]  # g.2 came from rank 1 only
    assert "ranks disagree on group size: rank 0: 2, rank 1: 3" in response.error
    assert table.pending() == {}


def test_alltoall_answers_with_the_split_matrix_and_checks_trailing_dimensions():
    table = MessageTable(size=2, fusion_threshold=1 << 20)
    reply = cycle(table, [Request("a", Kind.ALLTOALL, 0, "int8", (3, 2), splits=(1, 2))],
                  [Request("a", Kind.ALLTOALL, 1, "int8", (4, 2), splits=(4, 0))])
    assert reply.responses == (Response(Kind.ALLTOALL, ("a",), split_matrix=((1, 2), (4, 0))),)
    reply = cycle(table, [Request("b", Kind.ALLTOALL, 0, "int8", (2, 2), splits=(1, 1))],
                  [Request("b", Kind.ALLTOALL, 1, "int8", (2, 3), splits=(1, 1))])
    assert "all but the first dimension must match" in reply.responses[0].error


def test_in_a_process_set_messages_name_world_ranks_also_as_root_ranks():
    table = MessageTable(size=2, fusion_threshold=1 << 20, world_ranks=(1, 3))
    (response,) = cycle(table, [allreduce("t", 0, shape=(2,))], [allreduce("t", 1, shape=(3,))]).responses
    assert response.error == "allreduce 't': ranks disagree on shape: rank 1: (2,), rank 3: (3,)"
    roots = [Request("b", Kind.BROADCAST, r, "float32", (2,), root=r) for r in range(2)]
    (response,) = cycle(table, [roots[0]], [roots[1]]).responses
    assert response.error == "broadcast 'b': ranks disagree on root rank: rank 1: 1, rank 3: 3"


def test_a_disagreement_on_an_unnamed_collective_says_to_name_it():
    table = MessageTable(size=2, fusion_threshold=1 << 20)
    name = "allreduce.noname.3"
    (response,) = cycle(table, [allreduce(name, 0, shape=(2,))], [allreduce(name, 1, shape=(3,))]).responses
    assert response.error.startswith(f"allreduce {name!r}: ranks disagree on shape: rank 0: (2,), rank 1: (3,); "
                                     "unnamed collectives are matched by the order of the calls"), response.error
    assert response.error.endswith("pass name= to each")
