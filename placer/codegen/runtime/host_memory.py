# host_memory: a worker keeps the memory it frees, so that each step's new tensors reuse pages
# already mapped. By default glibc's malloc hands a freed block of a few MB back to the kernel,
# and the next step's gradients, activations and optimizer temporaries fault in fresh zeroed
# pages: on the 2-core bench machine 1.6 us a 4 KiB page, so Adam's step over 2.6 MB of
# parameters took 2.3 ms instead of 0.8 (bench/results/ has the programs' step times).
import contextlib
import ctypes
import os


def keep_freed_memory():
    # Blocks up to 32 MiB come from the heap, and up to 256 MiB freed at its top stays mapped.
    # A MALLOC_* or GLIBC_TUNABLES setting of the user's wins; off glibc (macOS, Windows) nothing
    # changes.
    if any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in os.environ):
        return
    with contextlib.suppress(OSError, AttributeError, TypeError):
        mallopt = ctypes.CDLL(None).mallopt
        mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
