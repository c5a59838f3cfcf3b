# ---------------------------------------------------------------------------- reference


def reference(args):
    """The whole model in this one process, the whole batch, one optimizer: what every
    placement must reproduce (`placer run --check` compares the two runs)."""
    simulate, _ = simulation(args)
    device = bind_device(DEVICES[0], simulate)
    if device.type == "cpu":  # a worker's share of the cores: sums then add up in the same order
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(DEVICES)))
    model = build_model().to(device)
    if args.perturb:  # a relative nudge about float32 rounding's size; a tied parameter is nudged once
        noise = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                scale = 1 + args.perturb * torch.randn(p.shape, generator=noise, dtype=torch.float64)
                p.copy_(p.double() * scale.to(p.device))
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer)  # None without training.lr_schedule
    losses, data = [], batches(args.steps)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = next(data)
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for xm, ym in zip(x.chunk(ACCUMULATE), y.chunk(ACCUMULATE)):  # training.accumulate's micro-steps
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=PRECISION == "bf16"):
                micro = compute_loss(run_model(model, xm.to(device)), ym.to(device)) * (xm.shape[0] / BATCH_SIZE)
            micro.backward()  # the gradients add up in .grad
            loss += micro.detach()
        facts = {}
        if CLIP_GRAD_NORM is not None:
            facts["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD_NORM).item()
        if step == 0 and args.grads and args.out:  # as the step takes them (clipped)
            write_first_grads(args.out, {n: p.grad.detach().cpu().clone() for n, p in
                                         model.named_parameters(remove_duplicate=False) if p.grad is not None})
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(finite_loss(loss.item(), step))
        report_step(args.out, step, args.steps, losses[-1], start, **facts)
    seconds = time.perf_counter() - start
    if args.out:
        # a tied parameter under each of its names: a placed run saves each copy under its own
        params = {n: p.detach().cpu().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        write_outputs(args.out, losses, params, seconds, devices=[str(device)], world_size=1,
                      simulated=simulate, backend=None, tied=tied_names(model))


# ---------------------------------------------------------------------------- main


def die_with_launcher():
    """Started by `placer run` (PLACER_LAUNCHER_PID): write to its log, and end with it. Its Ctrl-C (SIGINT, passed on
    to the workers) ends this process at once, even inside a collective; and on Linux the kernel
    kills it when the launcher dies, SIGKILL included, rather than leave it training as an orphan."""
    launcher = os.environ.get("PLACER_LAUNCHER_PID")
    if not launcher:
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    os.dup2(2, 1)  # placer run keeps one log per device, its stderr: prints join it in order
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != int(launcher):  # it died before prctl took effect
        os._exit(1)


def main():
    args = arguments()
    die_with_launcher()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if args.reference or "RANK" in os.environ:  # the reference, or a worker started by torchrun
        watch_lr()
        if not args.reference and args.out and os.environ.get("PLACER_LAUNCHER_PID"):
            STATUS.open(args.out, int(os.environ["RANK"]))  # placer run reads it when a rank hangs
        try:
            if args.reference:
                reference(args)
            else:
                train(args)
            code = 0
        except StopRun as e:
            print(f"stopped: {e}", file=sys.stderr)
            if args.out:
                info = {"reason": e.reason, "step": e.step, "message": str(e)}
                replace_atomically(os.path.join(args.out, "stopped.json"), lambda tmp: write_json(tmp, info))
            # placer run reads stopped.json; exiting 0 keeps torch elastic from restarting a
            # run that would stop at the same step again
            code = 0 if os.environ.get("PLACER_LAUNCHER_PID") and args.out else 1
        except SystemExit as e:  # a message (the wrong world size): a traceback like any error's, so that
            # placer run tells it from the log lines before it
            if not isinstance(e.code, (int, type(None))):
                sys.excepthook(*sys.exc_info())
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # its traceback as Python prints it, then out at once (below): in its
            # shutdown gloo would first wait out the operations still pending with a peer that
            # stopped answering, timeout_s more
            sys.excepthook(*sys.exc_info())
            code = 1
        # Leave without Python's shutdown: gloo's threads may still be freeing the last
        # collective's tensors, and doing that while the interpreter shuts down aborts the
        # process (SIGABRT, about 1 run in 20 on 2 cores). Everything is written by now, or
        # the run failed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    else:  # `python program.py` starts the workers before it imports torch (above); main() called otherwise
        sys.exit(start_workers())


