"""A process's memory maps (/proc/<pid>/maps), split into glibc's malloc
arena heaps and everything else: the soak checks of issue #52, item 8
(`benchmarks/serve_soak.py`, tests/server/test_server_soak.py).

glibc gives threads malloc arenas of their own (at most 8
per core). Outside the main heap an arena grows in heaps of 64 MiB of
address space (`HEAP_SIZE`), each mapped PROT_NONE at a 64 MiB-aligned
address, its used front made read-write as the arena grows: two maps, the
read-write front and the PROT_NONE rest, or one once it is read-write to
its end, never PROT_NONE again (`malloc_trim` hands free pages back with
`madvise`). When an arena's peak use passes its heaps it maps one more,
and `free` unmaps the last one once it is free as a whole. So the count of
these maps follows each arena's peak use and where its free blocks lie,
not the objects alive: a heap that fills up loses its PROT_NONE rest (one
map fewer) and the next one adds two, one map more while resident memory
stays where it was. Their memory is what resident memory (VmRSS, after the
trim) measures; every other map (thread stacks, blocks malloc maps on their
own, loaded libraries, JIT code) is counted exactly by `count_maps`'s
"other_maps".
"""

from __future__ import annotations

HEAP_SIZE = 64 << 20      # glibc's HEAP_MAX_SIZE on 64-bit (2 x DEFAULT_MMAP_THRESHOLD_MAX)


def read_maps(pid: int | str = "self") -> list[tuple[int, int, str, str]]:
    """/proc/<pid>/maps as [(start, end, perms, path)] in address order;
    path "" for anonymous memory. Raises OSError where there is no such
    process (or no /proc)."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end, fields[1], fields[5].strip() if len(fields) > 5 else ""))
    return out


def arena_heaps(maps: list[tuple[int, int, str, str]]) -> list[list[tuple[int, int, str, str]]]:
    """The glibc arena heaps among `maps` (`read_maps`'s rows), each as its
    rows: an anonymous read-write map at a multiple of `HEAP_SIZE`, either
    `HEAP_SIZE` long or followed at once by the anonymous PROT_NONE map that
    ends the `HEAP_SIZE` span."""
    heaps = []
    for i, (start, end, perms, path) in enumerate(maps):
        if path or perms != "rw-p" or start % HEAP_SIZE:
            continue
        if end - start == HEAP_SIZE:
            heaps.append([maps[i]])
        elif i + 1 < len(maps) and maps[i + 1] == (end, start + HEAP_SIZE, "---p", ""):
            heaps.append([maps[i], maps[i + 1]])
    return heaps


def count_maps(pid: int | str = "self") -> dict:
    """{"maps": all maps, "heaps": glibc arena heaps, "heap_maps": their
    maps, "other_maps": the rest} of process pid (module docstring).
    Raises OSError where there is no such process."""
    maps = read_maps(pid)
    heaps = arena_heaps(maps)
    heap_maps = sum(len(rows) for rows in heaps)
    return {"maps": len(maps), "heaps": len(heaps), "heap_maps": heap_maps,
            "other_maps": len(maps) - heap_maps}


__all__ = ["HEAP_SIZE", "arena_heaps", "count_maps", "read_maps"]
