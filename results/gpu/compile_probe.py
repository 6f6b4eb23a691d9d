"""Device diagnostic (not committed): ResNet-20 at batch 128, FP16 autocast, eager and Inductor-compiled,
dynamic vs adaptive u=1 / u=100; CUDA-event medians over interleaved rounds, and graph counts."""
import statistics, sys, time
sys.path.insert(0, "src")
import torch, torch._dynamo as dynamo, torch.nn.functional as F
from adaloss.runner.models.cifar_resnet import cifar_resnet
from adaloss.scalers import AdaptiveLossScaler, DynamicLossScaler

CFG = {"dynamic": lambda: DynamicLossScaler("cuda"), "adaptive_u1": lambda: AdaptiveLossScaler("cuda", update_every=1), "adaptive_u100": lambda: AdaptiveLossScaler("cuda", update_every=100)}
def step(run, recompute=False):
    scaler, model, fwd, opt = run
    x, y = torch.randn(128, 3, 32, 32, device="cuda"), torch.randint(0, 10, (128,), device="cuda")
    if recompute: scaler.recompute_next()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.cross_entropy(fwd(x), y)
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    e.record(); e.synchronize()
    return s.elapsed_time(e)
runs = {}
for compiled in (False, True):
    for k, make in CFG.items():
        t = time.time(); torch.manual_seed(0)
        scaler = make(); model = scaler.attach(cifar_resnet(20, 10).cuda())
        fwd = torch.compile(model) if compiled else model
        run = (scaler, model, fwd, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
        for i in range(4): step(run, recompute=(k == "adaptive_u100" and i == 0))
        runs[(compiled, k)] = run
        print(f"built {'compiled' if compiled else 'eager'} {k} in {time.time()-t:.1f}s, graphs {dynamo.utils.counters['stats']['unique_graphs']}", flush=True)
times = {key: {"step": [], "recompute": [], "reuse": []} for key in runs}
for r in range(4):
    for key, run in runs.items():
        for i in range(10):
            rec = key[1] == "adaptive_u100" and i == 0
            ms = step(run, rec)
            if r: times[key]["step"].append(ms); times[key]["recompute" if rec else "reuse"].append(ms)
print("graphs after timing:", dynamo.utils.counters["stats"]["unique_graphs"])
for compiled in (False, True):
    med = {k: {kind: statistics.median(v) for kind, v in times[(compiled, k)].items() if v} for k in CFG}
    d = med["dynamic"]["step"]; u = med["adaptive_u100"]
    print(f"{'compiled' if compiled else 'eager'}: dynamic {d:.2f} ms; u1 {med['adaptive_u1']['step']:.2f} ms ({med['adaptive_u1']['step']/d:.3f}x); u100 reuse {u['reuse']:.2f} recompute {u['recompute']:.2f} amortized {(u['recompute']+99*u['reuse'])/100/d:.3f}x")
