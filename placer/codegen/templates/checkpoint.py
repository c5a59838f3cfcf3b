def save_checkpoint(out, step, rank, modules, optimizers, losses, schedulers=(), model=None):
    """Every rank saves what it holds to CHECKPOINT_DIR/step_N. Where the layout can be resharded
    (RESHARD None: whole tensors and DTensor shards of the model), its model and optimizer
    tensors go by the model's names to step_N/dcp (torch.distributed.checkpoint, a replica
    once), which any such layout loads, and rankR.pt holds the rest: its optimizers' settings
    and other state, lr schedulers', random number generator and the losses so far. Otherwise
    rankR.pt holds everything as plain tensors (sharded state as this rank's pieces: no device
    mesh is pickled; ZeRO's optimizer state as its shard), read back by rank R of the same
    LAYOUT. A step directory counts only once it holds COMPLETE (every file's size and sha256,
    and the layout), written after every rank's files; then old checkpoints are rotated
    (CHECKPOINT_KEEP)."""
    root = os.path.join(out or ".", CHECKPOINT_DIR)
    path = os.path.join(root, f"step_{step + 1}")
    STATUS.at(step, "checkpoint")
    first_here = int(os.environ.get("LOCAL_RANK", 0)) == 0  # each machine writes its own run directory
    if first_here:  # a step directory left by an earlier attempt is rewritten from empty: its COMPLETE
        # no longer counts, and the temporary files of a save that was killed go
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, "COMPLETE"))  # first: a kill in the rmtree leaves no COMPLETE
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    by_name = RESHARD is None and model is not None
    state = {
        "step": step + 1,
        "rank": rank,
        "world": dist.get_world_size(),
        "modules": [] if by_name else [local_tensors(m.state_dict()) for m in modules],
        "optimizers": [optimizer_rest(opt, model, modules) if by_name else optimizer_state(opt) for opt in optimizers],
        "schedulers": [scheduler.state_dict() for scheduler in schedulers],
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        "losses": list(losses),
    }
    name, entry = f"rank{rank}.pt", {}
    with disk_full_said(path):
        replace_atomically(os.path.join(path, name), lambda tmp: entry.update(save_hashed(state, tmp)))
        mine = [(name, entry)] + (save_by_name(os.path.join(path, "dcp"), rank, model, modules, optimizers)
                                  if by_name else [])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)  # every rank's files are written: the checkpoint is complete
    if first_here:  # the files of this machine's ranks (each machine writes its own run directory)
        files = {n: d for n, d in sorted(f for files in every for f in files) if os.path.exists(os.path.join(path, n))}
        info = {"step": step + 1, "world": dist.get_world_size(), "layout": LAYOUT, "reshard": RESHARD,
                "files": files}
        replace_atomically(os.path.join(path, "COMPLETE"), lambda tmp: write_json(tmp, info))
        rotate_checkpoints(root, step + 1)


@contextlib.contextmanager
def disk_full_said(path):
    """A write that fails on a full disk raises OSError ENOSPC naming the checkpoint (placer run's
    R028): torch's writers say "enforce fail at inline_container.cc" instead, the errno lost
    (DCP's) or left in the context."""
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        cause, full = e, False
        while cause is not None and not full:
            full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
            cause = cause.__cause__ or cause.__context__
        with contextlib.suppress(OSError):
            full = full or shutil.disk_usage(path).free < 1 << 20
        if not full:
            raise
        raise OSError(errno.ENOSPC, f"No space left on device: writing the checkpoint {path}") from None


def save_by_name(path, rank, model, modules, optimizers):
    """Save this rank's tensors by the model's names with torch.distributed.checkpoint (DCP, a
    collective): `model.NAME` and `optim.NAME.KEY` (a tied parameter under each of its names),
    DTensor shards as themselves, replicas once. [(file, its size and sha256)] of the files this
    rank wrote (DCP writes them through its own streams: read back to hash them)."""
    import torch.distributed.checkpoint as dcp

    with uncounted():  # its planning collectives are not training traffic
        dcp.save(state_by_name(model, modules, optimizers), checkpoint_id=path)
    mine = [n for n in os.listdir(path) if n.startswith(f"__{rank}_") or (rank == 0 and n == ".metadata")]
    return [(f"dcp/{n}", {"bytes": os.path.getsize(os.path.join(path, n)),
                          "sha256": file_sha256(os.path.join(path, n))}) for n in sorted(mine)]


