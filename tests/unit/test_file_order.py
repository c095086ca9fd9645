"""The suite's files go out longest first (tests/helpers/order.py), each file's tests in their order."""

from __future__ import annotations

from dataclasses import dataclass

from tests.helpers.order import longest_first


@dataclass
class Item:
    nodeid: str


def test_the_longest_files_go_first_and_each_file_keeps_its_order() -> None:
    ids = [
        "tests/db/test_a.py::one",
        "tests/unit/test_b.py::one",
        "tests/concurrency/test_c.py::one",
        "tests/db/test_a.py::two",
        "tests/install/test_add_to_project.py::one",
        "tests/concurrency/test_c.py::two",
        "tests/db/test_lease_counts_every_order.py::x[1]",
        "tests/db/test_lease_counts_every_order.py::x[0]",
    ]
    ordered = [item.nodeid for item in longest_first([Item(i) for i in ids])]
    assert ordered == [
        "tests/install/test_add_to_project.py::one",
        "tests/db/test_lease_counts_every_order.py::x[1]",
        "tests/db/test_lease_counts_every_order.py::x[0]",
        "tests/concurrency/test_c.py::one",
        "tests/concurrency/test_c.py::two",
        "tests/db/test_a.py::one",
        "tests/db/test_a.py::two",
        "tests/unit/test_b.py::one",
    ]
