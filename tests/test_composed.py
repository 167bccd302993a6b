"""Our kernels inside torch.compile ("nightshift + <mode>", and `agent apply`'s compile_model):
a call runs as an opaque op only where the winner runs a kernel of ours. A shape a per-shape
dispatcher leaves to the region's own code, or to torch.compile of the region, runs the class's
own forward, which the outer compiler compiles with the rest, not a second compile nested in an op
(suspected, not confirmed, behind the H200's composed ways losing to torch.compile alone and a
crash inside reduce-overhead's capture)."""

import importlib.util
import sys

import torch
from torch import nn

from agent.prompting import render_code
from agent.review.ways import composed_candidate
from tools.problem import Problem

KERNEL = '''
CALLS = []


def forward(module, x):
    CALLS.append(tuple(x.shape))
    return x * module.w + 0.0
'''


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 2.0, 8))

    def forward(self, x):
        return x * self.w


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Scale(), Scale()

    def forward(self, x):
        return torch.relu(self.b(torch.sin(self.a(x)))) + 1


def _load(path, source):
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as the worker loads a candidate
    spec.loader.exec_module(module)
    return module


def _key(*shape):
    return f"{shape}:float32"


def test_a_dispatcher_runs_as_an_op_only_on_the_shapes_it_has_a_kernel_for(tmp_path):
    compiled_region = render_code("kernels/torch_compile.py.j2", mode=None, options={})
    dispatcher = render_code("kernels/dispatch_by_shape.py.j2", kernels=[KERNEL, compiled_region],
                             table=[{"key": _key(4, 8), "kernel": 0}, {"key": _key(2, 8), "kernel": 1}],
                             default=None)
    d = _load(tmp_path / "dispatcher.py", dispatcher)
    assert d.runs_kernel((torch.ones(4, 8),), {})
    assert not d.runs_kernel((torch.ones(2, 8),), {})  # torch.compile of the region
    assert not d.runs_kernel((torch.ones(3, 8),), {})  # the region's own code (the default)

    source = composed_candidate([(Problem.model_construct(name="Scale", region_class="Scale"), dispatcher)],
                                None).source
    way = _load(tmp_path / "way.py", source)
    kernel = next(m for m in way._WINNERS["Scale"]._MODULES if hasattr(m, "CALLS"))
    ran, tuned = [], way._ROUTES["Scale"]  # what the opaque op runs: the dispatcher, on every shape before
    way._ROUTES["Scale"] = lambda m, x: ran.append(tuple(x.shape)) or tuned(m, x)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    net = Net().eval()
    shapes = [(4, 8), (3, 8), (2, 8), (4, 8), (3, 8), (2, 8)]
    with torch.no_grad():
        for i, shape in enumerate(shapes):
            x = torch.randn(*shape)
            want = torch.relu(torch.sin(x * net.a.w) * net.b.w) + 1
            got = way.forward(net, x)
            torch.testing.assert_close(got, want)
            if i == 0:  # the eager call that records each instance's op: our kernel on its shape
                assert kernel.CALLS == [(4, 8), (4, 8)]
                kernel.CALLS.clear()
                ran.clear()
    # Compiled: our kernel ran, as the op, on its shape only (two instances, one call); the
    # others were the class's own code, inside the compiled graph, no break around them.
    assert kernel.CALLS == [(4, 8)] * 2 and ran == kernel.CALLS, (kernel.CALLS, ran)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert way._compile_kwargs(per_shape=True) == {"dynamic": False}
    assert way._compile_kwargs() == {}  # no op here writes its inputs


def test_a_first_call_with_no_kernel_of_ours_still_records_the_op(tmp_path):
    """The eager call that shows each op its schema may be a shape the winner leaves to the
    original: the op is recorded from the original's call (verified alike), and later kernel
    shapes still run as the op, not behind a graph break."""
    dispatcher = render_code("kernels/dispatch_by_shape.py.j2", kernels=[KERNEL],
                             table=[{"key": _key(4, 8), "kernel": 0}], default=None)
    source = composed_candidate([(Problem.model_construct(name="Scale", region_class="Scale"), dispatcher)],
                                None).source
    way = _load(tmp_path / "way.py", source)
    kernel = way._WINNERS["Scale"]._MODULES[0]
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    net = Net().eval()
    with torch.no_grad():
        for shape in [(3, 8), (4, 8), (3, 8), (4, 8)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(way.forward(net, x), torch.relu(torch.sin(x * net.a.w) * net.b.w) + 1)
    assert kernel.CALLS == [(4, 8)] * 4, kernel.CALLS
    assert all(m.__dict__.get("_nightshift_ops") for m in (net.a, net.b))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_the_compiled_ways_run_each_regions_route_beside_the_compiler():
    """The eager model runs every region's winner; the compiled ways run, per region, what beat
    torch.compile of the region (agent/dispatch.compiled_route): another source, or none of ours
    (the region's own code, compiled with the rest). A region with nothing to judge by keeps its
    winner there; one whose winner is torch.compile of the region is never nested."""
    import hashlib
    from types import SimpleNamespace

    from agent.review.ways import ways_of

    def region(name):
        return SimpleNamespace(name=name, region_class=name)

    def h(source):
        return hashlib.sha256(source.encode()).hexdigest()[:16]

    triton, compiled = SimpleNamespace(template="rmsnorm"), SimpleNamespace(template="torch_compile")
    accepted = [(region("A"), triton, "a = 1\n"), (region("B"), triton, "b = 1\n"),
                (region("C"), triton, "c = 1\n"), (region("D"), compiled, "d = 1\n")]
    ways = dict(ways_of(accepted, graphed=False, baselines=[], composed=["torch.compile"],
                        compiled_routes={"A": None, "B": "b = 2\n"}))
    assert ways["tuned"].params["routes"] == {n: h(f"{n.lower()} = 1\n") for n in "ABCD"}
    assert ways["nightshift + torch.compile"].params["routes"] == {"B": h("b = 2\n"), "C": h("c = 1\n")}
    # Where the compiler's code serves every region, no composed way is run: it would be torch.compile's.
    none_left = dict(ways_of(accepted[:2], graphed=False, baselines=[], composed=["torch.compile"],
                             compiled_routes={"A": None, "B": None}))
    assert list(none_left) == ["tuned"]


GUARDED = '''
CALLS = []


def forward(module, x, mask=None):
    CALLS.append(mask is None)
    if mask is not None:  # as a template's guard: verified with mask None only
        raise NotImplementedError("mask was None when this candidate was verified")
    return x * module.w + 0.0
'''


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 2.0, 8))

    def forward(self, x, mask=None):
        return x * self.w if mask is None else torch.where(mask, x * self.w, x)


