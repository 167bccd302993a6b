"""Our kernels inside torch.compile against the compiler alone, on the example, one workload at a time.

    MODE=reduce-overhead WL=decode,small_batch python bench/composed_check.py   (defaults: MODE unset, WL=prefill)

The attention is routed through a per-shape dispatcher whose kernel on the workload's shape is
torch.compile of the region, the RMSNorm through tests/candidates/rmsnorm_triton.py (a Triton op).
Prints each way's median of 20 (CUDA events on a GPU), its error against eager and dynamo's graph
breaks: eager, torch.compile alone, the composed way as integration builds it (NEW: the compiler
traces the region's own code on shapes with no kernel of ours), and with every shape one opaque
op as before 2026-12-04 (OLD). NO_RMS=1 routes the attention only. A diagnostic, not a verdict:
integration's composed ways are measured by the harness."""
import importlib.util, os, statistics, sys, time
import torch
sys.path.insert(0, os.getcwd())
spec = importlib.util.spec_from_file_location("llama", "examples/llama.py"); L = importlib.util.module_from_spec(spec)
sys.modules["llama"] = L; spec.loader.exec_module(L)
from agent.review.dispatch import shape_key
from agent.prompting import render_code
from agent.review.ways import composed_candidate
from tools.problem import Problem
dev = "cuda" if torch.cuda.is_available() else "cpu"
T0 = time.time()
model = L.Model(*L.get_init_inputs()).to(dev).eval()
work = {k: v for k, v in L.get_workloads().items() if k in os.environ.get("WL", "prefill").split(",")}
mv = lambda xs: [x.to(dev) if isinstance(x, torch.Tensor) else x for x in xs]
keys = {}
h = [m.register_forward_pre_hook(lambda m, a, k: keys.setdefault(cur[0], shape_key(list(a), dict(k))) and None, with_kwargs=True)
     for m in model.modules() if type(m).__name__ == "LlamaAttention"]
cur = [None]
with torch.no_grad():
    for name, w in work.items():
        cur[0] = name
        model(*mv(w["inputs"]))
for x in h: x.remove()
disp = render_code("kernels/dispatch_by_shape.py.j2", kernels=[render_code("kernels/torch_compile.py.j2", mode=None, options={})],
                   table=[{"key": keys[n], "kernel": 0} for n in work], default=None)
routes = [(Problem.model_construct(name="LlamaAttention", region_class="LlamaAttention"), disp),
          (Problem.model_construct(name="LlamaRMSNorm", region_class="LlamaRMSNorm"), open("tests/candidates/rmsnorm_triton.py").read())]
routes = routes[:1] if os.environ.get("NO_RMS") else routes
src = composed_candidate(routes, os.environ.get("MODE") or None).source

def load(tag):
    path = f"/tmp/composed_{tag}_{os.getpid()}.py"; open(path, "w").write(src)
    s = importlib.util.spec_from_file_location(f"composed_{tag}", path); C = importlib.util.module_from_spec(s)
    sys.modules[s.name] = C; s.loader.exec_module(C)
    return C

def bench(fn, inputs, n=20):
    with torch.no_grad():
        for _ in range(3): fn(*inputs)
        if dev == "cuda": torch.cuda.synchronize()
        ts = []
        for _ in range(n):
            if dev == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True); a.record(); fn(*inputs); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
            else:
                t = time.perf_counter(); fn(*inputs); ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)

mode = os.environ.get("MODE") or None
ways = [("compile", lambda: (lambda m: m)(torch.compile(model, mode=mode)))]
for tag in ("NEW", "OLD"):
    def make(tag=tag):
        C = load(tag)
        if tag == "OLD":
            C._CHECKS = {}  # every shape one opaque op, as before the fix
        return lambda *a: C.forward(model, *a)
    ways.append((tag, make))
# One function per way for every workload, as a worker of integration runs it: the composed way's
# eager first call (its ops' schemas) is on the first workload, and the others' first calls come
# inside the compiled model (where a compile nested in an op would compile during a capture).
inputs = {name: mv(w["inputs"]) for name, w in work.items()}
want = {}
with torch.no_grad():
    for name, xs in inputs.items():
        want[name] = model(*[x.clone() if isinstance(x, torch.Tensor) else x for x in xs])
        print(f"{name} eager {bench(model, xs):.3f} ms  [{time.time()-T0:.0f}s]", flush=True)
for tag, make in ways:
    try:
        t = time.time()
        fn = make()
        for name, xs in inputs.items():
            with torch.no_grad():
                got = fn(*[x.clone() if isinstance(x, torch.Tensor) else x for x in xs])
            err = (got.float() - want[name].float()).abs().max().item()
            from torch._dynamo.utils import counters
            print(f"{name} {tag} {bench(fn, xs):.3f} ms err {err:.3g} breaks {sum(counters['graph_break'].values())} "
                  f"since its first call {time.time()-t:.0f}s [{time.time()-T0:.0f}s]", flush=True)
    except Exception as e:
        print(f"{tag} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
