"""Request graphs: fn.trace() shape, topological order, data edges; compiler passes."""
import networkx as nx
import pytest

import sglite
from sglite.errors import InvalidRequestError
from sglite.frontend.compiler import check_roles, constant_prefix, shared_prefix
from sglite.frontend.testing import CHATML, FakeBackend


@sglite.function
def tip_program(s, topic):
    s += sglite.system("You give tips.")
    s += sglite.user("Give two tips about " + topic + ".")
    s += sglite.assistant(sglite.gen("skeleton", max_tokens=32))
    forks = s.fork(2)
    forks += lambda i: f"Expand tip {i}: " + sglite.gen("tip", max_tokens=16)
    forks.join()
    s += "Summary of " + s["tip"] + ":" + sglite.select("verdict", choices=["good", "bad"])


def _ops(g, stream):
    return [g.nodes[n]["op"] for n in sorted(g.nodes) if g.nodes[n]["stream"] == stream]


def test_trace_graph_shape_and_order():
    g = tip_program.trace()
    assert isinstance(g, nx.DiGraph) and nx.is_directed_acyclic_graph(g)
    kinds = {a["op"] for _, a in g.nodes(data=True)}
    assert kinds == {"text", "gen", "select", "role", "fork", "join"}
    assert _ops(g, 0) == ["role", "text", "role", "role", "text", "text", "text", "role", "role", "gen", "role",
                          "fork", "join", "text", "text", "text", "select"]
    assert _ops(g, 1) == _ops(g, 2) == ["text", "gen"]
    order = list(nx.topological_sort(g))
    pos = {n: i for i, n in enumerate(order)}
    fork = next(n for n, a in g.nodes(data=True) if a["op"] == "fork")
    join = next(n for n, a in g.nodes(data=True) if a["op"] == "join")
    branch_gens = [n for n, a in g.nodes(data=True) if a["op"] == "gen" and a["stream"] > 0]
    assert g.nodes[fork]["branches"] == [1, 2]
    assert all(pos[fork] < pos[b] < pos[join] for b in branch_gens)
    assert all(g.has_edge(b, join) for b in branch_gens)
    # the topic argument is a placeholder text node
    assert any(a.get("arg") == "topic" and a["text"] is None for _, a in g.nodes(data=True))


def test_trace_data_dependency_edges():
    g = tip_program.trace()
    join = next(n for n, a in g.nodes(data=True) if a["op"] == "join")
    reader = next(n for n, a in g.nodes(data=True) if a.get("var") == "tip")
    assert g.edges[join, reader]["data"] is True and g.edges[join, reader]["stream"] is False

    @sglite.function
    def chain(s):
        s += "Name: " + sglite.gen("name", max_tokens=4) + "\n"
        s += "Other: " + sglite.gen("other", max_tokens=4) + "\n"
        s += "Greeting for " + s["name"] + ": " + sglite.gen("greet", max_tokens=8)
        s += sglite.select("pick", choices=[s["name"], s["other"]])

    g = chain.trace()
    gens = {a["name"]: n for n, a in g.nodes(data=True) if a["op"] in ("gen", "select")}
    name_reader = next(n for n, a in g.nodes(data=True) if a.get("var") == "name")
    assert g.edges[gens["name"], name_reader]["data"]
    assert nx.has_path(g, gens["name"], gens["greet"])
    assert g.edges[gens["name"], gens["pick"]]["data"] and g.edges[gens["other"], gens["pick"]]["data"]
    data_edges = [(u, v) for u, v, d in g.edges(data=True) if d["data"]]
    assert len(data_edges) == 3
    assert not g.has_edge(gens["other"], name_reader)


def test_trace_rejects_formatting_placeholders():
    @sglite.function
    def prog(s, q):
        s += f"Q: {q}"

    with pytest.raises(TypeError, match="placeholder"):
        prog.trace()
    assert prog.trace(q="given")  # a value given: fine


def test_check_roles_on_traced_graphs():
    @sglite.function
    def nested(s):
        with s.user():
            s += sglite.assistant("x")

    @sglite.function
    def unmatched(s):
        s += sglite.user_begin() + "x" + sglite.assistant_end()

    @sglite.function
    def fork_in_role(s):
        with s.user():
            f = s.fork(2)
            f += sglite.assistant_begin()

    check_roles(tip_program.trace())
    for prog, msg in ((nested, "Nested"), (unmatched, "matching"), (fork_in_role, "Nested")):
        with pytest.raises(InvalidRequestError, match=msg):
            check_roles(prog.trace())


def test_constant_prefix_and_shared_prefix():
    g = tip_program.trace(topic="tea")
    prefix = constant_prefix(g, CHATML)
    assert prefix == ("<|im_start|>system\nYou give tips.<|im_end|>\n<|im_start|>user\nGive two tips about tea."
                      "<|im_end|>\n<|im_start|>assistant\n")
    g = tip_program.trace(backend=FakeBackend())
    assert g.graph["constant_prefix"].endswith("Give two tips about ")
    assert shared_prefix(["abc def", "abc dog"]) == "abc"
    assert shared_prefix(["same", "same"]) == "same"
    assert shared_prefix(["xyz", "abc"]) == ""


def test_trace_sends_nothing():
    fb = FakeBackend()
    tip_program.trace(backend=fb)
    assert fb.requests == []
