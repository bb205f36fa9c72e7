"""Peak bytes of tensors allocated while a function runs, from torch's own allocator accounting (its
profiler's allocation events): the measure behind "a sync holds about one bucket of extra memory".
CPU allocations of the calling thread and of threads the profiler sees; slow, for tests and benchmarks.
A free the profiler misses (made on a thread it does not see, such as gloo's workers) shows when its address is
allocated again: the block is dropped then, so the measure can still over-count, never under-count."""

from __future__ import annotations

from collections.abc import Callable


def allocator_peak(fn: Callable[[], object]) -> tuple[int, object]:
    """(peak bytes alive above the starting point while fn() ran, fn's result)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0].name == "Allocation":
            events.append((node.start_time_ns, node.typed[1].alloc_size, node.typed[1].ptr))
        stack.extend(node.children)
    return peak_bytes(events), result


def peak_bytes(events: list[tuple[int, int, int]]) -> int:
    """Peak bytes alive above the start over (time ns, bytes (< 0: a free), address) allocation events."""
    peak = alive = 0
    blocks: dict[int, int] = {}  # address -> bytes of the blocks allocated while fn() ran and not seen freed
    for _, size, ptr in sorted(events):
        if size > 0:
            alive += size - blocks.pop(ptr, 0)  # an address allocated again: its earlier block was freed unseen
            blocks[ptr] = size
        else:
            blocks.pop(ptr, None)
            alive += size
        peak = max(peak, alive)
    return peak