def tensors_by_name(model, modules):
    """{name in the whole model: tensor} of the parameters and persistent buffers this rank's
    modules hold (DDP's and FSDP2's wrappers hold the model's own modules and tensors)."""
    held = {id(t) for m in modules for t in [*m.parameters(), *m.buffers()]}
    out = {}
    for path, sub in model.named_modules(remove_duplicate=False):
        for key, t in [*sub._parameters.items(), *sub._buffers.items()]:
            if t is not None and id(t) in held and key not in sub._non_persistent_buffers_set:
                out[f"{path}.{key}" if path else key] = t
    return out


def state_by_name(model, modules, optimizers):
    """What save_by_name saves: the tensors by name, and each optimizer state tensor under its
    parameter's first name."""
    named = tensors_by_name(model, modules)
    first = first_names(named)
    state = {f"model.{name}": t.detach() for name, t in named.items()}
    for opt in optimizers:
        for p, entry in opt.state.items():
            for key, value in entry.items():
                if torch.is_tensor(value):
                    state[f"optim.{first[id(p)]}.{key}"] = value
    return state


def optimizer_rest(opt, model, modules):
    """What save_by_name leaves out of an optimizer: its kind, its settings (the lr schedule changes
    them) and any state that is not a tensor (by its parameter's name)."""
    first = first_names(tensors_by_name(model, modules))
    other = {first[id(p)]: {k: v for k, v in entry.items() if not torch.is_tensor(v)} for p, entry in opt.state.items()}
    return {"kind": type(opt).__name__, "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                         for g in opt.param_groups],
            "other": {name: entry for name, entry in other.items() if entry}}


def first_names(named):
    """id(tensor) -> its first name in `named` (a tied parameter has several)."""
    first = {}
    for name, t in named.items():
        first.setdefault(id(t), name)
    return first


def load_by_name(path, model, modules, optimizers):
    """Read the tensors that save_by_name wrote, under this placement or another, into this
    rank's: DCP's planner reads each piece this rank holds (its shard, or the whole) from
    whichever files hold it. Optimizer state, which a new optimizer lacks, is made first in the
    checkpoint's shape (a parameter's, or a scalar: Adam's step)."""
    import torch.distributed.checkpoint as dcp

    stored = collections.defaultdict(list)  # parameter name -> [(state key, its metadata)]
    for key, meta in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items():
        if key.startswith("optim."):
            name, _, entry = key[len("optim."):].rpartition(".")  # an optimizer's keys have no dot
            stored[name].append((entry, meta))
    named = tensors_by_name(model, modules)
    first = first_names(named)
    state = {f"model.{name}": t.detach() for name, t in named.items()}
    made = []
    for opt in optimizers:
        for p in [p for group in opt.param_groups for p in group["params"]]:
            for entry, meta in stored[first[id(p)]]:
                whole = tuple(meta.size) == tuple(p.shape)
                value = torch.zeros_like(p, dtype=meta.properties.dtype) if whole else \
                    torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
                state[f"optim.{first[id(p)]}.{entry}"] = value
                made.append((opt, p, entry, value))
    with uncounted():
        dcp.load(state, checkpoint_id=path)
    for opt, p, entry, value in made:
        opt.state[p][entry] = value


class HashedFile:
    """A file that hashes what is written to it: the digest of the bytes torch.save wrote,
    without reading the file back."""

    def __init__(self, f):
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0

    def write(self, data):
        self.sha256.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def save_hashed(state, path):
    """torch.save(state, path); {"bytes": its size, "sha256": its digest}."""
    with open(path, "wb") as f:
        out = HashedFile(f)
        torch.save(state, out)
    return {"bytes": out.size, "sha256": out.sha256.hexdigest()}


def file_sha256(path):
    """The file's sha256, read in 1 MiB pieces (no second copy of a large file in memory).
    sha256 rather than blake2b: with the CPU's SHA instructions it is 2-3x faster here."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            h.update(piece)
    return h.hexdigest()


def local_tensors(state):
    """{name: tensor} with DTensors as this rank's local piece, copied to the host."""
    out = {}
    for name, value in state.items():
        if isinstance(value, DTensor):
            value = value.to_local()
        out[name] = value.detach().cpu().clone() if torch.is_tensor(value) else value
    return out


