"""Sample every thread's Python stack every ~0.5 ms while bench train runs one variant."""
import collections, sys, threading, time, json, os
sys.setswitchinterval(0.001)
counts = {}
stop = False
recording = False
def sampler():
    me = threading.get_ident()
    names = {}
    while not stop:
        if not recording:
            time.sleep(0.001)
            continue
        frames = sys._current_frames()
        for tid, f in frames.items():
            if tid == me:
                continue
            stack = []
            while f is not None and len(stack) < 40:
                co = f.f_code
                stack.append(f"{os.path.basename(co.co_filename)}:{co.co_name}:{f.f_lineno}")
                f = f.f_back
            key = (tid, tuple(stack))
            counts[key] = counts.get(key, 0) + 1
        time.sleep(0.0005)
variant = sys.argv[1]
steps = sys.argv[2]
sys.path.insert(0, os.getcwd())
import benchmarks.train as T
_orig_cb = T._WallClock.callback
def _cb(self):
    cb = _orig_cb(self)
    s0, e0 = cb.on_train_epoch_start, cb.on_train_epoch_end
    def start(trainer, pl_module):
        global recording
        s0(trainer, pl_module)
        recording = trainer.current_epoch == 1
    def end(trainer, pl_module):
        global recording
        recording = False
        e0(trainer, pl_module)
    cb.on_train_epoch_start, cb.on_train_epoch_end = start, end
    return cb
T._WallClock.callback = _cb
t = threading.Thread(target=sampler, daemon=True)
t.start()
T.main(["--device", "cuda", "--variants", variant, "--reps", "1", "--steps", steps])
stop = True
main_id = threading.main_thread().ident
per_thread = collections.Counter()
self_fn = collections.Counter()
incl = collections.Counter()
for (tid, stack), c in counts.items():
    tag = "main" if tid == main_id else str(tid)
    per_thread[tag] += c
    if stack:
        self_fn[(tag, stack[0])] += c
        seen = set()
        for fr in stack:
            fn = fr.rsplit(":", 1)[0]
            if fn not in seen:
                seen.add(fn)
                incl[(tag, fn)] += c
print("samples per thread", per_thread.most_common(8))
print("== main thread inclusive (lightning_embcache/torch files) ==")
for (tag, fn), c in incl.most_common(3000):
    if tag == "main" and c > per_thread["main"] * 0.005:
        print(f"{c:7d} {100*c/per_thread['main']:5.1f}% {fn}")
names = {t.ident: t.name for t in threading.enumerate()}
print("== other threads inclusive ==")
for (tag, fn), c in incl.most_common(3000):
    if tag != "main" and c > 0.02 * per_thread[tag] and per_thread[tag] > 0.05 * per_thread["main"]:
        print(f"{tag[-6:]:6s} {c:7d} {100*c/per_thread[tag]:5.1f}% {fn}")
print("== self top (all threads) ==")
for (tag, fr), c in self_fn.most_common(60):
    print(f"{tag[:6]:6s} {c:7d} {fr}")
