"""gradsync.naming: the names adapters derive from variables and pytree leaves are unique and
depend on the list alone (needs no framework and no init)."""

from gradsync import naming


def test_indexed_names_are_unique_when_the_labels_repeat():
    names = naming.indexed("broadcast_variables", ["kernel", "bias", "kernel", "bias"])
    assert names == ["broadcast_variables.0.kernel", "broadcast_variables.1.bias",
                     "broadcast_variables.2.kernel", "broadcast_variables.3.bias"]


def test_indexed_names_without_a_label_are_the_position():
    assert naming.indexed("p", [None, ""]) == ["p.0", "p.1"]


def test_deduplicated_keeps_unique_names_as_they_are():
    paths = ["['w1']", "['b1']", "[0]"]
    assert naming.deduplicated(paths) == paths


def test_deduplicated_suffixes_each_repeat_with_its_position():
    assert naming.deduplicated([".w", "['a']", ".w"]) == [".w#0", "['a']", ".w#2"]


def test_deduplicated_stays_unique_when_a_suffix_meets_a_given_name():
    names = ["a", "a", "a#1", "a#1"]
    result = naming.deduplicated(names)
    assert len(set(result)) == len(names)
    assert result == naming.deduplicated(list(names))  # a function of the list alone