def optimizer_state(opt):
    """This rank's optimizer state as plain tensors; `sharded` lists the (parameter, key)
    entries that were DTensor shards (FSDP), made DTensors again when loaded."""
    inner = opt.optim if hasattr(opt, "consolidate_state_dict") else opt  # ZeRO: this rank's shard
    sd = inner.state_dict()
    sharded = [(i, k) for i, entry in sd["state"].items() for k, v in entry.items() if isinstance(v, DTensor)]
    state = {i: local_tensors(entry) for i, entry in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"], "sharded": sharded, "kind": type(inner).__name__}


def rotate_checkpoints(root, newest):
    """Keep the newest CHECKPOINT_KEEP complete checkpoints up to step `newest` (the one just
    written among them; None keeps all) and drop incomplete ones up to it (a crash's leftovers).
    Later steps, left by an earlier attempt that got further, are never touched."""
    steps = {}
    for name in os.listdir(root):
        if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) <= newest:
            steps[int(name[5:])] = os.path.exists(os.path.join(root, name, "COMPLETE"))
    complete = sorted((s for s, done in steps.items() if done), reverse=True)
    keep = set(complete if CHECKPOINT_KEEP is None else complete[:CHECKPOINT_KEEP]) | {newest}
    for s in steps:
        if s not in keep:
            shutil.rmtree(os.path.join(root, f"step_{s}"), ignore_errors=True)


def complete_steps(root, last):
    """The steps up to `last` with a complete checkpoint under root, newest first."""
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit() and int(n[5:]) <= last]
    return sorted((int(n[5:]) for n in names if os.path.exists(os.path.join(root, n, "COMPLETE"))), reverse=True)


def read_checkpoint(root, step, rank, world):
    """(state, None), or (None, why) when rank's file of step is missing, of another size or
    sha256 than COMPLETE records (a damaged file loads silently: a flipped bit trains on),
    unreadable, or not this rank's. The digest is checked before the file is loaded."""
    path = os.path.join(root, f"step_{step}")
    name = f"rank{rank}.pt"
    try:
        why = verify_file(path, name, complete_info(root, step).get("files", {}).get(name))
        if why:
            return None, why
        state = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
    except Exception as e:  # missing, truncated or garbled: the checkpoint is not usable
        return None, f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if state.get("step") != step or state.get("rank") != rank or state.get("world") != world:
        return None, f"{name} holds step {state.get('step')} of rank {state.get('rank')} of {state.get('world')}"
    return state, None


def complete_info(root, step):
    """What step_N/COMPLETE records ({} if it cannot be read)."""
    try:
        with open(os.path.join(root, f"step_{step}", "COMPLETE")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def verify_file(path, name, entry):
    """None if the file has the size and sha256 that COMPLETE records (entry), else why not."""
    if isinstance(entry, int):  # written by an earlier placer: sizes only
        entry = {"bytes": entry}
    size = os.path.getsize(os.path.join(path, name))
    if entry is not None and size != entry.get("bytes", size):
        return f"{name} is {size} bytes, not {entry['bytes']}"
    if entry is not None and "sha256" in entry and file_sha256(os.path.join(path, name)) != entry["sha256"]:
        return f"{name} is damaged: its sha256 is not the one COMPLETE records"
    return None


def read_by_name(root, step, rank, world, info, same):
    """(the rank file to load the rest from, None) of a checkpoint saved by name, or (None, why):
    this rank verifies its share of the files DCP reads (the verdict is all-reduced before any is
    loaded) and its rank file: its own under the same layout (`same`), else rank 0's (a reshard
    has no rank-for-rank match), which every rank reads."""
    path = os.path.join(root, f"step_{step}")
    files = info.get("files", {})
    name = f"rank{rank}.pt" if same else "rank0.pt"
    shared = sorted(n for n in files if n.startswith("dcp/")) + ([] if same else ["rank0.pt"])
    try:
        for checked in shared[rank::world] + ([name] if same else []):
            why = verify_file(path, checked, files.get(checked))
            if why:
                return None, why
        state = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
    except Exception as e:
        return None, f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if state.get("step") != step or same and (state.get("rank"), state.get("world")) != (rank, world):
        return None, f"{name} holds step {state.get('step')} of rank {state.get('rank')} of {state.get('world')}"
    return state, None


def load_saved_by_name(path, state, model, modules, optimizers, schedulers, same):
    """Load a checkpoint saved by name into this rank: DCP's tensors, and from `state` (read_by_name's
    rank file) the optimizers' settings and other state, the lr schedulers', the random state.
    Under another layout every optimizer and scheduler takes the first one's (they step alike).
    What does not fit, in words (None when it all loaded)."""
    saved = state["optimizers"] if same else state["optimizers"][:1] * len(optimizers)
    if len(saved) != len(optimizers):
        return f"it holds {len(state['optimizers'])} optimizer(s), this rank {len(optimizers)}"
    for opt, mine in zip(optimizers, saved):
        if mine.get("kind") != type(opt).__name__:
            return f"its optimizer is {mine.get('kind')}, this rank's {type(opt).__name__}"
    try:
        load_by_name(os.path.join(path, "dcp"), model, modules, optimizers)
    except BaseException as e:  # DCP's CheckpointException, on every rank alike: a name or shape it lacks
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    names = first_names(tensors_by_name(model, modules))
    for opt, mine in zip(optimizers, saved):
        for group, settings in zip(opt.param_groups, mine["param_groups"]):  # what the lr schedule changed
            group.update(settings)
        for p in [p for group in opt.param_groups for p in group["params"]]:
            opt.state[p].update(mine.get("other", {}).get(names[id(p)], {}))
    for scheduler, mine in zip(schedulers, state["schedulers"] if same else state["schedulers"][:1] * len(schedulers)):
        scheduler.load_state_dict(mine)
    torch.set_rng_state(state["rng"])
    if same and state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])
    return None


