def save_checkpoint(out, step, rank, modules, optimizers, losses, schedulers=()):
    """Every rank saves what it holds, as plain tensors, to CHECKPOINT_DIR/step_N/rankR.pt:
    its modules' state (parameters and buffers; DTensor shards of FSDP and tensor parallel as
    their local pieces, so no device mesh is pickled), its optimizers' state (ZeRO: its own
    shard's) and their lr schedulers', its random number generator and the losses so far.
    The world and the placement are fixed by the spec, so rank R's file is read back by rank
    R. A step directory counts
    only once it holds COMPLETE (every file's size and sha256, hashed as it is written),
    written after every rank's file; then old checkpoints are rotated (CHECKPOINT_KEEP)."""
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
    state = {
        "step": step + 1,
        "rank": rank,
        "world": dist.get_world_size(),
        "modules": [local_tensors(m.state_dict()) for m in modules],
        "optimizers": [optimizer_state(opt) for opt in optimizers],
        "schedulers": [scheduler.state_dict() for scheduler in schedulers],
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        "losses": list(losses),
    }
    name, entry = f"rank{rank}.pt", {}
    replace_atomically(os.path.join(path, name), lambda tmp: entry.update(save_hashed(state, tmp)))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (name, entry))  # every rank's file is written: the checkpoint is complete
    if first_here:  # the files of this machine's ranks (each machine writes its own run directory)
        files = {n: d for n, d in sorted(every) if os.path.exists(os.path.join(path, n))}
        info = {"step": step + 1, "files": files}
        replace_atomically(os.path.join(path, "COMPLETE"), lambda tmp: write_json(tmp, info))
        rotate_checkpoints(root, step + 1)


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
        with open(os.path.join(path, "COMPLETE")) as f:
            entry = json.load(f).get("files", {}).get(name)
        if isinstance(entry, int):  # written by an earlier placer: sizes only
            entry = {"bytes": entry}
        size = os.path.getsize(os.path.join(path, name))
        if entry is not None and size != entry.get("bytes", size):
            return None, f"{name} is {size} bytes, not {entry['bytes']}"
        if entry is not None and "sha256" in entry and file_sha256(os.path.join(path, name)) != entry["sha256"]:
            return None, f"{name} is damaged: its sha256 is not the one COMPLETE records"
        state = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
    except Exception as e:  # missing, truncated or garbled: the checkpoint is not usable
        return None, f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if state.get("step") != step or state.get("rank") != rank or state.get("world") != world:
        return None, f"{name} holds step {state.get('step')} of rank {state.get('rank')} of {state.get('world')}"
    return state, None


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


def resume_checkpoint(args, rank, modules, optimizers, schedulers=()):
    """(first step, losses of the steps before it). A run started with --resume, or restarted
    by the launcher after a failure, continues from the newest checkpoint that is complete
    and readable on every rank (step 0 without one); otherwise it starts at step 0. Every rank
    takes the same decision."""
    global RESUMED_FROM
    if not resuming(args):
        return 0, []
    with uncounted():  # reading a checkpoint, not training: left out of the bytes sent
        first, losses, passed = choose_checkpoint(args, rank, modules, optimizers, schedulers)
    RESUMED_FROM = first
    if rank == 0:
        print(f"resuming from the checkpoint at step {first}" if first else
              "no usable checkpoint: starting at step 0", flush=True)
        report_event(args.out, {"resumed_from": first, "steps": args.steps, "passed_over": passed})
    return first, losses


def choose_checkpoint(args, rank, modules, optimizers, schedulers):
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
        state, why = read_checkpoint(root, step, rank, world)
        misfit = fits(state, modules, optimizers, schedulers) if state is not None else None
        verdict = torch.tensor([2 if misfit else 0 if state is not None else 1])
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)  # 0: usable on every rank
        if verdict.item() == 2:
            where = os.path.join(root, f"step_{step}")
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
