# ---------------------------------------------------------------------------- devices


def bind_device(name, simulate):
    """The torch device that spec device `name` runs on here: cuda:N is GPU N of this rank's
    machine (a `nodeK/` prefix only says which machine); cpu and cpu:N are the host, and
    so is every device when simulating."""
    name = name.split("/")[-1]
    if simulate or not name.startswith("cuda"):
        BOUND["device"] = torch.device("cpu")
        return BOUND["device"]
    device = BOUND["device"] = torch.device(name)
    torch.cuda.set_device(device)
    return device


BOUND = {}  # "device": the torch device this process trains on (bind_device)


def rss():
    """(current, peak) resident bytes of this process: /proc/self/status on Linux (the peak since
    reset_peak_rss), else getrusage's peak for both."""
    try:
        with open("/proc/self/status", "rb", buffering=0) as f:  # read every step on rank 0: kept cheap
            text = f.read()
        return tuple(int(text[text.index(key) + 6:text.index(b"kB", text.index(key))]) * 1024
                     for key in (b"VmRSS:", b"VmHWM:"))
    except (OSError, ValueError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        peak = peak if sys.platform == "darwin" else peak * 1024
        return peak, peak


RSS_AT_START = rss()[0]  # torch imported, nothing built yet: what a CPU worker's measure starts from
with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # Linux: the peak (VmHWM) starts again from here, not from a spike while importing


def peak_memory():
    """(bytes, how measured) of this process's peak memory so far: on a GPU the CUDA allocator's
    peak; on a CPU worker the peak RSS above the RSS right after importing torch, which holds
    the model, activations, gradients and optimizer state, and also gloo's buffers, the data
    and the allocator's slack (an upper bound for what the plan counts)."""
    device = BOUND.get("device")
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    return max(0, rss()[1] - RSS_AT_START), "peak_rss_above_import"


class TensorPeak:
    """placer run on a CPU worker: the most bytes torch's CPU allocator held for tensors over the
    first STEPS steps (the first makes the optimizer's state), what torch.cuda.max_memory_allocated
    is on a GPU and what the plan estimates. c10's flag caffe2_report_cpu_memory_usage (set through
    ctypes: torch has no Python call for it) keeps the total of every thread's tensors, gloo's
    included, from set-up on; torch's profiler reads it at each allocation of the profiled steps,
    as bench/tensor_peak.py does."""

    STEPS = 2

    def __init__(self):
        self.on, self.profiler, self.steps, self.bytes = False, None, 0, None

    def count(self):
        """Set-up, before the model is built, so that its tensors are in the total."""
        try:  # (a build without the library or the flag, macOS's libc10.dylib: no tensor peak, the RSS stays)
            libc10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
            ctypes.c_bool.in_dll(libc10, "FLAGS_caffe2_report_cpu_memory_usage").value = True
        except (OSError, ValueError):
            return
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # not the profiler's start and stop lines
        self.on = True

    def begin(self):
        if self.on:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   profile_memory=True)
            self.profiler.__enter__()

    def after_step(self, last):
        if self.profiler is None:
            return
        self.steps += 1
        if self.steps < self.STEPS and not last:
            return
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as folder:
            profiler.export_chrome_trace(os.path.join(folder, "trace.json"))
            with open(os.path.join(folder, "trace.json")) as f:
                events = json.load(f)["traceEvents"]
        self.bytes = max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"), default=None)


TENSOR_PEAK = TensorPeak()


HELD = {}  # "bytes": what this rank holds of the model after set-up (note_held), in metrics.json