def fits(state, modules, optimizers, schedulers=()):
    """None if the checkpoint holds what this rank's modules and optimizers hold (names and
    shapes), else what differs: it was written for another placement or model."""
    if len(state["modules"]) != len(modules) or len(state["optimizers"]) != len(optimizers):
        return (f"it holds {len(state['modules'])} module(s) and {len(state['optimizers'])} optimizer(s), "
                f"this rank {len(modules)} and {len(optimizers)}")
    saved_schedulers = len(state.get("schedulers", []))
    if saved_schedulers != len(schedulers):
        return f"it holds {saved_schedulers} lr scheduler(s), this rank {len(schedulers)}"
    for module, saved in zip(modules, state["modules"]):
        mine = local_tensors(module.state_dict())
        if set(mine) != set(saved):
            return f"its names {sorted(set(saved) ^ set(mine))[:4]} differ"
        for name, value in mine.items():
            if torch.is_tensor(value) and tuple(value.shape) != tuple(saved[name].shape):
                return f"{name} is {list(saved[name].shape)} there, {list(value.shape)} here"
    for opt, saved in zip(optimizers, state["optimizers"]):
        inner = opt.optim if hasattr(opt, "consolidate_state_dict") else opt
        # (as it saves them: ZeroSlices' state is its part's, one flat parameter)
        sizes = [len(g["params"]) for g in inner.state_dict()["param_groups"]]
        if sizes != [len(g["params"]) for g in saved["param_groups"]]:
            return "its optimizer holds other parameters"
        # another kind (--resume-anyway from SGD to Adam) would fail later, on a missing key
        if saved.get("kind", type(inner).__name__) != type(inner).__name__:
            return f"its optimizer is {saved['kind']}, this rank's {type(inner).__name__}"
    return None