class MaskedNet(nn.Module):
    """Passes an explicit all-true mask only when compiled, as transformers' Llama does with SDPA."""

    def __init__(self):
        super().__init__()
        self.a = Masked()

    def forward(self, x):
        mask = torch.ones_like(x, dtype=torch.bool) if torch.compiler.is_compiling() else None
        return torch.relu(self.a(torch.sin(x), mask=mask)) + 1


def _masked_way(tmp_path, winner: str):
    """"nightshift + torch.compile" with `winner` routed into Masked, and dynamo's counters cleared."""
    from torch._dynamo.utils import counters
    source = composed_candidate([(Problem.model_construct(name="Masked", region_class="Masked"), winner)],
                                None).source
    way = _load(tmp_path / "way.py", source)
    torch._dynamo.reset()
    counters.clear()
    return way, counters


def test_a_call_unlike_the_verified_one_is_compiled_as_the_original_not_run_eager_in_an_op(tmp_path):
    """The winner was verified with mask None; compiled, the model passes a tensor there. That call
    runs the class's own forward inside the compiled graph: never the op, whose refusal would run
    the original eagerly and unfused (LlamaModel on the H100: 11-14% slower than compiled alone)."""
    way, counters = _masked_way(tmp_path, GUARDED)
    kernel = way._WINNERS["Masked"]
    net = MaskedNet().eval()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            torch.testing.assert_close(way.forward(net, x), torch.relu(torch.sin(x) * net.a.w) + 1)
    assert kernel.CALLS == [True], kernel.CALLS  # the eager, recording call only
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


BOTH = '''
CALLS = []


def forward(module, x, mask=None):
    CALLS.append(mask is None)
    return x * module.w + 0.0 if mask is None else torch.where(mask, x * module.w, x)
'''


class MaskedByShape(nn.Module):
    """Passes a mask on the wider inputs only, eager and compiled alike: two call structures."""

    def __init__(self):
        super().__init__()
        self.a = Masked()

    def forward(self, x):
        mask = (x > 0) if x.shape[0] > 2 else None
        return torch.relu(self.a(torch.sin(x), mask=mask)) + 1


def test_each_call_structure_the_model_shows_eagerly_gets_its_own_op(tmp_path):
    """The first call of each input shape runs eager and records an op for a call unlike those
    recorded before, so a workload that passes a tensor where the first passed None still runs our
    kernel compiled, as an op, with no graph break."""
    way, counters = _masked_way(tmp_path, "import torch\n" + BOTH)
    kernel = way._WINNERS["Masked"]
    net = MaskedByShape().eval()
    with torch.no_grad():
        for shape in [(2, 8), (4, 8)] * 3:
            x = torch.randn(*shape)
            s = torch.sin(x)
            want = torch.relu(s * net.a.w if shape[0] <= 2 else torch.where(x > 0, s * net.a.w, s)) + 1
            torch.testing.assert_close(way.forward(net, x), want)
    assert kernel.CALLS == [True, False] * 3, kernel.CALLS
    assert len(way._recorded(net.a)) == 2
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_the_routed_ways_run_the_original_where_the_winner_refuses_a_call(tmp_path):
    """transformers' LlamaModel passes an attention mask only while a CUDA graph captures it (H100,
    2026-12-06): the winner, verified with None, refused, and the graphed way failed where `agent
    apply`'s routing runs the original. Integration's routed model does the same now."""
    from agent.review.ways import routed_candidate

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Masked()

        def forward(self, x, masked=False):
            return self.a(x, mask=torch.ones_like(x, dtype=torch.bool) if masked else None) + 1

    way = _load(tmp_path / "routed.py", routed_candidate(
        [(Problem.model_construct(name="Masked", region_class="Masked"), GUARDED)]).source)
    net, x = Net().eval(), torch.randn(8)
    kernel = way._WINNERS["Masked"]
    with torch.no_grad():
        torch.testing.assert_close(way.forward(net, x), x * net.a.w + 1)
        torch.testing.assert_close(way.forward(net, x, masked=True), x * net.a.w + 1)  # the original's
    assert kernel.CALLS == [True, False]  # the winner ran first, refused the masked call second
