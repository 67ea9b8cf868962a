"""jaxinfer_tools.bench.maps: glibc's arena heaps told apart from the other
memory maps of a process (the soak checks of issue #52, item 8)."""

import ctypes
import sys
import threading

import pytest

from jaxinfer_tools.bench.maps import HEAP_SIZE, arena_heaps, count_maps, read_maps

H = HEAP_SIZE
MiB = 1 << 20


def test_arena_heaps_finds_partial_and_full_heaps_only():
    base = 0x7F00_0000_0000          # a multiple of 64 MiB
    maps = [
        (base - 8 * MiB, base - 4096, "rw-p", ""),             # a thread stack, then a heap
        (base, base + 3 * MiB, "rw-p", ""),                     # heap: used front ...
        (base + 3 * MiB, base + H, "---p", ""),                 # ... and PROT_NONE rest
        (base + H, base + 2 * H, "rw-p", ""),                   # heap read-write to its end
        (base + 2 * H, base + 2 * H + MiB, "rw-p", ""),         # aligned, rest not PROT_NONE
        (base + 2 * H + MiB, base + 2 * H + 2 * MiB, "rw-p", ""),
        (base + 3 * H, base + 3 * H + MiB, "rw-p", ""),         # aligned, PROT_NONE too short
        (base + 3 * H + MiB, base + 3 * H + 9 * MiB, "---p", ""),
        (base + 4 * H, base + 4 * H + MiB, "rw-p", "/dev/shm/x"),   # a file
        (base + 4 * H + MiB, base + 5 * H, "---p", ""),
        (base + 5 * H + 4096, base + 5 * H + MiB, "rw-p", ""),  # not aligned
        (base + 5 * H + MiB, base + 6 * H + 4096, "---p", ""),
    ]
    assert arena_heaps(maps) == [maps[1:3], maps[3:4]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and glibc")
def test_a_threads_malloc_lies_in_an_arena_heap():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    seen = {}

    def allocate():             # a new thread's first malloc gets an arena of its own
        ptr = libc.malloc(1000)
        seen["ptr"], seen["maps"], seen["counts"] = ptr, read_maps(), count_maps()
        libc.free(ptr)
    thread = threading.Thread(target=allocate)
    thread.start()
    thread.join()
    ptr, maps, counts = seen["ptr"], seen["maps"], seen["counts"]
    main_heap = [(s, e) for s, e, _, path in maps if path == "[heap]"]
    if any(s <= ptr < e for s, e in main_heap):
        pytest.skip("glibc's arena limit reached: the thread shares the main heap")
    heaps = arena_heaps(maps)
    assert [rows for rows in heaps if rows[0][0] <= ptr < rows[0][0] + H], (hex(ptr), heaps)
    assert counts["heap_maps"] + counts["other_maps"] == counts["maps"]
    assert counts["heaps"] >= 1 and counts["heaps"] <= counts["heap_maps"] <= 2 * counts["heaps"]