def load_checkpoint(state, modules, optimizers, schedulers=()):
    """Copy a checkpoint's state into this rank's modules, optimizers, schedulers and generators."""
    with torch.no_grad():
        for module, saved in zip(modules, state["modules"]):
            for name, value in module.state_dict(keep_vars=True).items():
                if torch.is_tensor(value):
                    (value.to_local() if isinstance(value, DTensor) else value).copy_(saved[name])
    for opt, saved in zip(optimizers, state["optimizers"]):
        inner = opt.optim if hasattr(opt, "consolidate_state_dict") else opt
        params = [p for group in inner.param_groups for p in group["params"]]
        entries = {i: dict(entry) for i, entry in saved["state"].items()}
        for i, key in saved["sharded"]:  # FSDP: the shard back into a DTensor like its parameter's
            p = params[i]
            entries[i][key] = DTensor.from_local(entries[i][key].to(p.device), p.device_mesh, p.placements,
                                                 run_check=False, shape=p.shape, stride=p.stride())
        inner.load_state_dict({"state": entries, "param_groups": saved["param_groups"]})
    for scheduler, saved in zip(schedulers, state.get("schedulers", [])):
        scheduler.load_state_dict(saved)
    torch.set_rng_state(state["rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])


RESHARDED_FROM = []  # the world size of the checkpoint this run resumed from, when resharded


def resume_checkpoint(args, rank, modules, optimizers, schedulers=(), model=None):
    """(first step, losses of the steps before it). A run started with --resume, or restarted
    by the launcher after a failure, continues from the newest checkpoint that is complete
    and readable on every rank (step 0 without one); otherwise it starts at step 0. Every rank
    takes the same decision."""
    global RESUMED_FROM
    if not resuming(args):
        return 0, []
    with uncounted():  # reading a checkpoint, not training: left out of the bytes sent
        first, losses, passed = choose_checkpoint(args, rank, modules, optimizers, schedulers, model)
    RESUMED_FROM = first
    if rank == 0:
        resharded = f" (written on {RESHARDED_FROM[0]} ranks under another placement: resharded)" \
            if RESHARDED_FROM else ""
        print(f"resuming from the checkpoint at step {first}{resharded}" if first else
              "no usable checkpoint: starting at step 0", flush=True)
        report_event(args.out, {"resumed_from": first, "steps": args.steps, "passed_over": passed,
                                **({"resharded_from": RESHARDED_FROM[0]} if RESHARDED_FROM else {})})
    return first, losses


def choose_checkpoint(args, rank, modules, optimizers, schedulers, model=None):
    """Load the newest checkpoint that is complete and readable on every rank: (its step, the
    losses before it, the newer ones passed over as {"step", "dir", "why"}), or (0, [], ...)
    without one. One that does not fit this program stops the run."""
    world = dist.get_world_size()
    root = os.path.join(args.out or ".", CHECKPOINT_DIR)
    mine = complete_steps(root, args.steps)
    every = [None] * world
    dist.all_gather_object(every, mine)  # several machines: a step complete on all of them
    passed = []
    for step in [s for s in mine if all(s in other for other in every)]:
        info, where = complete_info(root, step), os.path.join(root, f"step_{step}")
        same = info.get("layout", LAYOUT) == LAYOUT
        blocker = None if same else info.get("reshard", "it was written by an earlier placer") or RESHARD
        if blocker:
            raise StopRun("checkpoint mismatch", step, f"the checkpoint {where} was written under another "
                          f"placement ({info.get('world')} ranks) and cannot be resharded: {blocker}")
        if any(n.startswith("dcp/") for n in info.get("files", {})):  # saved by the model's names
            state, why = read_by_name(root, step, rank, world, info, same)
            verdict = torch.tensor([0 if state is not None else 1])
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)  # 0: usable on every rank
            if verdict.item() == 0:
                misfit = load_saved_by_name(where, state, model, modules, optimizers, schedulers, same)
                if misfit:
                    raise StopRun("checkpoint mismatch", step, f"the checkpoint {where} does not fit this "
                                  f"program: rank {rank}: {misfit}")
                if not same:
                    RESHARDED_FROM.append(info.get("world"))
                return step, state["losses"], passed
        else:
            state, why = read_checkpoint(root, step, rank, world)
            misfit = fits(state, modules, optimizers, schedulers) if state is not None else None
            verdict = torch.tensor([2 if misfit else 0 if state is not None else 1])
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)  # 0: usable on every rank
            if verdict.item() == 2:
                detail = f": rank {rank}: {misfit}" if misfit else ""
                raise StopRun("checkpoint mismatch", step, f"the checkpoint {where} does not fit this program{detail}")
            if verdict.item() == 0:
                load_checkpoint(state, modules, optimizers, schedulers)
                return step, state["losses"], passed
        if why:
            print(f"rank {rank}: the checkpoint at step {step} is not usable ({why}); trying an older one",
                  file=sys.stderr, flush=True)
        whys = [None] * world
        dist.all_gather_object(whys, why)  # rank 0 reports which file failed, whichever rank read it
        passed.append({"step": step, "dir": os.path.join(root, f"step_{step}"), "why": next(w for w in whys if w)})
    return 0, [], passed