def note_held(model):
    """Bytes of the parameters and buffers of `model` that this rank holds (not on the meta
    device; a DTensor's local shard), each tensor once: the plan's weights and buffers."""
    tensors = {id(t): getattr(t, "_local_tensor", t) for t in [*model.parameters(), *model.buffers()]}
    HELD["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values() if not t.is_meta)


LR = {}  # "lr": the learning rate of the last optimizer step (watch_lr)


def watch_lr():
    """Keep the learning rate each optimizer step uses, from its param groups (progress.jsonl,
    metrics.csv): a hook on every optimizer, so no stage's code changes."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def hook(optimizer, args, kwargs):
        LR["lr"] = float(optimizer.param_groups[0]["lr"])

    register_optimizer_step_pre_hook(hook)


def missing_devices():
    """The spec's cuda devices that this machine lacks."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cudas = [d for d in DEVICES if d.split("/")[-1].startswith("cuda")]
    return [d for d in cudas if int(d.split(":")[-1]) >= have]


def simulation(args):
    """(simulate, why): whether every device runs as a CPU worker on gloo (runtime.simulate)."""
    if args.simulate:
        return True, "--simulate"
    if SIMULATE == "always":
        return True, "runtime.simulate is 'always'"
    missing = missing_devices()
    if missing and SIMULATE == "never":
        raise SystemExit(f"this machine lacks {', '.join(missing)} and runtime.simulate is 'never'")
    if missing:
        return True, f"this machine lacks {', '.join(missing)}"
    return False, None


def pick_backend(simulate):
    """gloo for CPU workers; NCCL between GPUs, with gloo beside it for host-memory copies."""
    backend = BACKEND
    if simulate:
        backend = "gloo"
    elif backend == "auto":
        gpus_only = all(d.split("/")[-1].startswith("cuda") for d in DEVICES)
        backend = "nccl" if gpus_only else "gloo"
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


# ---------------------------------------------------------------------------- bookkeeping

SENT = collections.Counter()  # payload bytes this rank hands to torch.distributed, per call
TIME = collections.Counter()  # seconds this rank spends per kind of work: data, comm


# What each counted call sends: (position, keyword) of the tensor it hands over
SENT_ARG = {"send": (0, "tensor"), "isend": (0, "tensor"), "all_reduce": (0, "tensor"),
            "reduce": (0, "tensor"), "broadcast": (0, "tensor"), "all_gather": (1, "tensor"),
            "all_gather_single": (1, "input_tensor"), "reduce_scatter_single": (1, "input"),
            "all_to_all_single": (1, "input")}
# DTensor (tensor parallel) talks through the functional collectives: the input comes first
SENT_ARG_FUNCTIONAL = {"all_reduce": (0, "self"), "all_gather_single": (0, "self"),
                       "reduce_scatter_single": (0, "self")}


def counted(call, index, keyword):
    """torch.distributed's `call`, counting the bytes of the tensor this rank sends with it
    (argument `index` or `keyword`; a broadcast counts on its source only)."""

    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        tensor = kwargs[keyword] if keyword in kwargs else args[index]
        src = kwargs.get("src", args[1] if len(args) > 1 else None)
        if call.__name__ != "broadcast" or src == dist.get_rank():
            SENT[call.__name__] += tensor.numel() * tensor.element_size()
        return call(*args, **kwargs)

    wrapper.counts_bytes = True
    return wrapper


def count_sent_bytes():
    """From here on, every send and collective of this process (the pasted pieces', DDP's
    hook's, FSDP's, DTensor's and the pipeline stages' too) counts its payload in SENT."""
    from torch.distributed import _functional_collectives as functional

    for module, calls in ((dist, SENT_ARG), (functional, SENT_ARG_FUNCTIONAL)):
        for name, (index, keyword) in calls.items():
            if not hasattr(getattr(module, name), "counts_bytes"):
                setattr(module, name, counted(getattr(module, name), index, keyword))
    # pipeline stages send as P2POp(dist.isend, ...), which torch accepts only if it is the
    # module's own isend: make the counting one that
    dist.distributed_c10d.isend = dist.isend


@contextlib.contextmanager
def uncounted():
    """Sends in the block are not training traffic (gathering parameters to save them):
    SENT keeps the count it had."""
    before = SENT.copy()
    try:
        yield
    finally:
        SENT.clear()
        SENT.update(before)


@contextlib.contextmanager
def timer(kind):
    """Add the time spent in the block to TIME[kind]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        TIME[kind] += time.perf_counter() - start


# ---------------------------------------------------------------------------- status


class RankStatus:
    """What this rank is doing: its step, its phase (data, forward, backward, sync, checkpoint)
    and the communication call it is in, kept in OUT/status/rankR for `placer run` (which
    passes PLACER_LAUNCHER_PID) as one line: pid, rank, step, count of updates, time, peak
    memory (peak_memory's, taken as each step starts), phase, call, tab-separated. The file is
    memory-mapped: an update is a store to memory, not a system call. When a rank times out
    waiting for a peer, `placer run` reads every rank's line to name the rank that stopped
    answering and what it was doing; when one is killed (the out-of-memory killer's SIGKILL),
    its peak so far."""

    SIZE = 512
    # blocking calls; the asynchronous ones keep their text until the phase changes, as the
    # rank waits for them later
    CALLS = ("send", "recv", "all_reduce", "broadcast", "all_gather", "reduce", "barrier", "all_gather_object",
             "gather_object", "all_gather_into_tensor", "reduce_scatter_tensor")
    ASYNC = ("isend", "irecv", "batch_isend_irecv")

    def __init__(self):
        self.map, self.groups = None, {}
        self.pid, self.rank, self.step, self.seq, self.phase, self.op = os.getpid(), 0, 0, 0, "setup", ""
        self.peak = 0

    def open(self, out, rank):
        """Start keeping the status (a no-op object otherwise) and announce every torch.distributed call."""
        os.makedirs(os.path.join(out, "status"), exist_ok=True)
        fd = os.open(os.path.join(out, "status", f"rank{rank}"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, self.SIZE)
            self.map = mmap.mmap(fd, self.SIZE)
        finally:
            os.close(fd)
        self.rank = rank
        self.write()
        for name in self.CALLS + self.ASYNC:
            if hasattr(dist, name) and not hasattr(getattr(dist, name), "announced"):
                setattr(dist, name, self.announced(getattr(dist, name), name in self.ASYNC))
        # pipeline stages send as P2POp(dist.isend, ...), which torch accepts only if it is the
        # module's own isend / irecv: make the announcing ones those
        dist.distributed_c10d.isend, dist.distributed_c10d.irecv = dist.isend, dist.irecv

    def at(self, step, phase):
        """Step `step` (counted from 0) enters `phase`."""
        self.step, self.phase, self.op = step + 1, phase, ""
        if phase == "data" and self.map is not None:  # once a step: a read of /proc/self/status
            self.peak = peak_memory()[0]
        self.write()

    def calling(self, op):
        self.op = op
        self.write()

    def write(self):
        if self.map is not None:
            self.seq += 1
            fields = (self.pid, self.rank, self.step, self.seq, time.time(), self.peak, self.phase, self.op)
            data = ("\t".join(map(str, fields)) + "\n").encode()[: self.SIZE]
            self.map[: len(data)] = data

    def announced(self, call, asynchronous):
        @functools.wraps(call)
        def wrapper(*args, **kwargs):
            self.calling(self.describe(call.__name__, args, kwargs))
            result = call(*args, **kwargs)
            if not (asynchronous or kwargs.get("async_op")):
                self.calling("")
            return result

        wrapper.announced = True
        return wrapper

    def describe(self, name, args, kwargs):
        """`send to rank 1`, `all_reduce over ranks 0, 1`: the call and whom it waits for."""
        if name in ("send", "isend", "recv", "irecv"):
            peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
            in_group = kwargs.get("group_dst", kwargs.get("group_src"))
            if peer is None and in_group is not None:  # a rank of `group` (torch's pipeline stages)
                peer = dist.get_global_rank(kwargs.get("group") or dist.group.WORLD, in_group)
            return f"{name} {'to' if 'send' in name else 'from'} rank {peer}"
        if name == "batch_isend_irecv":
            return ", ".join(f"{'send to' if 'send' in p.op.__name__ else 'recv from'} rank {p.peer}" for p in args[0])
        group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        if id(group) not in self.groups:
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            self.groups[id(group)] = ", ".join(map(str, ranks))
        return f"{name} over ranks {self.groups[id(group)]}"


STATUS = RankStatus()


class StopRun(Exception):
    """The run cannot go on because of its input, not a bug (a non-finite loss, data that ran
    out): main() says why without a traceback and leaves OUT/stopped.json for `placer run`."""

    def __init__(self, reason, step, message):
        super().__init__(message)
        self.reason, self.step = reason, step


def finite_loss(loss, step):
    """The step's loss; a NaN or inf stops the run at this step rather than training on to NaN
    parameters. Every rank sees the same (all-reduced) loss, so every rank stops."""
    if not torch.isfinite(torch.tensor(loss)):
        raise StopRun("non-finite loss", step + 1, f"the loss is {loss} at step {step + 1}")
    return loss


class BatchLosses:
    """Every step's loss of the whole batch, appended to `losses`: each rank adds its share (0
    without one). The shares of a window of steps travel in one asynchronous all-reduce that runs
    while the next window trains and is read when that one is sent, so the progress line never
    holds up a step and a fast step does not pay for a collective of its own (one per step cost
    2% of a 13 ms step). A window grows to about REPORT_S of steps: rank 0 proposes its length in
    the all-reduce itself, so every rank agrees on when the next one is sent. A NaN/inf stops the
    run at most two windows later, at the step it names; every rank reads the same sums, so every
    rank stops. settle() sends and reads everything (before a checkpoint and at the end)."""

    REPORT_S, MOST = 0.2, 32  # the progress line shows new steps about this often; steps per window at most

    def __init__(self, losses, args, rank, start):
        self.losses, self.args, self.rank, self.start = losses, args, rank, start
        self.unsent = []  # (step, its share, what rank 0 saw of the step) since the last all-reduce
        self.every = 1  # steps per window: the first is sent at once, then rank 0's proposal
        self.pending = None  # (the window's records, their summed shares, the all-reduce's work)
        self.ended = start  # when the last step ended
        TENSOR_PEAK.begin()

    def add(self, step, total, grad_norm=None):
        now, facts = time.perf_counter(), {}
        if self.rank == 0:  # read locally, no collective: the step time, lr and memory of rank 0
            facts = {"step_s": now - self.ended, "elapsed_s": now - self.start, "lr": LR.get("lr"),
                     "memory_bytes": peak_memory()[0]}
        if grad_norm is not None:  # training.clip_grad_norm: the global norm before clipping
            facts["grad_norm"] = grad_norm
        self.ended = now
        TENSOR_PEAK.after_step(step == self.args.steps - 1)
        self.unsent.append((step, total, facts))
        if len(self.unsent) >= self.every:
            self._send()

    def _send(self):
        self._read()  # one window in flight at a time
        records, self.unsent = self.unsent, []
        # the last slot: rank 0's proposed length of the next window, 0 from the others
        shares = torch.stack([t.reshape(()) for _, t, _ in records] + [torch.zeros(())])
        if self.rank == 0:
            step_s = sum(f["step_s"] for _, _, f in records) / len(records)
            shares[-1] = max(1, min(self.MOST, int(self.REPORT_S / max(step_s, 1e-9))))
        with uncounted():  # the progress line's, not training traffic: its size follows the clock
            self.pending = (records, shares, dist.all_reduce(shares, async_op=True))

    def _read(self):
        """Wait for the window in flight; append its losses and show them (rank 0)."""
        if self.pending is None:
            return
        records, shares, work = self.pending
        self.pending = None
        STATUS.calling(f"all_reduce of the loss of steps {records[0][0] + 1}..{records[-1][0] + 1}")
        work.wait()
        *sums, self.every = shares.tolist()
        self.every = int(self.every)
        for (step, _, facts), loss in zip(records, sums):
            self.losses.append(finite_loss(loss, step))
            if self.rank == 0:
                report_step(self.args.out, step, self.args.steps, loss, self.start, **facts)

    def settle(self):
        """Every step's loss so far summed, appended and shown."""
        if self.unsent:
            self._send()
        self._read()


RESUMED_FROM = 0  # the step this process started from: its checkpoint's when it resumed


def resuming(args):
    """Whether this process continues a run: --resume, or a restart by the launcher after a
    failure (torch elastic counts them in TORCHELASTIC_RESTART_COUNT)."""
    return args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def report_step(out, step, steps, loss, start, **facts):
    """Rank 0: one line per step on stdout and in OUT/progress.jsonl (what `placer run` shows and
    writes to metrics.csv); `facts`: the step's step_s, lr, memory_bytes, and grad_norm with
    training.clip_grad_norm (the global norm before clipping); elapsed_s when the step ended, if
    it is shown later."""
    elapsed = facts.pop("elapsed_s", None) or time.perf_counter() - start  # BatchLosses: when the step ended
    record = {"step": step + 1, "steps": steps, "loss": loss,
              "samples_per_s": (step + 1 - RESUMED_FROM) * BATCH_SIZE / elapsed, "elapsed_s": elapsed, **facts}
    print(f"step {step + 1}/{steps}  loss {loss:.6f}  {record['samples_per_s']:.0f} samples/s",
          flush=True)
    report_event(out, record)


def report_event(out, record):
    """Append one record to OUT/progress.jsonl (a resumed or restarted run appends to it)."""
    if out:
        with open(os.path.join(out, "progress.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


def named_params(stage, model):
    """The stage's parameters under the whole model's names (the names the reference saves, a
    tied parameter under each of its names). A stage cut by torch.distributed.pipelining keeps
    the model's names but holds its own copy of a tied parameter: found by name there."""
    names = dict(model.named_parameters(remove_duplicate=False))
    by_name = {n: p for n, p in stage.named_parameters(remove_duplicate=False) if n in names}
    if by_name:
        return by_name
    mine = {id(p) for p in stage.parameters()}
    return {name: p for name, p in names.items() if id(p) in mine}


def full_tensor(t):
    """A DTensor's whole value (a collective over its mesh); a plain tensor (replicated: a
    tensor-parallel segment's LayerNorm) is already whole."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


FIRST_GRADS = {}  # name -> its gradient as the first optimizer step that updates it takes it
WHOLE_GRADS = {}  # name -> (parameter, kept here[, whole]): split parameters, whose first gradients are gathered whole
GRADS_HOOK = []  # record_first_grads' hook, for gradients no optimizer of this rank steps (record_grads_now)


def asked_anywhere(flag):
    """Whether any rank was asked (`placer run --check` on one node of several asks its own
    ranks only, and the check wants every rank's gradients)."""
    every = [None] * dist.get_world_size()
    with uncounted():  # set-up, not training
        dist.all_gather_object(every, bool(flag))
    return any(every)


def record_first_grads(named):
    """Keep the gradient of each of `named` (name -> parameter, filled as segments are set up)
    as the first optimizer step takes it: after every sum over ranks, so `run --check` can
    compare it with the reference's at any learning rate. A parameter of WHOLE_GRADS is split
    over its group (a DTensor: tensor parallel, FSDP2; or a channel slice, whose `whole` joins
    the slices): every rank of the group gathers its gradient whole, the ranks walking their
    optimizer's parameters in the same order, one at a time, and only the rank keeping it holds it."""
    done = set()

    def hook(optimizer, args, kwargs):
        table = collections.defaultdict(list)  # id of a parameter -> (name, kept here, how it is made whole)
        for n, p in named.items():  # a tie shared on this rank: each of its names
            table[id(p)].append((n, True, None))
        for n, (p, keep, *whole) in WHOLE_GRADS.items():
            table[id(p)].append((n, keep, whole[0] if whole else full_tensor))
        for group in optimizer.param_groups:
            for p in group["params"]:
                made = {}  # how -> the whole gradient: a tie's names share one gather
                for n, keep, how in table.get(id(p), ()):
                    if n in done or p.grad is None:
                        continue
                    if how not in made:
                        with uncounted():  # checking, not training: left out of the bytes sent
                            made[how] = (how(p.grad) if how else p.grad).detach().cpu().clone()
                    done.add(n)
                    if keep:
                        FIRST_GRADS[n] = made[how]
        if len(done) >= len(named) + len(WHOLE_GRADS):
            handle.remove()

    # (an import here: `torch.optim.optimizer` is not an attribute of torch.optim)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(hook)
    GRADS_HOOK.append(hook)


def record_grads_now(params):
    """Record the first gradients of `params` as record_first_grads' hook does at an optimizer
    step: for those a parameter server elsewhere steps copies of (a 2-D segment's SliceServer)."""
    stand_in = type("Params", (), {"param_groups": [{"params": list(params)}]})()  # what the hook reads
    for hook in GRADS_HOOK:
        hook(stand_in, (), {})


def tied_names(model):
    """The names of each parameter that several of the model's modules share (tied weights)."""
    names = collections.defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)].append(name)
    return [n for n in names.values() if len(n) > 1]


def write_outputs(out, losses, params, seconds, **facts):
    """OUT/metrics.json (losses, speed, what was measured) and OUT/final_params.pt (`params`)."""
    steps = len(losses)
    trained = steps - RESUMED_FROM  # by this process; the losses are those of every step
    metrics = {"spec": SPEC_NAME, "losses": losses, "steps": steps, "batch_size": BATCH_SIZE,
               "resumed_from": RESUMED_FROM, "steps_trained": trained,
               "wall_s": seconds, "steps_per_s": trained / seconds if seconds else None,
               "samples_per_s": trained * BATCH_SIZE / seconds if seconds else None, **facts}
    replace_atomically(os.path.join(out, "metrics.json"), lambda tmp: write_json(tmp, metrics))
    if params is not None:  # (a placed run's rank 0 wrote them as they arrived: write_params)
        replace_atomically(os.path.join(out, "final_params.pt"), lambda tmp: torch.save(dict(sorted(params.items())), tmp))


def write_first_grads(out, grads):
    """OUT/first_grads.pt: each parameter's gradient at the first step (--grads)."""
    replace_atomically(os.path.join(out, "first_grads.pt"), lambda tmp: torch.save(dict(sorted(grads.items())), tmp))


def replace_atomically(path, write):
    """write(tmp) to a temporary name beside `path`, then rename it over `path`: a reader, or a
    run killed while writing, sees the old file or the whole new one, never half of one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def finish(args, rank, world, losses, own, seconds, **facts):
    """Rank 0 gathers what every rank measured and the parameters it owns, and writes them."""
    STATUS.at(len(losses) - 1, "finish")
    peak, measure = peak_memory()
    stats = {"device": DEVICES[rank], "bytes_sent": sum(SENT.values()), "by_call": dict(SENT),
             # comm: waited for in copies and syncs, plus DDP's all-reduce in flight while backward ran
             # (ddp_sum's timing); that overlapped part is in compute too, as both ran at once
             "time_s": {"compute": max(0.0, seconds - TIME["comm"] - TIME["data"]),
                        "comm": TIME["comm"] + TIME["overlapped"], "overlapped": TIME["overlapped"],
                        "data": TIME["data"]},
             "memory": {"peak_bytes": peak, "measure": measure, **({"held_bytes": HELD["bytes"]} if HELD else {}),
                        **({"tensor_peak_bytes": TENSOR_PEAK.bytes} if TENSOR_PEAK.bytes is not None else {})},
             "grads": bool(args.grads and not resuming(args))}
    every = [None] * world
    dist.all_gather_object(every, stats)
    if any(s["grads"] for s in every):  # one node's launcher may ask alone: every rank gathers
        grads = [None] * world if rank == 0 else None
        dist.gather_object(FIRST_GRADS, grads, dst=0)
        if rank == 0 and args.out:
            write_first_grads(args.out, {name: g for part in grads for name, g in part.items()})
    if not args.out:  # nothing is written: nothing is gathered
        return
    listing = [None] * world  # every rank's (name, shape, dtype) of what it owns
    dist.all_gather_object(listing, [(n, tuple(p.shape), p.dtype) for n, p in own.items()])
    if rank == 0:
        replace_atomically(os.path.join(args.out, "final_params.pt"),
                           lambda tmp: write_params(tmp, listing, lambda put: gather_params(own, rank, listing, put)))
    else:
        gather_params(own, rank, listing)
    if rank == 0:
        write_outputs(args.out, losses, None, seconds, devices=DEVICES, world_size=world,
                      bytes_sent={s["device"]: s["bytes_sent"] for s in every},
                      bytes_by_call={s["device"]: s["by_call"] for s in every},
                      time_s={s["device"]: s["time_s"] for s in every},
                      peak_memory={s["device"]: s["memory"] for s in every}, **facts)


GATHERED = {}  # name -> split parameter (a DTensor: tensor parallel, FSDP2) of this rank's groups


def gather_params(own, rank, listing, put=None):
    """Rank 0 gets every rank's parameters, one tensor at a time, and hands each to put(name,
    tensor) as it arrives: the names, shapes and dtypes went as objects (`listing`), each tensor
    goes by send and recv (gather_object would pickle every rank's whole share at once, several
    copies of the model on rank 0). A split parameter is gathered whole (full_tensor: every rank
    of its group, walking the same list) only as it is sent, so no rank holds more than one
    whole at a time."""
    nccl = dist.get_backend() == "nccl"  # it sends device tensors only
    where = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    for r, names in enumerate(listing):  # every rank walks the same list: sends and recvs pair up
        for name, shape, dtype in names:
            split = GATHERED.get(name)
            value = split.full_tensor() if hasattr(split, "full_tensor") else own.get(name)
            if r == rank == 0:
                put(name, value.detach())
            elif rank == r:
                dist.send(value.detach().to(where).contiguous(), 0)
            elif rank == 0:
                value = torch.empty(shape, dtype=dtype, device=where)
                dist.recv(value, r)
                put(name, value)
            del value  # the next one's gathered whole only once this one is let go


def write_params(path, listing, gather):
    """A file torch.load reads back as {name: tensor} (names sorted), written without holding
    the tensors: torch.save lays it out from fake tensors (skip_data: shapes and dtypes, no
    bytes), then gather(put) hands over each tensor, copied into its place in the file through
    a shared memory map that is let go after each one."""
    import mmap

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        layout = {name: torch.empty(shape, dtype=dtype) for names in listing for name, shape, dtype in names}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(dict(sorted(layout.items())), path)
    del layout

    def put(name, value):
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            mapped = torch.load(path, mmap=True, weights_only=True)
        mapped[name].copy_(value)  # into the file's pages; unmapped (and out of this rank's memory) below
        del mapped

    gather(put)


def load_user(target):
    """The spec's own code: `file.py:name` (relative to the spec) or `package.module:name`."""
    where, _, name = target.rpartition(":")
    if not where.endswith(".py"):
        sys.path.insert(0, SPEC_DIR)
        return getattr(importlib.import_module(where), name)
    path = os.path.join(SPEC_DIR, where)
    sys.path.insert(0, os.path.dirname(path))  # the file may import its neighbours
    module_name = "spec_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def prefetched(make, steps, first=0):
    """Yield make(first), make(first + 1), ... make(steps - 1); with PREFETCH > 0 a background
    thread makes them up to PREFETCH ahead, so the step loop rarely waits for data. 'auto': 2 on
    a GPU; none on a CPU worker, which already has its share of the cores (a thread there only
    takes turns with the compute: steps ran 3-8% slower with one)."""
    ahead = PREFETCH if PREFETCH != "auto" else 0 if BOUND["device"].type == "cpu" else 2
    if ahead == 0:
        for step in range(first, steps):
            yield batch_of(make, step, steps)
        return
    ready = queue.Queue(maxsize=ahead)

    def fill():
        try:
            for step in range(first, steps):
                ready.put((batch_of(make, step, steps), None))
        except Exception as e:  # hand the error to the step loop, which raises it
            ready.put((None, e))

    threading.Thread(target=fill, daemon=True).start()
    for _ in range(first, steps):
        batch, error = ready.get()
        if error is not None:
            raise error
        yield batch


def batch_of(make, step, steps):
    """make(step), with a data iterator that ended named as such (a StopIteration would
    otherwise surface as "generator raised StopIteration")."""
    try:
        return make(step)
    except StopIteration:
        raise StopRun("data exhausted", step + 1, f"the data iterator is exhausted at step {step + 1}: it gave "
                      f"{step} batches, training needs {steps}") from None
