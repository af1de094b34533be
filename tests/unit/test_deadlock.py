"""The wait-for analysis every rank runs on its (identical) negotiation table."""

from hvdrun.runtime.negotiation import Request, Table


def table(size: int, submitted: dict[str, list[int]], sets: dict[int, tuple[int, ...]] | None = None) -> Table:
    t = Table(size)
    t.sets.update(sets or {})
    for name, ranks in submitted.items():
        set_id = 1 if name.startswith("set:") else 0
        for rank in ranks:
            t.add(rank, Request(name, "allreduce", process_set=set_id))
    return t


def test_each_rank_waiting_for_what_the_other_skipped_is_a_deadlock():
    t = table(2, {"barrier": [0], "x": [1]})
    stuck = t.deadlocked({0: ["barrier"], 1: ["x"]})
    assert {rank: [e.name for e in entries] for rank, entries in stuck.items()} == {0: ["barrier"], 1: ["x"]}


def test_a_rank_that_is_computing_frees_those_that_wait_for_it():
    t = table(3, {"a": [0, 2]})
    assert t.deadlocked({0: ["a"], 2: ["a"]}) == {}  # rank 1 is not waiting: it may still submit 'a'


def test_a_chain_ending_at_a_free_rank_is_not_stuck_but_a_cycle_inside_is():
    t = table(4, {"a": [0], "b": [1], "c": [2, 3]})
    # 0 waits a (needs 1,2,3), 1 waits b (needs 0,2,3), 2 and 3 wait c (needs 0,1): all blocked -> all stuck
    assert sorted(t.deadlocked({0: ["a"], 1: ["b"], 2: ["c"], 3: ["c"]})) == [0, 1, 2, 3]
    assert t.deadlocked({0: ["a"], 1: ["b"], 2: ["c"]}) == {}  # rank 3 computes: it frees 0, 1 and so 2


def test_process_sets_count_only_their_members():
    t = table(4, {"set:x": [0], "set:y": [1]}, sets={1: (0, 1)})
    assert sorted(t.deadlocked({0: ["set:x"], 1: ["set:y"]})) == [0, 1]  # ranks 2 and 3 do not matter


def test_a_name_already_executed_means_the_rank_is_about_to_go_on():
    t = table(2, {"x": [1]})
    assert t.deadlocked({0: ["gone"], 1: ["x"]}) == {}


def test_a_scaling_mismatch_names_both_factors_of_each_rank_in_a_sentence():
    from hvdrun.runtime.negotiation import Entry, validate

    entry = Entry("g", {0: Request("g", "allreduce", "float32", (4,), prescale=2.0),
                        1: Request("g", "allreduce", "float32", (4,))}, members=(0, 1))
    assert validate(entry, 2) == ("allreduce 'g': scaling (prescale, postscale) differs across ranks "
                                  "(rank 0: (2.0, 1.0); rank 1: (1.0, 1.0))")
